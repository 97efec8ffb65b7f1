"""The conformance kit as a pytest plugin, for a vendor's own CI.

Installed with tokenmill (entry point ``tokenmill_conformance`` in group ``pytest11``), it does nothing unless
asked::

    pytest --tokenmill-platform mychip                  # one test per contract item
    pytest --tokenmill-platform mychip --tokenmill-device emulate
    pytest --tokenmill-platform mychip --tokenmill-attention-backend MYCHIP_FLASH
    pytest --tokenmill-platform mychip --tokenmill-items detect,kv_cache

Each contract item becomes a test named ``tokenmill-conformance[mychip]::<item>``: it passes, fails with the
item's message, or is skipped when the platform does not claim the feature. The items share one run's state
(the tiny model, the engines), in contract order.
"""

from __future__ import annotations

from typing import Any

import pytest

_STATE: dict[str, Any] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tokenmill", "tokenmill conformance kit")
    group.addoption("--tokenmill-platform", action="append", default=[], metavar="NAME",
                    help="Run the tokenmill conformance kit on this platform plugin (repeatable).")
    group.addoption("--tokenmill-device", default="auto", choices=["auto", "real", "emulate"],
                    help="Real device, emulated device, or auto (the plugin's detect() decides).")
    group.addoption("--tokenmill-attention-backend", default=None, metavar="NAME",
                    help="Check this registered attention backend instead of the platform's choice.")
    group.addoption("--tokenmill-items", default=None, metavar="ITEM,ITEM",
                    help="Only these contract items (comma-separated ids).")


class ConformanceItem(pytest.Item):
    """One contract item of one platform."""

    def __init__(self, *, platform: str, item: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.platform = platform
        self.item = item

    def runtest(self) -> None:
        from tokenmill.conformance.kit import _as_current_platform, resolve_target, run_item

        config = self.config
        key = self.platform
        if key not in _STATE:
            target, reason = resolve_target(self.platform, device=config.getoption("tokenmill_device"),
                                            attention_backend=config.getoption("tokenmill_attention_backend"))
            _STATE[key] = target
        target = _STATE[key]
        with _as_current_platform(target.run_cls):
            result = run_item(target, self.item)
        self.user_properties.append(("notes", "\n".join(result.notes)))
        if result.status == "skip":
            pytest.skip(f"{self.item}: {result.message}")
        if result.status == "fail":
            raise ConformanceFailure(f"contract item {self.item} of platform {self.platform} failed: {result.message}")

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, ConformanceFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "tokenmill-conformance", None, f"{self.platform}::{self.item}"


class ConformanceFailure(AssertionError):
    pass


class ConformanceCollector(pytest.Collector):
    def __init__(self, *, platform: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.platform = platform

    def collect(self) -> list[pytest.Item]:
        from tokenmill.conformance.kit import CONTRACT_ITEMS

        only = self.config.getoption("tokenmill_items")
        wanted = [i.strip() for i in only.split(",") if i.strip()] if only else list(CONTRACT_ITEMS)
        unknown = [i for i in wanted if i not in CONTRACT_ITEMS]
        if unknown:
            raise pytest.UsageError(f"--tokenmill-items: unknown item(s) {', '.join(unknown)}; items: "
                                    f"{', '.join(CONTRACT_ITEMS)}")
        return [ConformanceItem.from_parent(self, name=item, platform=self.platform, item=item) for item in wanted]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    for platform in config.getoption("tokenmill_platform") or []:
        collector = ConformanceCollector.from_parent(session, name=f"tokenmill-conformance[{platform}]",
                                                     platform=platform)
        items.extend(collector.collect())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for target in _STATE.values():
        for engine in target.cache.get("engines", []):
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
    _STATE.clear()
