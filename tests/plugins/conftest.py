"""Fixtures for plugin tests: fake distributions written to a temp dir, and isolation of global state.

Discovery is restricted to the temp dir with ``tokenmill.plugins.reset_for_tests(search_path=[...])``, so the
real tokenmill-cpu/cuda/rocm distributions installed in the venv do not count unless a test resets without a
search path.
"""

from __future__ import annotations

import itertools
import re
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tokenmill.attention.registry import AttentionBackendRegistry
from tokenmill.layers.custom_op import CustomOpRegistry
from tokenmill.model_loader import ModelRegistry
from tokenmill.platforms import reset_current_platform
from tokenmill.plugins import reset_for_tests
from tokenmill.tool_parsers import ToolParserManager

_counter = itertools.count()

PLATFORM_MODULE = '''
from tokenmill.platforms import Platform, PlatformSpec
from tokenmill.plugins import hookimpl

DETECT_CALLS = []


class FakePlatform(Platform):
    name = {name!r}
    device_type = "cpu"


def detect():
    DETECT_CALLS.append(1)
{detect_body}


@hookimpl
def tokenmill_platform():
    return PlatformSpec(name={name!r}, detect=detect, platform_cls=__name__ + ":FakePlatform")
'''


def _reset_all(search_path: list[Path] | None = None) -> None:
    reset_for_tests(search_path)
    reset_current_platform()
    ModelRegistry.reset_for_tests()
    AttentionBackendRegistry.reset_for_tests()
    ToolParserManager.reset_for_tests()
    CustomOpRegistry.reset_for_tests()


@dataclass
class FakeSite:
    """A directory on ``sys.path`` holding fake distributions; the only place entry points are read from."""

    root: Path
    modules: list[str] = field(default_factory=list)

    def unique_module(self, stem: str) -> str:
        return f"{stem}_{next(_counter)}"

    def add_module(self, module: str, source: str) -> None:
        (self.root / f"{module}.py").write_text(textwrap.dedent(source))
        self.modules.append(module)

    def add_distribution(self, dist_name: str, entry_points: dict[str, dict[str, str]]) -> None:
        """Write ``<dist>-0.1.dist-info`` with METADATA and entry_points.txt ({group: {name: value}})."""
        info = self.root / f"{re.sub(r'[-.]+', '_', dist_name)}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.1\n")
        lines = []
        for group, eps in entry_points.items():
            lines.append(f"[{group}]")
            lines.extend(f"{name} = {value}" for name, value in eps.items())
            lines.append("")
        (info / "entry_points.txt").write_text("\n".join(lines))
        _reset_all([self.root])

    def use_all_distributions(self) -> None:
        """Discover entry points everywhere on ``sys.path`` (the installed plugins and this site's fakes)."""
        _reset_all()

    def add_platform_plugin(self, dist_name: str, ep_name: str, detect_body: str, name: str | None = None) -> str:
        """A platform distribution whose detect() runs ``detect_body`` (indented code). Returns the module."""
        module = self.unique_module(f"fake_platform_{ep_name}")
        body = textwrap.indent(textwrap.dedent(detect_body).strip(), "    ")
        self.add_module(module, PLATFORM_MODULE.format(name=name or ep_name, detect_body=body))
        self.add_distribution(dist_name, {"tokenmill.platforms": {ep_name: module}})
        return module


@pytest.fixture
def clean_plugin_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No TOKENMILL_PLUGINS / TOKENMILL_PLATFORM, fresh plugin manager, platform and registries."""
    for name in ("TOKENMILL_PLUGINS", "TOKENMILL_PLATFORM", "TOKENMILL_ATTENTION_BACKEND"):
        monkeypatch.setenv(name, "")  # recorded, so a value a test sets (set_current_platform does) is undone
        monkeypatch.delenv(name)
    _reset_all()
    yield
    _reset_all()


@pytest.fixture
def fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_plugin_state: None) -> Iterator[FakeSite]:
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    site = FakeSite(root)
    _reset_all([root])
    yield site
    for module in site.modules:
        sys.modules.pop(module, None)
