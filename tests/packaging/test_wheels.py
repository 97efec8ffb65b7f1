"""tokenmill and its platform plugins as built wheels, installed non-editable into a fresh venv: every source file
is in its wheel, every module imports, ``tokenmill --version`` / ``tokenmill plugins`` work, and the engine
generates. ``make test`` installs everything editable; only this test sees what ``pip install`` of a release does.
"""

from __future__ import annotations

import json
import subprocess
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.conftest import hf_greedy
from tests.engine.tiny_model import tiny_llama_with_tokenizer
from tests.packaging.wheels import DISTRIBUTIONS, INSTALLED, build_wheels, copy_source_tree, make_venv, source_files, \
    venv_env

CHECKS = Path(__file__).with_name("installed_checks.py")
PACKAGES = ("tokenmill", "tokenmill_cpu", "tokenmill_cuda", "tokenmill_rocm")


@pytest.fixture(scope="session")
def source_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_source_tree(tmp_path_factory.mktemp("packaging") / "src")


@pytest.fixture(scope="session")
def wheels(source_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    try:
        return build_wheels(source_tree, tmp_path_factory.mktemp("wheels"))
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"pip wheel failed:\n{exc.stdout}\n{exc.stderr}")


@pytest.fixture(scope="session")
def wheel_venv(wheels: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("wheel_venv") / "venv"
    try:
        make_venv(venv, [wheels[d] for d in INSTALLED])
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"installing the wheels failed:\n{exc.stdout}\n{exc.stderr}")
    return venv


def run_in(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``args`` with ``venv``'s bin/ first on PATH, from a folder with no source tree in it."""
    return subprocess.run(list(args), cwd=venv, env=venv_env(venv), capture_output=True, text=True, timeout=540)


def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if ".dist-info/" not in n}


def wheel_metadata(wheel: Path) -> dict[str, list[str]]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(z.read(name).decode())
    return {key: message.get_all(key) or [] for key in ("Name", "Version", "Requires-Dist")}


@pytest.mark.parametrize("distribution", list(DISTRIBUTIONS))
def test_wheel_holds_every_file_of_its_package_folders(distribution: str, source_tree: Path,
                                                       wheels: dict[str, Path]) -> None:
    """A folder of modules without ``__init__.py``, a package-data pattern that misses a file (the CPU plugin's
    csrc/ is compiled at run time), or a stale module from an old build: each fails here, by path."""
    expected = source_files(source_tree, distribution)
    shipped = wheel_names(wheels[distribution])
    assert sorted(expected - shipped) == [], "source files missing from the wheel (a folder without __init__.py?)"
    assert sorted(shipped - expected) == [], "files in the wheel that the source tree does not have"


def test_one_version_and_plugin_requirements_met(wheels: dict[str, Path]) -> None:
    from tokenmill.version import __version__

    tokenmill_meta = wheel_metadata(wheels["."])
    assert tokenmill_meta["Version"] == [__version__]
    for folder, wheel in wheels.items():
        if folder == ".":
            continue
        (requirement,) = [Requirement(r) for r in wheel_metadata(wheel)["Requires-Dist"]
                          if Requirement(r).name == "tokenmill"]
        assert requirement.specifier.contains(__version__, prereleases=True), (folder, str(requirement))


def test_installed_wheels_import_every_module_from_the_venv(wheel_venv: Path) -> None:
    result = run_in(wheel_venv, "python", str(CHECKS), *PACKAGES)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout)
    assert report["failed"] == {}
    for name in PACKAGES:  # the wheels' copies, not the test venv's editable installs
        assert Path(report["files"][name]).resolve().is_relative_to(wheel_venv.resolve()), report["files"][name]
    assert Path(report["dist_location"]).resolve().is_relative_to(wheel_venv.resolve())
    assert report["version"] == report["dist_version"]
    assert report["cpu_kernel_sources_missing"] == []
    assert {"tokenmill.lora.request", "tokenmill.models.llama", "tokenmill.entrypoints.openai.api_server",
            "tokenmill_cpu.kernels"} <= {m for mods in report["modules"].values() for m in mods}


def test_installed_cli_reports_version_and_plugins(wheel_venv: Path) -> None:
    from tokenmill.version import __version__

    version = run_in(wheel_venv, "tokenmill", "--version")
    assert version.returncode == 0 and version.stdout.strip() == f"tokenmill {__version__}", version
    plugins = run_in(wheel_venv, "tokenmill", "plugins", "--json")
    assert plugins.returncode == 0, plugins.stderr[-4000:]
    report = json.loads(plugins.stdout)
    assert report["tokenmill_version"] == report["distributions"]["tokenmill"]["version"] == __version__
    assert {"tokenmill-cpu", "tokenmill-cuda", "tokenmill-rocm"} <= set(report["distributions"])
    assert report["selection"]["selected"] == "cpu" and report["warnings"] == []


GENERATE = """
import json, sys
from tokenmill import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", enforce_eager=True, num_gpu_blocks_override=32)
prompt = [int(t) for t in sys.argv[2:]]
out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
print(json.dumps(list(out[0].outputs[0].token_ids)))
"""


def test_installed_wheels_generate_offline(wheel_venv: Path, tiny_llama_dir: str,
                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    model = tiny_llama_with_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("wheel_model") / "model")
    prompt = [1, 17, 42, 99, 250]
    result = run_in(wheel_venv, "python", "-c", GENERATE, model, *map(str, prompt))
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == hf_greedy(model, [prompt], 4)[0]
