"""Shared pieces of the ``tokenmill bench`` commands: machine description, random prompts, statistics, JSON.

Nothing here imports torch or the engine at module import time, so ``tokenmill --help`` stays fast.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tokenmill.metrics.stats import peak_rss_bytes  # noqa: F401 - the benchmarks import it from here

AddArgs = Callable[[argparse.ArgumentParser], None]


# ------------------------------------------------------------------------------------------------ machine


def _cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo`` on Linux, ``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_bytes() -> int | None:
    """Physical memory of the machine, in bytes (``None`` when unknown)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask), falling back to ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_steal_seconds() -> float | None:
    """CPU time the hypervisor has given this VM's CPUs to others since boot (``steal`` in /proc/stat, all CPUs
    summed), in seconds; ``None`` where /proc/stat is absent. Its growth over a timed run marks a run slowed by
    a neighbour on a shared machine."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


_ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2")


def cpu_isa() -> dict[str, Any]:
    """The CPU's instruction-set level and the vector flags that matter for the kernels.

    ``level`` is ``AVX512`` (with its extensions in brackets), ``AVX2`` (AVX2 + FMA), ``SSE4.2``/``x86-64``,
    or the machine name elsewhere; ``torch_cpu_capability`` is what torch dispatches to (lowered by
    ``ATEN_CPU_CAPABILITY``, which is how an AVX2 run is made on an AVX-512 machine).
    """
    import torch

    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    if "avx512f" in flags:
        extras = [name for flag, name in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16"), ("amx_tile", "AMX"))
                  if flag in flags]
        level = "AVX512" + (f" ({', '.join(extras)})" if extras else "")
    elif {"avx2", "fma"} <= flags:
        level = "AVX2" + (" (AVX-VNNI)" if "avx_vnni" in flags else "")
    elif "sse4_2" in flags:
        level = "SSE4.2"
    else:
        level = platform.machine()
    return {"level": level, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "flags": [f for f in _ISA_FLAGS if f in flags]}


def engine_kernel_info(engine: Any) -> dict[str, str]:
    """The engine core's answer to :meth:`~tokenmill.engine.core.EngineCore.kernel_info` (the first one's, with
    data parallelism: they run in their own processes); empty when it cannot answer."""
    try:
        return dict(engine.engine_core.call_utility_all("kernel_info")[0])
    except Exception:  # noqa: BLE001 - a benchmark never fails over a description
        return {}


def refuse_data_parallel(args: argparse.Namespace, command: str) -> None:
    """Exit with a message when ``--data-parallel-size`` > 1 was given to a benchmark that times one engine core.

    Raises:
        SystemExit: it was.
    """
    if getattr(args, "data_parallel_size", 1) > 1:
        raise SystemExit(f"tokenmill bench {command}: error: --data-parallel-size must be 1 (it times one engine core "
                         "in this process; bench throughput takes data-parallel engine cores)")


def kernel_info() -> dict[str, str]:
    """The current platform's :meth:`~tokenmill.platforms.Platform.kernel_info` (the engine ran in this
    process); empty when no platform can be resolved."""
    try:
        from tokenmill.platforms import get_current_platform

        return dict(get_current_platform().kernel_info())
    except Exception:  # noqa: BLE001 - a benchmark never fails over a description
        return {}


def isa_rows(record: dict[str, Any], kernels: dict[str, str] | None) -> list[tuple[str, Any]]:
    """Table rows for the instruction set (and ``kernels``), which are also stored in ``record``."""
    isa = record["machine"]["isa"]
    rows: list[tuple[str, Any]] = [("CPU instruction set", isa["level"]),
                                   ("torch CPU capability", isa["torch_cpu_capability"])]
    if kernels is not None:
        record["kernels"] = kernels
        rows += [(f"Kernel: {name}", value) for name, value in kernels.items() if name != "torch_cpu_capability"]
    return rows


def machine_info() -> dict[str, Any]:
    """What the figures were measured on: cores, CPU model, RAM (bytes), torch version and threads, ..."""
    import torch

    from tokenmill import __version__

    accelerator = None
    if torch.cuda.is_available():
        accelerator = torch.cuda.get_device_name(0)
    return {
        "hostname": platform.node(),
        "os": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores(),
        "ram_bytes": _ram_bytes(),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "accelerator": accelerator,
        "tokenmill_version": __version__,
        "isa": cpu_isa(),
    }


# ------------------------------------------------------------------------------------------------ prompts


def allowed_token_ids(tokenizer: Any, vocab_size: int | None = None) -> list[int]:
    """Token ids a random prompt may use: inside both the model's and the tokenizer's vocabulary, and not
    special (BOS, EOS, PAD, UNK, added control tokens)."""
    size = len(tokenizer)
    if vocab_size is not None:
        size = min(size, int(vocab_size))
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            special.add(int(token_id))
    ids = [i for i in range(size) if i not in special]
    if not ids:
        raise ValueError("random prompts: the vocabulary has no non-special token")
    return ids


def random_prompts(
    tokenizer: Any, num_prompts: int, input_len: int, *, seed: int, vocab_size: int | None = None
) -> list[list[int]]:
    """``num_prompts`` prompts of exactly ``input_len`` token ids, drawn uniformly (seeded) from
    :func:`allowed_token_ids`. The same seed gives the same prompts."""
    import numpy as np

    if num_prompts < 1 or input_len < 1:
        raise ValueError(f"random prompts: need at least one prompt of at least one token, "
                         f"got {num_prompts} x {input_len}")
    pool = np.asarray(allowed_token_ids(tokenizer, vocab_size), dtype=np.int64)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(pool), size=(num_prompts, input_len))
    return [[int(t) for t in row] for row in pool[picks]]


def load_tokenizer_for(path: str | None) -> Any:
    """The tokenizer of a model directory, a ``.gguf`` file, a hub id, or (``None``) the embedded default."""
    from tokenmill.model_loader.hf_config import resolve_model_location
    from tokenmill.tokenizer import load_tokenizer

    if path is not None:
        expanded = os.path.abspath(os.path.expanduser(path))
        if os.path.isfile(expanded):
            return load_tokenizer(os.path.dirname(expanded), os.path.basename(expanded))
        if os.path.isdir(expanded):
            return load_tokenizer(expanded)
    loc = resolve_model_location(path)
    return load_tokenizer(loc.directory, loc.gguf_file)


# ------------------------------------------------------------------------------------------------ figures


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, median (p50), p99, min and max of ``values`` (all ``None`` when empty); same unit as input."""
    if not values:
        return {"mean": None, "p50": None, "p99": None, "min": None, "max": None}
    ordered = sorted(values)
    return {
        "mean": statistics.fmean(ordered),
        "p50": statistics.median(ordered),
        "p99": percentile(ordered, 99.0),
        "min": ordered[0],
        "max": ordered[-1],
    }


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of sorted ``ordered``, linear interpolation between ranks."""
    if not ordered:
        raise ValueError("percentile of no values")
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def print_table(title: str, rows: Sequence[tuple[str, Any]]) -> None:
    """Print ``(label, value)`` rows under a title, values right-aligned (floats with 2 decimals)."""
    width = max([len(label) for label, _ in rows] + [len(title)])
    print(f"{'=' * 10} {title} {'=' * 10}")
    for label, value in rows:
        if isinstance(value, float):
            text = f"{value:,.2f}"
        elif value is None:
            text = "n/a"
        else:
            text = str(value)
        print(f"{label:<{width}}  {text:>14}")


# ------------------------------------------------------------------------------------------------ JSON


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def command_line(args: argparse.Namespace | None = None) -> str:
    """The benchmark's command line, shell-quoted: ``tokenmill <argv>`` when the CLI recorded the argv it
    parsed (``args.command_argv``), else this process's ``sys.argv``."""
    recorded = getattr(args, "command_argv", None)
    if recorded is not None:
        return shlex.join(["tokenmill", *recorded])
    argv = list(sys.argv)
    if argv:
        argv[0] = os.path.basename(argv[0])
    return shlex.join(argv)


def base_record(benchmark: str, args: argparse.Namespace) -> dict[str, Any]:
    """The fields every JSON result starts with: benchmark name, date (UTC, ISO 8601), command line, the
    parsed arguments (they alone define the run) and the machine."""
    arguments = {k: v for k, v in vars(args).items() if not callable(v)}
    return {
        "benchmark": benchmark,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(args),
        "args": _jsonable(arguments),
        "machine": machine_info(),
    }


def write_json(path: str, record: dict[str, Any]) -> None:
    """Write ``record`` as indented JSON to ``path`` (parent folders created)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_jsonable(record), f, indent=2)
        f.write("\n")
    print(f"results written to {path}")


# ------------------------------------------------------------------------------------------------ flags


def add_shared_args(parser: argparse.ArgumentParser, *, output_len: int | None = 128, num_prompts: int | None = None,
                    num_prompts_help: str = "Number of prompts N", detokenize: bool = False,
                    hf_dtypes: bool = False, tqdm: bool = False, input_lens: str | None = None) -> None:
    """The flags the benchmarks share, in two groups: the workload (``--num-prompts`` when ``num_prompts`` is
    given, ``--input-len`` (one length, or with ``input_lens`` a comma-separated list defaulting to it, parsed
    by :func:`parse_lengths`), ``--output-len`` unless ``output_len`` is ``None``, ``--disable-detokenize``
    with ``detokenize``, ``--hf-dtypes`` with ``hf_dtypes``) and the report (``--json``, ``--disable-tqdm``
    with ``tqdm``)."""
    workload = parser.add_argument_group("workload")
    if num_prompts is not None:
        workload.add_argument("--num-prompts", type=int, default=num_prompts,
                              help=f"{num_prompts_help} (default {num_prompts}).")
    if input_lens is None:
        workload.add_argument("--input-len", type=int, default=128, help="Prompt tokens I (default 128).")
    else:
        workload.add_argument("--input-len", default=input_lens,
                              help=f"Prompt tokens, one length or several separated by commas (default {input_lens}).")
    if output_len is not None:
        workload.add_argument("--output-len", type=int, default=output_len,
                              help=f"New tokens O per request (default {output_len}).")
    if detokenize:
        workload.add_argument("--disable-detokenize", action="store_true",
                              help="Skip detokenization (token ids only), to time the engine alone.")
    if hf_dtypes:
        workload.add_argument("--hf-dtypes", default="float32,bfloat16",
                              help="dtypes for --baseline hf; the fastest counts (default float32,bfloat16).")
    report = parser.add_argument_group("report")
    report.add_argument("--json", default=None, metavar="FILE", help="Write every figure to this JSON file.")
    if tqdm:
        report.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


def parse_lengths(text: str) -> list[int]:
    """``"128,512"`` -> ``[128, 512]``.

    Raises:
        ValueError: an entry is not a positive integer, or there is none.
    """
    try:
        lengths = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--input-len: expected positive integers separated by commas, got {text!r}")
    return lengths


# ------------------------------------------------------------------------------------------------ engine


def add_engine_cli_args(parser: argparse.ArgumentParser, add_extra_args: AddArgs | None) -> None:
    """``--model`` plus every engine flag (:meth:`tokenmill.engine_args.EngineArgs.add_cli_args`) and any
    plugin flags, exactly as ``tokenmill serve`` has them."""
    from tokenmill.engine_args import EngineArgs

    parser.add_argument("--model", default=None,
                        help="Model directory (Hugging Face layout), .gguf file or hub id "
                             "(default: the embedded SmolLM2-135M-Instruct GGUF).")
    EngineArgs.add_cli_args(parser)
    if add_extra_args is not None:
        add_extra_args(parser)


def engine_args_from(args: argparse.Namespace) -> Any:
    """The :class:`~tokenmill.engine_args.EngineArgs` of the parsed flags."""
    from tokenmill.engine_args import EngineArgs

    return EngineArgs.from_cli_args(args)


def engine_prompts(engine: Any, args: argparse.Namespace) -> list[list[int]]:
    """``--num-prompts`` random prompts of ``--input-len`` tokens (seed ``--seed``) for an ``LLMEngine``, once
    ``--input-len`` plus ``--output-len`` are known to fit its context.

    Raises:
        ValueError: the lengths do not fit (see :func:`check_lengths`).
    """
    model_config = engine.model_config
    check_lengths(args.input_len, args.output_len, model_config.max_model_len)
    return random_prompts(engine.get_tokenizer(), args.num_prompts, args.input_len, seed=args.seed,
                          vocab_size=model_config.vocab_size)


def check_lengths(input_len: int, output_len: int, max_model_len: int) -> None:
    """Raise ``ValueError`` unless a prompt of ``input_len`` plus ``output_len`` new tokens fits the context."""
    if input_len < 1 or output_len < 1:
        raise ValueError(f"--input-len and --output-len must be at least 1, got {input_len} and {output_len}")
    if input_len + output_len > max_model_len:
        raise ValueError(f"--input-len {input_len} + --output-len {output_len} exceeds the context length "
                         f"{max_model_len} (raise --max-model-len if the model allows)")
