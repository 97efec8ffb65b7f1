"""The conformance kit's runner: a platform plugin, the contract items, and the report.

``run_conformance("mychip")`` (or ``tokenmill plugins check mychip``, or the pytest plugin) takes the platform
through every item of :data:`CONTRACT_ITEMS` and returns a :class:`ConformanceReport`; ``report.ok`` is true only
when no item failed. Each item is a function of the :class:`ConformanceTarget` that raises
:class:`ContractFailure` (the message says what is wrong) or :class:`ItemSkipped` (the platform does not claim
the feature, with the reason).

Real or emulated device: when the plugin's ``detect()`` says this machine has its hardware, the items run on
it. Otherwise (``device="auto"``; or always with ``device="emulate"``) they run on an emulated device
(:mod:`tokenmill.conformance.emulation`): the platform's own class with device facts of a fake 16 GiB device,
tensors on the host CPU, Triton kernels in Triton's interpreter and device graphs through the CPU capture
emulator. That is how tokenmill's CI proves the CUDA and ROCm plugins on machines without GPUs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tokenmill.conformance.target import CheckFn, ConformanceTarget, ContractFailure, ItemSkipped
from tokenmill.platforms.interface import Platform
from tokenmill.plugins.manager import LoadedPlatformSpec

logger = logging.getLogger(__name__)


@dataclass
class ItemResult:
    """Attributes:
    item: the contract item's id (e.g. ``"attention.reference"``).
    status: ``"pass"``, ``"fail"`` or ``"skip"``.
    message: why it failed or was skipped (empty on a pass).
    notes: what was checked (one line each).
    seconds: wall time of the item.
    """

    item: str
    status: str
    message: str = ""
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class ConformanceReport:
    """Attributes:
    platform: the platform's name.
    plugin: ``"entry point 'x' of distribution y"`` (empty when a class was checked directly).
    mode: ``"real"`` (on the platform's device) or ``"emulated"`` (see the module docstring).
    mode_reason: why that mode.
    attention_backend: the backend checked (name and class).
    results: one per item run, in order.
    """

    platform: str
    plugin: str
    mode: str
    mode_reason: str
    attention_backend: str
    results: list[ItemResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No item failed (skipped items are not failures: the platform does not claim them)."""
        return bool(self.results) and all(r.status != "fail" for r in self.results)

    def counts(self) -> dict[str, int]:
        out = {"pass": 0, "fail": 0, "skip": 0}
        for r in self.results:
            out[r.status] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok, "counts": self.counts()}

    def format(self, verbose: bool = False) -> str:
        """The human-readable report (what ``tokenmill plugins check`` prints)."""
        lines = [
            f"tokenmill conformance kit: platform {self.platform}" + (f" ({self.plugin})" if self.plugin else ""),
            f"  device: {self.mode} ({self.mode_reason})",
            f"  attention backend: {self.attention_backend}",
        ]
        for r in self.results:
            head = f"{r.status.upper():<5}{r.item:<22}{r.seconds:6.1f} s"
            lines.append(head + (f"  {r.message.splitlines()[0]}" if r.message else ""))
            extra = r.message.splitlines()[1:] if r.message else []
            lines.extend(f"        {line}" for line in extra)
            if verbose or r.status == "fail":
                lines.extend(f"        - {n}" for n in r.notes)
        c = self.counts()
        verdict = "conforms" if self.ok else "DOES NOT CONFORM"
        lines.append(f"{c['pass']} passed, {c['fail']} failed, {c['skip']} skipped: platform {self.platform} {verdict}")
        return "\n".join(lines)


def _items() -> list[tuple[str, str, CheckFn]]:
    from tokenmill.conformance import checks_attention, checks_encoder, checks_engine, checks_ops, checks_platform

    return [
        ("detect", "detect() is cheap, initialises no device and answers (bool, reason)", checks_platform.check_detect),
        ("platform.class", "the Platform class: name, device type, backend, dtypes, worker",
         checks_platform.check_platform_class),
        ("dtypes", "dtype resolution and compute in every supported dtype", checks_platform.check_dtypes),
        ("memory", "device memory facts and KV-cache sizing answers", checks_platform.check_memory),
        ("attention.backend", "the chosen attention backend resolves; its KV-cache layout",
         checks_attention.check_backend),
        ("kv_cache", "keys/values land exactly in the slots of the slot mapping", checks_attention.check_kv_cache),
        ("attention.reference", "attention equals tokenmill's float64 reference on mixed paged batches",
         checks_attention.check_reference),
        ("attention.encoder_only", "bidirectional attention of whole sequences equals the float64 reference "
         "(backends declaring supports_encoder_only)", checks_encoder.check_encoder_only),
        ("attention.mm_prefix", "bidirectional spans among a request's tokens (mm_prefix_ranges) equal the float64 "
         "reference (backends declaring supports_mm_prefix)", checks_attention.check_mm_prefix),
        ("custom_ops", "replaced layers (RMSNorm, rotary, activations, fused MoE) equal the built-in ones",
         checks_ops.check_custom_ops),
        ("quantization", "--quantization kernels approximate the full-precision matmul", checks_ops.check_quantization),
        ("graph_capture", "decode steps replayed from captured graphs equal eager steps", checks_engine.check_graphs),
        ("e2e.greedy", "a tiny model's greedy tokens equal the torch reference backend's", checks_engine.check_e2e),
    ]


def contract_items() -> list[tuple[str, str]]:
    """``(item id, what it checks)`` for every contract item, in run order."""
    return [(item, what) for item, what, _ in _items()]


CONTRACT_ITEMS = ("detect", "platform.class", "dtypes", "memory", "attention.backend", "kv_cache",
                  "attention.reference", "attention.encoder_only", "attention.mm_prefix", "custom_ops",
                  "quantization", "graph_capture", "e2e.greedy")


def resolve_target(
    platform: str | type[Platform],
    *,
    device: str = "auto",
    attention_backend: str | None = None,
) -> tuple[ConformanceTarget, str]:
    """The target for ``platform`` (a platform name or entry-point name, or a Platform class) and why it runs
    on a real or an emulated device.

    Args:
        device: ``"auto"`` (real when the plugin's detector says this machine has the hardware), ``"real"``,
            or ``"emulate"``.

    Raises:
        tokenmill.platforms.UnknownPlatformError: no installed plugin has that name.
        ValueError: an unknown ``device`` mode.
    """
    from tokenmill.conformance.emulation import emulated_platform, prepare_emulation
    from tokenmill.platforms.selection import _pick_by_name, _run_detector, load_platform_class
    from tokenmill.plugins.manager import get_platform_specs

    if device not in ("auto", "real", "emulate"):
        raise ValueError(f"device must be 'auto', 'real' or 'emulate', got {device!r}")
    plugin: LoadedPlatformSpec | None = None
    if isinstance(platform, str):
        plugin = _pick_by_name(platform, get_platform_specs())
        cls = load_platform_class(plugin)
    else:
        cls = platform
    if device == "auto":
        if plugin is None:
            emulate, reason = cls.device_type != "cpu", "a class was given; no detector to ask"
        else:
            result = _run_detector(plugin)
            emulate = not result.active
            said = result.error or result.reason or ("active" if result.active else "declined")
            reason = f"detect() {'is active' if result.active else 'declined'}: {said}"
    else:
        emulate, reason = device == "emulate", f"device={device} requested"
    if emulate:
        prepare_emulation()
        run_cls = emulated_platform(cls)
        reason += "; device facts of a fake 16 GiB device, tensors on the host CPU, Triton interpreted, graphs emulated"
    else:
        run_cls = cls
    target = ConformanceTarget(cls, run_cls, plugin, emulate, run_cls.make_device(0), attention_backend)
    return target, reason


@contextlib.contextmanager
def _as_current_platform(cls: type[Platform]) -> Iterator[None]:
    from tokenmill.attention.selector import _BACKEND, set_attn_backend
    from tokenmill.platforms import current as current_mod

    saved = (current_mod._current, current_mod._selection, _BACKEND, os.environ.get("TOKENMILL_PLATFORM"))
    current_mod._current, current_mod._selection = cls, None
    os.environ.pop("TOKENMILL_PLATFORM", None)
    try:
        yield
    finally:
        current_mod._current, current_mod._selection = saved[0], saved[1]
        set_attn_backend(saved[2])  # type: ignore[arg-type]
        if saved[3] is None:
            os.environ.pop("TOKENMILL_PLATFORM", None)
        else:
            os.environ["TOKENMILL_PLATFORM"] = saved[3]


def run_item(target: ConformanceTarget, item: str) -> ItemResult:
    """Run one contract item on ``target`` (the platform must be current: see :func:`run_conformance`)."""
    table = {i: fn for i, _, fn in _items()}
    if item not in table:
        raise ValueError(f"unknown contract item {item!r}; items: {', '.join(table)}")
    target.notes = []
    start = time.perf_counter()
    try:
        table[item](target)
        status, message = "pass", ""
    except ContractFailure as exc:
        status, message = "fail", str(exc)
    except ItemSkipped as exc:
        status, message = "skip", str(exc)
    except Exception as exc:  # noqa: BLE001 - any error of the platform's code is a failure of the item
        tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip().splitlines()[-4:]
        status, message = "fail", f"raised {type(exc).__name__}: {exc}\n" + "\n".join(tail)
    return ItemResult(item, status, message, list(target.notes), time.perf_counter() - start)


def run_conformance(
    platform: str | type[Platform],
    *,
    device: str = "auto",
    attention_backend: str | None = None,
    items: Sequence[str] | None = None,
    on_result: Callable[[ItemResult], None] | None = None,
) -> ConformanceReport:
    """Take ``platform`` through the contract (see the module docstring).

    Args:
        platform: a platform (or platform entry-point) name of an installed plugin, or a Platform class.
        device: ``"auto"``, ``"real"`` or ``"emulate"``.
        attention_backend: check this registered backend (or ``"module:Class"``) instead of the platform's.
        items: only these contract items (ids of :data:`CONTRACT_ITEMS`); all by default.
        on_result: called with each item's result as soon as it is known (the CLI prints them).

    Raises:
        tokenmill.platforms.UnknownPlatformError: no plugin has that name.
        ValueError: an unknown item or device mode.
    """
    wanted = list(items) if items else list(CONTRACT_ITEMS)
    unknown = [i for i in wanted if i not in CONTRACT_ITEMS]
    if unknown:
        raise ValueError(f"unknown contract item(s) {', '.join(unknown)}; items: {', '.join(CONTRACT_ITEMS)}")
    target, reason = resolve_target(platform, device=device, attention_backend=attention_backend)
    report = ConformanceReport(
        platform=target.name,
        plugin=target.plugin.describe().split(" (", 1)[1].rstrip(")") if target.plugin else "",
        mode="emulated" if target.emulated else "real",
        mode_reason=reason,
        attention_backend="?",
    )
    with _as_current_platform(target.run_cls), _quiet_engine_logs():
        try:
            report.attention_backend = target.backend_choice().describe()
        except Exception as exc:  # noqa: BLE001 - reported by the attention.backend item
            report.attention_backend = f"cannot be resolved ({type(exc).__name__}: {exc})"
        for item in wanted:
            result = run_item(target, item)
            report.results.append(result)
            if on_result is not None:
                on_result(result)
        for engine in target.cache.get("engines", []):
            with contextlib.suppress(Exception):
                engine.shutdown()
    return report


@contextlib.contextmanager
def _quiet_engine_logs() -> Iterator[None]:
    """Engine start-up logs of the kit's tiny engines are noise in a conformance report."""
    names = ["tokenmill.engine", "tokenmill.worker", "tokenmill.model_loader", "tokenmill.engine_args",
             "tokenmill.layers"]
    saved = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.WARNING)
    try:
        yield
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)
