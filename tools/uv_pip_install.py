"""``uv pip install`` into the running interpreter's environment, seeing the packages pip would see.

Usage: ``python tools/uv_pip_install.py [uv pip install arguments]``. The Makefile installs with uv because it
resolves and unpacks in seconds what ``pip install`` takes minutes for (torch, transformers, ray and the test
extras on 2 cores). uv does not read pip's configuration, so this passes on what pip is configured with
(``pip config list``: index-url, extra-index-url, find-links, constraint and cert, from the environment first,
then the ``install`` section, then ``global``). Every index counts equally, as in pip
(``--index-strategy unsafe-best-match``), and modules are compiled to bytecode at install, as pip does.

Raises ``SystemExit`` with uv's exit status.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from uv import find_uv_bin

SECTIONS = (":env:", "install", "global")  # highest precedence first, as pip applies them


def pip_config() -> dict[str, str]:
    """The effective value of each pip option set in a config file or a ``PIP_*`` variable."""
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             check=True).stdout
    found: dict[tuple[str, str], str] = {}
    for line in listing.splitlines():
        name, sep, value = line.partition("=")
        section, dot, key = name.rpartition(".")
        if sep and dot:
            found[(section, key)] = " ".join(shlex.split(value))
    config: dict[str, str] = {}
    for section in reversed(SECTIONS):
        config.update({key: value for (s, key), value in found.items() if s == section})
    return config


def uv_arguments(config: dict[str, str]) -> list[str]:
    # Bytecode at install time, as pip does: otherwise, where PYTHONDONTWRITEBYTECODE is set, every process
    # compiles the modules it imports again (torch alone: about 2 s more per start).
    args = ["--compile-bytecode", "--index-strategy", "unsafe-best-match"]
    if "index-url" in config:
        args += ["--index-url", config["index-url"]]
    for option in ("extra-index-url", "find-links", "constraint"):
        for value in config.get(option, "").split():
            args += [f"--{option}", value]
    return args


def main(argv: list[str]) -> int:
    config = pip_config()
    env = dict(os.environ)
    if "cert" in config:
        env.setdefault("SSL_CERT_FILE", config["cert"])
    if "timeout" in config or "default-timeout" in config:
        env.setdefault("UV_HTTP_TIMEOUT", config.get("timeout", config.get("default-timeout", "")))
    cmd = [find_uv_bin(), "pip", "install", "--python", sys.executable, *uv_arguments(config), *argv]
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
