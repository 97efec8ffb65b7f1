"""torch.compile'd forward pass for every kind of step (the CPU's answer to device graphs).

A decode step with few running requests does little arithmetic per operator, so on a CPU its time goes to
launching several hundred small eager operators (norms, rotary, the cache write, attention, conversions).
``torch.compile`` (TorchInductor) fuses the pointwise and reduction work of the whole forward pass into a few
generated C++ loops and calls the matmul kernels directly, which removes most of that overhead. Large decode
steps gain too: the fused loops make one pass over activations where eager makes one per operator (256
requests, SmolLM2-135M, bfloat16: 518 ms per step eager, 361 ms compiled, attention included;
docs/benchmarks-history.md, "2026-11-30 Zen 4: offline throughput against transformers").

How it runs:

* Decode-only steps (``max_query_len == 1``, up to ``max_num_seqs`` requests) trace attention too, with an
  attention backend that declares ``supports_compile`` (its decode path reads device tensors only, or calls
  a registered custom op), so the whole step is one graph.
* Prefill and mixed steps run the ``mixed`` compilation: every attention layer is one opaque custom op
  (``tokenmill::attention``, see ``tokenmill.layers.attention``) that runs the backend eagerly, and the
  compiler fuses everything between them (norms, rotary, activation, residual adds).
* Kinds, each one compilation with dynamic shapes and no guards: ``one`` (decode of one request), ``many``
  (decode of 2 or more), ``large`` (decode of more than the quantized layers' row limit, only when the model
  has quantized layers: a compilation bakes in the branch its trace took, and the dense matmul is the right
  one for large batches) and ``mixed``. The block table is padded to at least two columns (block 0, masked by
  ``seq_lens``) so that short contexts reuse the decode compilations. A step whose kind is not compiled (yet)
  runs eagerly.
* Each kind is compiled ahead of time (``torch.compile(...).aot_compile``: Dynamo, AOTAutograd and Inductor run
  on a dummy step of the kind's shape, nothing is executed) and saved in the on-disk cache of
  ``tokenmill.worker.compile_cache``; a later start with the same key loads the saved graph (seconds) instead
  of tracing again (minutes). Weights, KV caches and all ``nn.Module`` state are graph inputs with static
  shapes except the KV cache's block count, so a graph fits any checkpoint of the architecture and any KV
  cache size.
* ``compile_mode="blocking"`` (``--compile-mode blocking``; the default of ``LLM`` and the benchmarks):
  every kind is loaded or compiled before the engine takes requests. ``"background"`` (the default of
  ``tokenmill serve``): the engine serves eagerly at once; a thread loads the cached kinds, and the missing
  ones are compiled by a child process (``python -m tokenmill.worker.compile_worker``, at a lower CPU
  priority, its own copy of the model) whose artifacts the thread loads and swaps in one kind at a time
  (``one`` first: single requests gain most). Progress goes to the log.
* ``--enforce-eager`` turns it off, as does ``TOKENMILL_COMPILE=0`` in the environment (the test suite sets
  it so that its many short-lived engines skip compiling) and a platform without ``supports_compile``. If
  compilation fails the engine logs why and that kind stays eager.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.forward_context import set_forward_context
from tokenmill.worker.compile_cache import CompileCache

if TYPE_CHECKING:
    from tokenmill.worker.input_batch import BatchInputs
    from tokenmill.worker.runner_view import ModelRunnerView

logger = logging.getLogger(__name__)

KIND_ORDER = ("one", "many", "mixed", "large")  # compile order: single requests gain most
KIND_LABELS = {"one": "decode of 1 request", "many": "decode of 2+ requests", "mixed": "prefill and mixed steps",
               "large": "decode above the quantized row limit"}
_POLL_S = 0.5
_BACKGROUND_SWITCH_INTERVAL_S = 1e-4  # sys.setswitchinterval while a graph loads beside eager steps
_loads_lock = threading.Lock()
_loads_running = 0
_interval_before = 0.005


def step_kinds(quant_max_rows: int, max_batch_size: int) -> list[str]:
    """The kinds a runner compiles (``large`` only when quantized layers stop below ``max_batch_size``)."""
    return [k for k in KIND_ORDER if k != "large" or 0 < quant_max_rows < max_batch_size]


def quant_row_limit(model: torch.nn.Module) -> int:
    """Rows above which the model's quantized layers use their dense weight (0: no quantized layer)."""
    return max(
        (getattr(m, "quant_max_tokens", 0) for m in model.modules() if getattr(m, "quant", None) is not None),
        default=0,
    )


# Config entries that say where or how a checkpoint was saved, not what the graph computes: a copied or moved
# checkpoint (an HF-layout copy of the same model) loads the same graphs. The engine's dtype is its own fact.
_NOT_ARCHITECTURE = ("_name_or_path", "_commit_hash", "transformers_version", "dtype", "torch_dtype")


def architecture_fact(hf_config: Any) -> str:
    """The model configuration as the compile-cache key sees it: every entry except :data:`_NOT_ARCHITECTURE`,
    as sorted JSON (``repr`` for an object that is not a transformers config)."""
    if not hasattr(hf_config, "to_dict"):
        return repr(hf_config)
    d = {k: v for k, v in hf_config.to_dict().items() if k not in _NOT_ARCHITECTURE}
    return json.dumps(d, sort_keys=True, default=str)


class CompiledRunner:
    """Runs model forward passes through ahead-of-time compiled graphs, one per step kind (module docstring).

    Args:
        model: the loaded model (``forward(input_ids, positions)``).
        max_batch_size: the largest decode step compiled.
        block_size: tokens per KV block.

    Attributes:
        compiled: the kinds ready now, ``kind -> callable(model, input_ids, positions)``; a background loader
            adds to it while the engine runs.
        kinds: every kind this runner will have once compilation is done.
        kind_steps: steps run per compiled kind since it was installed.
    """

    def __init__(self, model: torch.nn.Module, max_batch_size: int, block_size: int) -> None:
        from tokenmill.layers.attention import attention_layers

        self.model = model
        self.attn_layers = attention_layers(model)  # where opaque attention finds its layers
        self.max_batch_size = max_batch_size
        self.block_size = block_size
        self.quant_max_rows = quant_row_limit(model)
        self.kinds = step_kinds(self.quant_max_rows, max_batch_size)
        self.compiled: dict[str, Callable[..., torch.Tensor]] = {}
        self.kind_steps = dict.fromkeys(self.kinds, 0)
        self.background: threading.Thread | None = None
        self.child: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._is_loading = threading.Event()

    @classmethod
    def create_if_enabled(cls, runner: ModelRunnerView) -> CompiledRunner | None:
        """A runner for ``runner``'s model, or ``None`` when compilation is off.

        Off with ``enforce_eager`` or ``TOKENMILL_COMPILE=0``, on platforms without ``supports_compile``, with
        attention backends without ``supports_compile``, and with tensor parallelism (collectives are not
        traced). With ``compile_mode="blocking"`` every kind is ready when this returns (or, if its compilation
        failed, logged and left eager); with ``"background"`` kinds arrive while the engine serves.
        """
        from tokenmill.distributed import get_tp_size
        from tokenmill.platforms import get_current_platform

        config = runner.config
        if config.enforce_eager or os.environ.get("TOKENMILL_COMPILE", "1") == "0":
            return None
        if runner.model is None or get_tp_size() > 1:
            return None
        if not get_current_platform().supports_compile or not getattr(runner.attn_backend, "supports_compile", False):
            return None
        compiled = cls(runner.model, config.scheduler_config.max_num_seqs, runner.block_size)
        cache = compiled.cache_for(runner)
        if getattr(config, "compile_mode", "blocking") == "background":
            compiled.start_background(runner, cache)
        else:
            compiled.prepare_blocking(runner, cache)
        return compiled

    def cache_for(self, runner: ModelRunnerView) -> CompileCache:
        """The on-disk cache whose key fits this model, engine configuration and source code."""
        from tokenmill.plugins import get_plugin_status

        config = runner.config
        hf = config.model_config.hf_config
        layer_classes: set[str] = set()
        method_facts: dict[str, Any] = {}
        for m in self.model.modules():
            layer_classes.add(f"{type(m).__module__}.{type(m).__qualname__}")
            quant = getattr(m, "quant", None)
            if isinstance(quant, torch.nn.Module):
                layer_classes.add(f"{type(quant).__module__}.{type(quant).__qualname__}")
            linear_method = getattr(m, "linear_method", None)  # tokenmill.layers.linear_method
            if linear_method is not None:
                name = f"{type(linear_method).__module__}.{type(linear_method).__qualname__}"
                layer_classes.add(name)
                method_facts.setdefault(name, linear_method.cache_key_facts())
            method_path = getattr(m, "method_path", None)  # FusedMoE's expert method ("module:Class")
            if isinstance(method_path, str):
                layer_classes.add(method_path.replace(":", "."))
        plugins = [s for s in get_plugin_status() if s.loaded]
        facts = {
            "architecture": architecture_fact(hf),
            "model_class": f"{type(self.model).__module__}.{type(self.model).__qualname__}",
            "dtype": config.model_config.dtype,
            "kv_cache_dtype": str(runner.kv_cache_dtype).removeprefix("torch."),
            "quantization": config.model_config.quantization,
            "block_size": self.block_size,
            "quant_max_rows": self.quant_max_rows,
            "platform": config.device_config.platform,
            "attention_backend": f"{runner.attn_backend.__module__}.{runner.attn_backend.__qualname__}",
            # A plugin's custom op (RMSNorm, rotary, MoE, quantized linear) changes the traced graph: every layer
            # class and every loaded plugin go into the key, and their packages' sources into the digest.
            "layer_classes": sorted(layer_classes),
            "linear_method_facts": method_facts,  # e.g. the CPU plugin's row bounds (TOKENMILL_CPU_PREPACK)
            "plugins": sorted(f"{s.distribution}=={s.version}:{s.value}" for s in plugins),
        }
        modules = [type(self.model).__module__, runner.attn_backend.__module__]
        modules += sorted({name.split(".")[0] for name in layer_classes} - {"torch"})  # torch: its version
        modules += [s.value.split(":")[0] for s in plugins]
        return CompileCache(facts, modules)

    # ------------------------------------------------------------------------------------------- stepping

    def can_run(self, batch: BatchInputs) -> bool:
        """Whether ``batch``'s kind is compiled now: any step with tokens, decode steps up to ``max_batch_size``."""
        md = batch.attn_metadata
        if md.max_query_len == 1:
            return 0 < md.num_actual_tokens <= self.max_batch_size and self.kind(md) in self.compiled
        return md.num_actual_tokens > 1 and "mixed" in self.compiled

    def kind(self, md: AttentionMetadata) -> str:
        """The compilation that runs a step with metadata ``md``."""
        if md.max_query_len > 1:
            return "mixed"
        if md.num_actual_tokens == 1:
            return "one"
        return "large" if "large" in self.kinds and md.num_actual_tokens > self.quant_max_rows else "many"

    def run(self, batch: BatchInputs) -> torch.Tensor:
        """The compiled forward pass of ``batch``: ``[T, hidden]``."""
        md = batch.attn_metadata
        kind = self.kind(md)
        if kind != "mixed" and md.block_table.shape[1] < 2:
            md = self._pad_block_table(md)
        self.kind_steps[kind] += 1
        with set_forward_context(md, opaque_attention=kind == "mixed", attn_layers=self.attn_layers):
            return self.compiled[kind](self.model, batch.input_ids, batch.positions)

    def _pad_block_table(self, md: AttentionMetadata) -> AttentionMetadata:
        pad = md.block_table.new_zeros(md.block_table.shape[0], 2 - md.block_table.shape[1])
        return dataclasses.replace(md, block_table=torch.cat((md.block_table, pad), dim=1))

    @contextlib.contextmanager
    def eager_step(self) -> Iterator[None]:
        """Wrap a step that runs eagerly: while the background thread loads a saved graph, it runs on one
        intra-op thread.

        Loading a graph is mostly Python (the first load imports Dynamo and Inductor: about 3.5 s on a Zen 4
        core) and keeps a core busy. An eager step on two intra-op threads then waits at each of its several
        hundred parallel operators for the worker thread that the loader has pushed off its core, and a first
        request is answered only as the loading ends. This and the imports done ahead
        (``tokenmill.engine.core_prestart``) halved a warm start's first answer on Zen 4 (``python
        benchmarks/startup.py``; docs/benchmarks-history.md, "2026-12-02 Zen 4 (46f8ad6)").
        """
        if not self._is_loading.is_set():
            yield
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    @contextlib.contextmanager
    def _loading(self) -> Iterator[None]:
        """Mark a graph load (see :meth:`eager_step`) and let the GIL change hands every 0.1 ms instead of
        Python's 5 ms meanwhile: an eager step releases the GIL in each torch operator and would otherwise wait
        up to 5 ms to get it back from the loader after each. The interval is process-wide: the first of
        overlapping loads (several engines in one process) sets it, the last restores it."""
        global _loads_running, _interval_before
        with _loads_lock:
            if _loads_running == 0:
                _interval_before = sys.getswitchinterval()
                sys.setswitchinterval(min(_interval_before, _BACKGROUND_SWITCH_INTERVAL_S))
            _loads_running += 1
        self._is_loading.set()
        try:
            yield
        finally:
            self._is_loading.clear()
            with _loads_lock:
                _loads_running -= 1
                if _loads_running == 0:
                    sys.setswitchinterval(_interval_before)

    # ------------------------------------------------------------------------------------------- preparing

    def prepare_blocking(self, runner: ModelRunnerView, cache: CompileCache) -> None:
        """Load or compile (and save) every kind now, in this thread."""
        start = time.perf_counter()
        runner.attn_backend.wait_until_ready()
        for kind in self.kinds:
            try:
                if cache.has(kind):
                    self._install(kind, load_kind(cache, kind), cache, "loaded from the compile cache")
                    continue
                kind_start = time.perf_counter()
                logger.info("compiling %s steps (%s) with torch.compile ...", kind, KIND_LABELS[kind])
                fn = compile_kind(self, kind, runner, cache)
                self._install(kind, fn, cache, f"compiled in {time.perf_counter() - kind_start:.1f} s")
            except Exception as exc:  # noqa: BLE001 - any compiler failure leaves the kind eager, never broken
                logger.warning("torch.compile of %s steps failed, they run eagerly (%s: %s)", kind,
                               type(exc).__name__, exc)
        logger.info("compiled forward passes ready in %.1f s: %s (cache %s; --enforce-eager skips this)",
                    time.perf_counter() - start, ", ".join(self.compiled) or "none", cache.directory)

    def start_background(self, runner: ModelRunnerView, cache: CompileCache) -> None:
        """Serve eagerly now; load cached kinds and compile missing ones (child process) in a daemon thread."""
        missing = [k for k in self.kinds if not cache.has(k)]
        if missing:
            logger.info("serving eagerly while %s compile in the background (%s; compiled graphs are cached in %s, "
                        "later starts load them)", ", ".join(missing),
                        "minutes on a small CPU" if len(missing) == len(self.kinds) else "the rest is cached",
                        cache.directory)
        else:
            logger.info("loading compiled forward passes from the compile cache in the background (%s)",
                        cache.directory)
        self.background = threading.Thread(target=self._background, args=(runner, cache, missing),
                                           name="tokenmill-compile", daemon=True)
        self.background.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background work to end; whether it has (``True`` at once in blocking mode)."""
        if self.background is not None:
            self.background.join(timeout)
            return not self.background.is_alive()
        return True

    def shutdown(self) -> None:
        """Stop background compilation (the child process is killed; loaded kinds stay)."""
        self._stop.set()
        self._end_child(grace_s=0.0)

    def _end_child(self, grace_s: float) -> None:
        child = self.child
        if child is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(grace_s)
        if child.poll() is None:
            child.kill()
            with contextlib.suppress(Exception):
                child.wait(5)

    def _background(self, runner: ModelRunnerView, cache: CompileCache, missing: list[str]) -> None:
        start = time.perf_counter()
        try:
            runner.attn_backend.wait_until_ready()
            for kind in self.kinds:
                if kind not in missing and not self._stop.is_set():
                    with self._loading():
                        fn = load_kind(cache, kind)
                    self._install(kind, fn, cache, "loaded from the compile cache")
            if missing and not self._stop.is_set():
                self._compile_in_child(runner, cache, missing)
        except Exception as exc:  # noqa: BLE001 - never take the engine down; the rest stays eager
            logger.warning("background compilation stopped, the remaining step kinds run eagerly (%s: %s)",
                           type(exc).__name__, exc)
        finally:
            self._end_child(grace_s=30.0)  # it exits by itself after its last kind
        if not self._stop.is_set():
            logger.info("background compilation done in %.1f s: compiled %s; eager: %s",
                        time.perf_counter() - start, ", ".join(self.compiled) or "none",
                        ", ".join(k for k in self.kinds if k not in self.compiled) or "none")

    def _compile_in_child(self, runner: ModelRunnerView, cache: CompileCache, missing: list[str]) -> None:
        cache.prepare()
        spec = {"config": runner.config, "kinds": missing, "cache_dir": str(cache.directory),
                "parent_pid": os.getpid()}
        with tempfile.NamedTemporaryFile("wb", suffix=".pkl", prefix="tokenmill-compile-", delete=False) as f:
            pickle.dump(spec, f)
            spec_path = f.name
        env = dict(os.environ, TOKENMILL_COMPILE="0", OMP_NUM_THREADS="1",
                   TOKENMILL_PLATFORM=runner.config.device_config.platform or os.environ.get("TOKENMILL_PLATFORM", ""))
        if not env["TOKENMILL_PLATFORM"]:
            env.pop("TOKENMILL_PLATFORM")
        try:
            self.child = subprocess.Popen([sys.executable, "-m", "tokenmill.worker.compile_worker", spec_path],
                                          env=env, stdin=subprocess.DEVNULL)
            logger.info("compile worker started (pid %d, lower CPU priority)", self.child.pid)
            for kind in missing:
                while not cache.has(kind):
                    if self._stop.wait(_POLL_S):
                        return
                    if self.child.poll() is not None and not cache.has(kind):
                        logger.warning("compile worker exited (code %s) before %s steps were compiled; they run "
                                       "eagerly", self.child.returncode, kind)
                        return
                with self._loading():
                    fn = load_kind(cache, kind)
                self._install(kind, fn, cache, "compiled in the background")
        finally:
            with contextlib.suppress(OSError):
                os.unlink(spec_path)

    def _install(self, kind: str, fn: Callable[..., torch.Tensor], cache: CompileCache, how: str) -> None:
        self.kind_steps[kind] = 0
        self.compiled[kind] = fn
        logger.info("%s steps (%s) now run compiled: %s (%d of %d kinds)", kind, KIND_LABELS[kind], how,
                    len(self.compiled), len(self.kinds))


# ------------------------------------------------------------------------------------------- compiling


def load_kind(cache: CompileCache, kind: str) -> Callable[..., torch.Tensor]:
    """The saved graph of ``kind``, guards off (each graph serves one kind only; the runner chooses it).

    Raises:
        OSError, RuntimeError: the artifact cannot be read or was made by an incompatible torch.
    """
    start = time.perf_counter()
    with open(cache.path(kind), "rb") as f:
        fn = torch.compiler.load_compiled_function(f)
    fn.disable_guard_check()
    logger.debug("loaded %s steps in %.1f s", kind, time.perf_counter() - start)
    return fn


@contextlib.contextmanager
def _aot_settings() -> Iterator[None]:
    """Compiler settings of an ahead-of-time compilation.

    ``specialize_float``: a dynamic float restarts Dynamo's analysis once, which ahead-of-time capture cannot
    do. ``use_duck_shape=False``: sizes that happen to be equal at trace time (3 KV heads, 3 decode rows)
    must not become one symbol.
    """
    import torch.fx.experimental._config as fx_config

    with torch._dynamo.config.patch(enable_aot_compile=True, specialize_float=True), \
            fx_config.patch(use_duck_shape=False):
        yield


def kv_block_dim(model_runner: ModelRunnerView) -> int:
    """Which dimension of the backend's KV cache layout counts blocks."""
    one = model_runner.attn_backend.get_kv_cache_shape(1, model_runner.block_size, 1, 8)
    two = model_runner.attn_backend.get_kv_cache_shape(2, model_runner.block_size, 1, 8)
    return next(i for i, (a, b) in enumerate(zip(one, two)) if a != b)


def compile_kind(
    runner: CompiledRunner, kind: str, model_runner: ModelRunnerView, cache: CompileCache | None
) -> Callable[..., torch.Tensor]:
    """Compile ``kind`` ahead of time for ``runner``'s model (nothing runs) and save it in ``cache``.

    Every parameter, buffer and KV cache dimension is static except the KV caches' block count.

    Returns:
        ``callable(model, input_ids, positions) -> [T, hidden]``.
    """
    model = runner.model
    device = model_runner.device
    for t in list(model.parameters()) + list(model.buffers()):
        torch._dynamo.mark_static(t)
    blocks = kv_block_dim(model_runner)
    for kv in model_runner.kv_caches:
        for i in range(kv.dim()):
            if i == blocks:
                torch._dynamo.mark_dynamic(kv, i)
            else:
                torch._dynamo.mark_static(kv, i)
    # Distinct sizes per trace; "large" and "mixed" trace above the quantized row limit (dense matmuls).
    above = max(runner.quant_max_rows, 3) + 5
    size = {"one": 1, "many": 3, "large": above, "mixed": above}[kind]
    batch = _dummy_batch(kind, size, device, runner.block_size)
    fn = torch.compile(
        type(model).forward,
        dynamic=True,
        fullgraph=True,
        options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe, "size_asserts": False},
    )
    with torch.inference_mode(), _aot_settings(), set_forward_context(
            batch.attn_metadata, opaque_attention=kind == "mixed", attn_layers=runner.attn_layers):
        compiled = fn.aot_compile(((model, batch.input_ids, batch.positions), {}))
    if cache is not None:
        cache.prepare()
        compiled.save_compiled_function(str(cache.path(kind)))
    compiled.disable_guard_check()
    return compiled


def _dummy_batch(kind: str, size: int, device: torch.device, block_size: int) -> BatchInputs:
    """Decode of ``size`` requests, or (``mixed``) one fresh prefill of ``size`` tokens, on block 0 (traced,
    never run)."""
    from tokenmill.worker.input_batch import BatchInputs

    ids = torch.zeros(size, dtype=torch.int64, device=device)
    if kind == "mixed":
        num_reqs, seq_lens, qsl = 1, [size], [0, size]
    else:
        num_reqs, seq_lens, qsl = size, [1] * size, list(range(size + 1))
    md = AttentionMetadata(
        num_actual_tokens=size,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.zeros(num_reqs, size + 2, dtype=torch.int32, device=device),
        slot_mapping=torch.zeros(size, dtype=torch.int64, device=device),
        max_query_len=size if kind == "mixed" else 1,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )
    torch._dynamo.mark_dynamic(md.block_table, 1)
    if size > 1:
        torch._dynamo.mark_dynamic(ids, 0)
    logits_indices = torch.tensor([size - 1] if kind == "mixed" else list(range(size)), device=device)
    return BatchInputs(ids, ids.clone(), md, logits_indices, [True] * num_reqs)
