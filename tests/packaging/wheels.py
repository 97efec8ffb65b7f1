"""Building tokenmill's wheels from a clean copy of the source tree and installing them into a fresh venv.

Helpers of tests/packaging/test_wheels.py. The venv reuses the test venv's installed dependencies (torch,
transformers, ...) through a ``.pth`` line naming its site-packages, so nothing is downloaded; ``.pth`` files
found in a directory that a ``.pth`` line adds are not run, so the editable installs of the test venv (whose
finders are started by such files) stay off and the wheels' copies are the ones imported.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the ``test`` extra installs it there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]

# Distribution folder -> {import path prefix in the wheel: source folder, relative to ROOT}.
DISTRIBUTIONS: dict[str, dict[str, str]] = {
    ".": {"tokenmill": "framework", "tokenmill/models": "models", "tokenmill/entrypoints": "entrypoints"},
    "plugins/cpu": {"tokenmill_cpu": "plugins/cpu/tokenmill_cpu"},
    "plugins/cuda": {"tokenmill_cuda": "plugins/cuda/tokenmill_cuda"},
    "plugins/rocm": {"tokenmill_rocm": "plugins/rocm/tokenmill_rocm"},
    "examples/platform_plugin": {"tokenmill_cpuref": "examples/platform_plugin/tokenmill_cpuref"},
}
# Installed into the fresh venv (the example is only built: the test venv has it installed already).
INSTALLED = (".", "plugins/cpu", "plugins/cuda", "plugins/rocm")

_TOP_LEVEL_SKIPPED = {".git", ".venv", "build", "dist", ".pytest_cache", ".hypothesis", ".whl"}


def _ignore(folder: str, names: list[str]) -> set[str]:
    """What the copy leaves out: VCS data, virtual environments, build outputs and byte code."""
    skipped = {n for n in names if n == "__pycache__" or n.endswith((".pyc", ".egg-info"))}
    if Path(folder) == ROOT:
        skipped |= _TOP_LEVEL_SKIPPED & set(names)
    if "pyproject.toml" in names:  # a distribution folder: its in-tree build outputs
        skipped |= {"build", "dist"} & set(names)
    return skipped | {n for n in names if (Path(folder) / n / "pyvenv.cfg").exists()}


def copy_source_tree(dest: Path) -> Path:
    """Copy the project (without build outputs, venvs, caches) to ``dest``: the wheels are built from there, so
    that no ``build/`` folder left in the checkout by an earlier in-tree build leaks stale modules into them."""
    shutil.copytree(ROOT, dest, ignore=_ignore, symlinks=True)
    return dest


def source_files(tree: Path, distribution: str) -> set[str]:
    """The files a wheel of ``distribution`` (a key of :data:`DISTRIBUTIONS`) must hold, as wheel paths: every
    file below its package folders in ``tree`` except byte code and hidden files."""
    expected = set()
    for prefix, folder in DISTRIBUTIONS[distribution].items():
        base = tree / folder
        for path in base.rglob("*"):
            rel = path.relative_to(base)
            if path.is_dir() or "__pycache__" in rel.parts or path.suffix == ".pyc":
                continue
            if any(part.startswith(".") for part in rel.parts):
                continue
            expected.add(f"{prefix}/{rel.as_posix()}")
    return expected


def build_wheels(tree: Path, out: Path) -> dict[str, Path]:
    """Build the wheel of every folder in :data:`DISTRIBUTIONS` (one ``pip wheel`` run, no build isolation: the
    test venv has setuptools and wheel); ``{distribution folder: wheel file}``."""
    folders = list(DISTRIBUTIONS)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
           "-w", str(out), *(str(tree / f) for f in folders)]
    subprocess.run(cmd, check=True, cwd=tree, env=_clean_env(), capture_output=True, text=True, timeout=300)
    wheels = {}
    for folder in folders:
        name = _project_name(tree / folder).replace("-", "_")
        (found,) = out.glob(f"{name}-*.whl")
        wheels[folder] = found
    return wheels


def _project_name(folder: Path) -> str:
    with open(folder / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["name"]


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def make_venv(path: Path, wheels: list[Path]) -> Path:
    """A venv at ``path`` with ``wheels`` installed (not editable, no dependencies) that imports everything else
    from the test venv; its ``python``.

    The ``.pth`` line is written after the install: pip would otherwise find the test venv's (editable)
    tokenmill of the same version and skip the wheel.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "-q", *map(str, wheels)], check=True, env=_clean_env(), capture_output=True, text=True,
                   timeout=300)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True, timeout=300).stdout.strip()
    outer = [sysconfig.get_path("purelib"), *site.getsitepackages()]
    lines = list(dict.fromkeys(p for p in outer if Path(p).is_dir()))
    (Path(purelib) / "_tokenmill_test_deps.pth").write_text("\n".join(lines) + "\n")
    return python


def venv_env(venv: Path) -> dict[str, str]:
    """The environment for commands of ``venv``: its bin/ first, no PYTHONPATH, no user site, and the CPU plugin's
    C++ kernels off: they would compile afresh (minutes on 2 cores) for the venv's copy of csrc/, whose files
    the tests check are installed."""
    env = _clean_env()
    env["TOKENMILL_CPU_KERNELS"] = "0"
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["PYTHONNOUSERSITE"] = "1"
    return env
