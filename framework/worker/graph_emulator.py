"""A device-graph capture emulator on the CPU, so capture semantics are tested without a GPU.

A captured device graph (a CUDA graph) replays the kernels launched during capture, on the same memory, with
the arguments they had then. Python code does not run again at replay: anything decided on the host during
capture (a slice length read from a host list, a table looked up once and reused, a value cached on a Python
object) is frozen, and whatever the host computes only outside the captured region never happens. A test
that "replays" by calling the forward function again runs that Python code every time and cannot see such
bugs.

:class:`EmulatedGraphCapture` is a :class:`tokenmill.worker.graph_runner.GraphCapture` that records instead:

* every aten operation dispatched while the forward function runs (a ``TorchDispatchMode``), with its
  arguments as they were (tensors by identity, Python scalars by value), and every Triton kernel launched
  under ``TRITON_INTERPRET=1``;
* replay runs exactly those operations again, in order, on the same tensors: an operation whose output is a
  new tensor writes the new result into the tensor it produced at capture (the graph's private memory), so
  later operations, which hold that tensor, read the new values; views and in-place operations act on the
  same memory again by themselves.

Operations a real capture cannot contain are refused with :class:`GraphCaptureError` naming them: reading a
device value on the host (``.item()``, ``.tolist()``, ``bool(tensor)``) and operations whose output shape
depends on data (``nonzero``, boolean-mask indexing, ``unique``, ...), which synchronise on a GPU.

Used by the graph-runner tests and by the conformance kit (``tokenmill plugins check``) to run a platform's
graph path on the CPU. It emulates semantics, not speed: replay is slower than eager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tokenmill.worker.graph_runner import GraphCapture

aten = torch.ops.aten

# Ops that read device data on the host or size their output by it: a CUDA graph capture fails on them.
_REFUSED = {
    "_local_scalar_dense": "reads a device value on the host (.item(), .tolist(), int()/bool() of a tensor)",
    "item": "reads a device value on the host (.item())",
    "is_nonzero": "reads a device value on the host (bool() of a tensor)",
    "equal": "reads a device value on the host (torch.equal)",
    "nonzero": "sizes its output by the data (nonzero / boolean-mask indexing)",
    "nonzero_static": "",
    "masked_select": "sizes its output by the data",
    "unique": "sizes its output by the data",
    "_unique": "sizes its output by the data",
    "_unique2": "sizes its output by the data",
    "unique_dim": "sizes its output by the data",
    "unique_consecutive": "sizes its output by the data",
    "argwhere": "sizes its output by the data",
    "bincount": "sizes its output by the data (bincount)",
    "repeat_interleave": "sizes its output by the data (repeat_interleave with tensor repeats)",
}
_REFUSED = {k: v for k, v in _REFUSED.items() if v}


class GraphCaptureError(RuntimeError):
    """The captured function did something a device graph cannot record (the message names the operation)."""


@dataclass
class _Op:
    """One recorded operation: ``func(*args, **kwargs)`` produced ``out``."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any
    fresh: tuple[int, ...]  # positions (in the flattened output) of tensors the op allocated: refilled on replay

    def replay(self) -> None:
        result = self.func(*self.args, **self.kwargs)
        if not self.fresh:
            return
        new, _ = tree_flatten(result)
        old, _ = tree_flatten(self.out)
        for i in self.fresh:
            old[i].copy_(new[i])


def _fresh_outputs(args: Any, kwargs: dict[str, Any], out: Any) -> tuple[int, ...]:
    """Indices of the flattened outputs that are new tensors, i.e. share no memory with an argument (views of an
    argument and in-place or ``out=`` writes into one act on that memory again when the op is replayed)."""
    inputs, _ = tree_flatten((args, kwargs))
    storages = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    flat, _ = tree_flatten(out)
    return tuple(
        i for i, t in enumerate(flat)
        if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in storages
    )


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []
        self.paused = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        packet = getattr(func, "_overloadpacket", None)
        op_name = getattr(packet, "__name__", str(func))
        reason = _REFUSED.get(op_name)
        if op_name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1 and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
        ):
            reason = "indexes with a boolean mask, which sizes its work by the data (masked_fill / where do not)"
        if reason is not None and not (op_name == "repeat_interleave" and kwargs.get("output_size") is not None):
            raise GraphCaptureError(
                f"graph capture: {func} {reason}; a device graph cannot contain it. Move it out of the captured "
                "forward pass or compute it on the device without a host read."
            )
        out = func(*args, **kwargs)
        self.ops.append(_Op(func, args, dict(kwargs), out, _fresh_outputs(args, kwargs, out)))
        return out


@dataclass
class _Launch:
    """One Triton kernel launch (under the interpreter), replayed with the same arguments."""

    executor: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    call: Callable[..., Any]

    def replay(self) -> None:
        self.call(self.executor, *self.args, **self.kwargs)


@contextlib.contextmanager
def _record_triton_launches(recorder: _Recorder) -> Iterator[None]:
    """Record Triton interpreter launches as single operations (their inner host copies are not recorded)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        yield
        return
    original = interpreter.GridExecutor.__call__

    def launch(executor: Any, *args: Any, **kwargs: Any) -> Any:
        recorder.paused += 1
        try:
            result = original(executor, *args, **kwargs)
        finally:
            recorder.paused -= 1
        recorder.ops.append(_Launch(executor, args, dict(kwargs), original))
        return result

    interpreter.GridExecutor.__call__ = launch  # type: ignore[method-assign]
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _refuse_host_copies(recorder: _Recorder) -> Iterator[None]:
    """``Tensor.tolist()`` / ``.numpy()`` of a CPU tensor bypass the dispatcher; on a GPU they copy to the host
    and synchronise, so while capturing they are refused like ``.item()`` (except inside a Triton launch)."""
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def refusing(name: str) -> Callable[..., Any]:
        original = originals[name]

        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not recorder.paused:
                raise GraphCaptureError(
                    f"graph capture: Tensor.{name}() reads device values on the host; a device graph cannot contain "
                    "it. Move it out of the captured forward pass or compute it on the device without a host read."
                )
            return original(self, *args, **kwargs)

        return method

    for name in originals:
        setattr(torch.Tensor, name, refusing(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class EmulatedGraphCapture(GraphCapture):
    """Records the aten operations (and interpreted Triton launches) of one forward pass; replays only those.

    Args:
        device: the device the graph runs on (the CPU).
        pool: unused (every recorded tensor stays referenced by the recording, as a graph's pool would).

    Attributes:
        ops: the recorded operations, in order (available after :meth:`capture`).
    """

    def __init__(self, device: torch.device, pool: Any) -> None:
        super().__init__(device, pool)
        self.ops: list[Any] = []
        self.captured = False

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run ``fn`` once while recording; returns its output tensor, which :meth:`replay` refills in place.

        Raises:
            GraphCaptureError: ``fn`` did something a device graph cannot record.
        """
        recorder = _Recorder()
        with _record_triton_launches(recorder), _refuse_host_copies(recorder), recorder:
            output = fn()
        if not isinstance(output, torch.Tensor):
            raise GraphCaptureError(f"graph capture: the captured function returned {type(output).__name__}, "
                                    "not a tensor")
        self.ops = recorder.ops
        self.captured = True
        return output

    def replay(self) -> None:
        """Run the recorded operations again on the current contents of the captured tensors.

        Raises:
            RuntimeError: nothing was captured.
        """
        if not self.captured:
            raise RuntimeError("EmulatedGraphCapture.replay() before capture()")
        for op in self.ops:
            op.replay()
