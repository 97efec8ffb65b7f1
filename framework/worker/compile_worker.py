"""The background compile worker: ``python -m tokenmill.worker.compile_worker SPEC.pkl``.

Started by :class:`tokenmill.worker.compiled_runner.CompiledRunner` in ``compile_mode="background"``. It loads
its own copy of the model with a small KV cache (the block count is a dynamic dimension of the graphs), compiles
each step kind named in the spec ahead of time and saves it in the compile cache, where the engine's loader
thread picks it up. It runs at a lower CPU priority than the engine (``nice`` 10) with one thread, and exits
when its parent does.

The spec is a pickle of ``{"config": EngineConfig, "kinds": [...], "cache_dir": str, "parent_pid": int}``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import signal
import sys
import threading
import time

logger = logging.getLogger("tokenmill.compile_worker")

COMPILE_NUM_BLOCKS = 16  # KV blocks of the worker's own cache: only shapes matter, nothing runs


def _die_with_parent(parent_pid: int) -> None:
    with contextlib.suppress(Exception):  # Linux: the kernel sends SIGTERM when the parent dies
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [compile worker] %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    with open(argv[0], "rb") as f:
        spec = pickle.load(f)
    _die_with_parent(spec["parent_pid"])
    with contextlib.suppress(OSError):
        os.nice(10)
    os.environ["TOKENMILL_COMPILE"] = "0"  # this process's own engine pieces never compile by themselves

    import torch

    torch.set_num_threads(1)
    from tokenmill.platforms import get_current_platform
    from tokenmill.plugins import load_general_plugins, resolve_qualname

    # Plugins load here as in every tokenmill process: their custom ops and backends are what gets compiled.
    load_general_plugins("compile_worker")
    from tokenmill.worker.compile_cache import CompileCache
    from tokenmill.worker.compiled_runner import KIND_LABELS, CompiledRunner, compile_kind

    config = spec["config"]
    start = time.perf_counter()
    worker = resolve_qualname(get_current_platform().worker_cls)(config, local_rank=0, rank=0)
    worker.init_device()
    worker.model_runner.process_weights = False  # the traced graphs call the linear method; nothing is prepacked
    worker.load_model()
    worker.initialize_cache(COMPILE_NUM_BLOCKS)
    model_runner = worker.model_runner
    model_runner.attn_backend.wait_until_ready()
    runner = CompiledRunner(model_runner.model, config.scheduler_config.max_num_seqs, model_runner.block_size)
    cache = CompileCache.at(spec["cache_dir"])
    logger.info("model loaded in %.1f s; compiling %s", time.perf_counter() - start, ", ".join(spec["kinds"]))
    for i, kind in enumerate(spec["kinds"], 1):
        kind_start = time.perf_counter()
        logger.info("compiling %s steps (%s), %d of %d ...", kind, KIND_LABELS[kind], i, len(spec["kinds"]))
        try:
            compile_kind(runner, kind, model_runner, cache)
        except Exception:  # noqa: BLE001 - report and go on with the next kind
            logger.exception("compiling %s steps failed; they stay eager", kind)
            continue
        logger.info("compiled %s steps in %.1f s", kind, time.perf_counter() - kind_start)
    logger.info("done in %.1f s", time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
