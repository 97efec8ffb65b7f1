"""Contract items about the platform itself: detection, the class, dtypes, memory and KV sizing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

from tokenmill.conformance.target import ConformanceTarget, ContractFailure, ItemSkipped
from tokenmill.dtypes import TORCH_DTYPES

DIST_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl", "hccl", "cncl", "mccl")
FIRST_DETECT_LIMIT_S = 20.0  # includes importing torch in a fresh process
REPEAT_DETECT_LIMIT_S = 0.5

_DETECT_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from tokenmill.plugins.manager import get_platform_specs
    spec = [s for s in get_platform_specs() if s.entry_point == sys.argv[1]][0].spec
    module = spec.platform_cls.partition(":")[0]
    before = module in sys.modules
    t0 = time.perf_counter()
    first = spec.detect()
    t1 = time.perf_counter()
    second = spec.detect()
    t2 = time.perf_counter()
    initialised = []
    if "torch" in sys.modules:
        import torch
        for name in ("cuda", "xpu", "mps", "npu", "mlu"):
            mod = getattr(torch, name, None)
            check = getattr(mod, "is_initialized", None)
            if check is not None and check():
                initialised.append(name)
    print(json.dumps({"first": repr(first), "first_type": type(first).__name__,
                      "ok_type": isinstance(first, bool) or (isinstance(first, tuple) and len(first) == 2
                                 and isinstance(first[0], bool) and isinstance(first[1], str)),
                      "t_first": t1 - t0, "t_second": t2 - t1, "initialised": initialised,
                      "imported_platform_module": (not before) and module in sys.modules, "module": module}))
    """
)


def check_detect(t: ConformanceTarget) -> None:
    """In a fresh process: ``detect()`` returns a bool or ``(bool, str)``, creates no device context, does not
    import the Platform class's module, and is cheap (a repeated call under 0.5 s)."""
    if t.plugin is None:
        raise ItemSkipped("a Platform class was given, not an installed plugin: no detector to check")
    env = dict(os.environ)  # the child sees the plugins installed where this process sees them
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    proc = subprocess.run([sys.executable, "-c", _DETECT_SCRIPT, t.plugin.entry_point], capture_output=True,
                          text=True, timeout=120, env=env)
    if proc.returncode != 0:
        raise ContractFailure(f"detect() failed in a fresh process (exit {proc.returncode}):\n"
                              + "\n".join(proc.stderr.strip().splitlines()[-4:]))
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    t.note(f"detect() returned {r['first']} in {r['t_first']:.2f} s (again in {r['t_second'] * 1000:.1f} ms)")
    problems = []
    if not r["ok_type"]:
        problems.append(f"detect() returned {r['first']} ({r['first_type']}); it must return a bool or a "
                        "(bool, reason) tuple")
    if r["initialised"]:
        problems.append(f"detect() initialised the {', '.join(r['initialised'])} device runtime; detection must "
                        "not create a device context (workers fork later): count devices through NVML-style "
                        "queries instead")
    if r["imported_platform_module"]:
        problems.append(f"detect() imported the Platform class's module {r['module']!r}; keep detection light "
                        "(the class is imported only when the platform is chosen)")
    if r["t_first"] > FIRST_DETECT_LIMIT_S or r["t_second"] > REPEAT_DETECT_LIMIT_S:
        problems.append(f"detect() is not cheap: {r['t_first']:.2f} s, then {r['t_second']:.2f} s when repeated "
                        f"(limits {FIRST_DETECT_LIMIT_S:.0f} s with imports, {REPEAT_DETECT_LIMIT_S} s repeated)")
    if problems:
        raise ContractFailure("; ".join(problems))


def check_platform_class(t: ConformanceTarget) -> None:
    """The class the spec names is a Platform with consistent attributes."""
    from tokenmill.platforms.interface import Platform
    from tokenmill.plugins.qualname import resolve_qualname

    cls = t.platform_cls
    problems = []
    if not issubclass(cls, Platform):
        raise ContractFailure(f"{cls!r} is not a tokenmill.plugin_api.Platform subclass")
    if t.plugin is not None and cls.name != t.plugin.name:
        problems.append(f"Platform.name is {cls.name!r} but the PlatformSpec says {t.plugin.name!r}")
    try:
        torch.device(cls.device_type)
    except (RuntimeError, TypeError) as exc:
        problems.append(f"device_type {cls.device_type!r} is not a torch device type ({exc})")
    if cls.dist_backend not in DIST_BACKENDS:
        problems.append(f"dist_backend {cls.dist_backend!r} is not a torch.distributed backend ({', '.join(DIST_BACKENDS)})")
    bad = [d for d in cls.supported_dtypes if d not in TORCH_DTYPES]
    if not cls.supported_dtypes or bad:
        problems.append(f"supported_dtypes {cls.supported_dtypes!r} must be a non-empty subset of "
                        f"{tuple(TORCH_DTYPES)}")
    if cls.default_dtype not in cls.supported_dtypes:
        problems.append(f"default_dtype {cls.default_dtype!r} is not in supported_dtypes")
    if cls.memory_accounting not in ("total", "available"):
        problems.append(f"memory_accounting {cls.memory_accounting!r} must be 'total' or 'available'")
    try:
        worker = resolve_qualname(cls.worker_cls)
        t.note(f"worker_cls {cls.worker_cls} resolves to {worker.__qualname__}")
    except (ImportError, ValueError) as exc:
        problems.append(f"worker_cls {cls.worker_cls!r} cannot be imported: {exc}")
    if cls.supports_graph_capture and cls.graph_capture_cls() is None:
        t.note("supports_graph_capture is set but graph_capture_cls() is None: graphs stay off")
    t.note(f"{cls.__module__}.{cls.__qualname__}: device {cls.device_type}, {cls.dist_backend}, "
           f"dtypes {', '.join(cls.supported_dtypes)} (default {cls.default_dtype})")
    if problems:
        raise ContractFailure("; ".join(problems))


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]


def check_dtypes(t: ConformanceTarget) -> None:
    """``check_and_update_config`` resolves ``auto``, accepts every supported dtype and refuses others with an
    error naming the dtype; a matmul in each supported dtype on the device matches float64."""
    cls = t.run_cls
    config = t.engine_config("auto")
    cls.check_and_update_config(config)
    if config.model_config.dtype != cls.default_dtype:
        raise ContractFailure(f"dtype 'auto' resolved to {config.model_config.dtype!r}, not default_dtype "
                              f"{cls.default_dtype!r}")
    if config.device_config.platform != cls.name:
        raise ContractFailure(f"check_and_update_config set device_config.platform to "
                              f"{config.device_config.platform!r}, not {cls.name!r}")
    for name in cls.supported_dtypes:
        cls.check_and_update_config(t.engine_config(name))
    unsupported = next((d for d in TORCH_DTYPES if d not in cls.supported_dtypes), "float64")
    try:
        cls.check_and_update_config(t.engine_config(unsupported))
    except ValueError as exc:
        if "dtype" not in str(exc):
            raise ContractFailure(f"refusing dtype {unsupported!r} raised {exc!r}, which does not name the dtype")
    else:
        raise ContractFailure(f"check_and_update_config accepted dtype {unsupported!r}, which supported_dtypes "
                              "does not list")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 96, generator=g), torch.randn(96, 48, generator=g)
    for name in cls.supported_dtypes:
        dtype = TORCH_DTYPES[name]
        ad, bd = a.to(dtype), b.to(dtype)
        got = (ad.to(t.device) @ bd.to(t.device)).cpu().double()
        ref = ad.double() @ bd.double()
        err = float((got - ref).abs().max() / ref.abs().max())
        t.note(f"{name}: matmul on {t.device} within {err:.1e} of float64")
        if err > _tolerance(dtype):
            raise ContractFailure(f"a {name} matmul on {t.device} is {err:.2e} off float64 (relative), more than "
                                  f"{_tolerance(dtype):.0e}")


def check_memory(t: ConformanceTarget) -> None:
    """Device facts are sane, and ``determine_kv_cache_bytes`` honours ``--kv-cache-memory``, refuses a
    non-positive one, gives a positive size within the device's memory, never gives more when the weights or
    activations take more, and raises ``ValueError`` when activations leave nothing."""
    cls = t.run_cls
    if not t.emulated and cls.device_type != "cpu":
        cls.set_device(t.device)
    name = cls.get_device_name(0)
    total = cls.get_device_total_memory(0)
    if not isinstance(name, str) or not name:
        raise ContractFailure(f"get_device_name() returned {name!r}, not a non-empty string")
    if not isinstance(total, int) or total <= 0:
        raise ContractFailure(f"get_device_total_memory() returned {total!r}, not a positive number of bytes")
    count = cls.device_count()
    if count < 1:
        raise ContractFailure(f"device_count() is {count} on a machine where the platform runs")
    t.note(f"{name}: {total / 2**30:.1f} GiB, {count} device(s)" + (" (emulated facts)" if t.emulated else ""))

    def kv(**kwargs: object) -> int:
        config = t.engine_config()
        cache_memory = kwargs.pop("kv_cache_memory", None)
        config.cache_config.kv_cache_memory = cache_memory  # type: ignore[assignment]
        config.cache_config.gpu_memory_utilization = float(kwargs.pop("util", 0.9))  # type: ignore[arg-type]
        return cls.determine_kv_cache_bytes(config, **kwargs)  # type: ignore[arg-type]

    explicit = 123 * 4096
    if kv(kv_cache_memory=explicit) != explicit:
        raise ContractFailure("determine_kv_cache_bytes ignores --kv-cache-memory (the explicit size must be "
                              "returned as is)")
    try:
        kv(kv_cache_memory=0)
    except ValueError:
        pass
    else:
        raise ContractFailure("determine_kv_cache_bytes accepted --kv-cache-memory 0 (it must raise ValueError)")
    mib = 1 << 20
    base = kv(model_memory_bytes=64 * mib, peak_activation_bytes=16 * mib)
    if not isinstance(base, int) or base <= 0 or base > total:
        raise ContractFailure(f"the default KV cache size is {base!r} bytes; it must be a positive int no larger "
                              f"than the device's {total} bytes")
    # More weights / activations by a quarter of that size: never a bigger cache, and still room for one (a
    # fixed increment would fail a platform whose budget is legitimately small).
    step = max(base // 4, 1)
    heavier = kv(model_memory_bytes=64 * mib + step, peak_activation_bytes=16 * mib)
    hotter = kv(model_memory_bytes=64 * mib, peak_activation_bytes=16 * mib + step)
    if heavier > base or hotter > base:
        raise ContractFailure(f"the KV cache grows when the weights or activations take more memory ({base} -> "
                              f"{heavier} / {hotter} bytes)")
    try:
        kv(model_memory_bytes=64 * mib, peak_activation_bytes=10 * total)
    except ValueError:
        pass
    else:
        raise ContractFailure("determine_kv_cache_bytes did not raise ValueError when activations alone exceed "
                              "the device's memory")
    t.note(f"default KV cache {base / 2**30:.2f} GiB ({cls.memory_accounting} accounting"
           + (f", cap {cls.kv_cache_cap_bytes / 2**30:.1f} GiB" if cls.kv_cache_cap_bytes else "") + ")")
    shape = (2, 8, 16, 2, 64)  # the CPU/torch paged layout of 8 blocks; any backend's shape is just a shape here
    for dtype_name in cls.supported_dtypes:
        cache = cls.allocate_kv_cache(shape, TORCH_DTYPES[dtype_name], t.device)
        if tuple(cache.shape) != shape or cache.dtype != TORCH_DTYPES[dtype_name] or not cache.is_contiguous():
            raise ContractFailure(f"allocate_kv_cache({shape}, {dtype_name}) gave a {cache.dtype} tensor of shape "
                                  f"{tuple(cache.shape)} (contiguous: {cache.is_contiguous()})")
        if cache.device.type != t.device.type:
            raise ContractFailure(f"allocate_kv_cache put the cache on {cache.device}, not {t.device}")
        if bool(cache.ne(0).any()):
            raise ContractFailure(f"allocate_kv_cache({dtype_name}) is not all zeros (unwritten slots are read "
                                  "masked; NaN or garbage there poisons attention)")
        cache.view(-1)[0] = 1
        cls.finish_kv_cache_allocation()
        if float(cache.view(-1)[0]) != 1 or bool(cache.view(-1)[1:].ne(0).any()):
            raise ContractFailure(f"finish_kv_cache_allocation changed a {dtype_name} KV cache's contents (it may "
                                  "only wait for the platform's own background work on it)")
