"""What ``tokenmill plugins`` reports: every plugin found, what it implements, what was tried and chosen, and why.

:func:`collect_diagnosis` never raises for a broken plugin: plugins load leniently here
(:func:`tokenmill.plugins.manager.lenient_loading`), so one that fails to import shows up with the end of its
traceback while the others are still listed. The result is a plain ``dict`` (``tokenmill plugins --json``
prints it); :func:`format_diagnosis` renders it for people.
"""

from __future__ import annotations

import traceback
from typing import Any

from tokenmill.plugins import manager
from tokenmill.plugins.api_version import PLUGIN_API_VERSION


def _error(exc: BaseException) -> dict[str, str]:
    tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip().splitlines()[-3:]
    return {"type": type(exc).__name__, "message": str(exc), "traceback_tail": "\n".join(tail)}


def _hooks_of(pm: Any, plugin_name: str) -> list[str]:
    plugin = pm.get_plugin(plugin_name) if plugin_name else None
    if plugin is None:
        return []
    return sorted(h.name for h in (pm.get_hookcallers(plugin) or []))


def _path(target: Any) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def _registry(cls: Any, names: list[str]) -> dict[str, dict[str, str]]:
    return {n: {"target": _path(cls._lookup(n)), "source": cls.source_of(n)} for n in names}


def collect_diagnosis(model: str | None = None) -> dict[str, Any]:
    """Everything ``tokenmill plugins`` shows, as JSON-ready data.

    Args:
        model: a model directory or GGUF file whose architecture to resolve to its class (optional).
    """
    import tokenmill

    out: dict[str, Any] = {"tokenmill_version": tokenmill.__version__, "plugin_api_version": PLUGIN_API_VERSION}
    warnings: list[str] = []
    with manager.lenient_loading():
        pm = manager.get_plugin_manager()
        distributions: dict[str, dict[str, Any]] = {}
        for s in manager.get_plugin_status():
            dist = distributions.setdefault(s.distribution, {"version": s.version, "entry_points": []})
            dist["entry_points"].append({
                "group": s.group, "name": s.entry_point, "value": s.value, "loaded": s.loaded,
                "excluded_by_TOKENMILL_PLUGINS": s.excluded, "requires_plugin_api": s.requires_api,
                "hooks": _hooks_of(pm, s.plugin_name) if s.loaded else [], "error": s.error,
                "traceback_tail": s.traceback_tail or None,
            })
            if s.error:
                warnings.append(f"plugin {s.entry_point!r} ({s.distribution}) failed to load: {s.error}")
        out["distributions"] = distributions
        warnings.extend(manager.get_plugin_warnings())
        for exc in manager.get_plugin_errors():
            if not any(str(exc) in w for w in warnings):
                warnings.append(str(exc))
        out["platforms"], out["selection"] = _platforms(warnings)
        platform_cls = out["selection"].pop("_cls", None)
        out["attention_backends"], out["attention_backend"] = _attention(platform_cls)
        out["architectures"] = _architectures(model, out)
        out["custom_ops"] = _guarded(_custom_ops, platform_cls)
        out["quantization_methods"] = _guarded(_quant_methods, platform_cls)
        out["tool_parsers"] = _tool_parsers()
        out["logits_processors"] = _logits_processors()
        warnings.extend(_registry_warnings(out))
        if platform_cls is not None:
            try:
                out["kernel_info"] = dict(platform_cls.kernel_info())
            except Exception as exc:  # noqa: BLE001 - shown, not fatal
                out["kernel_info"] = {"error": f"{type(exc).__name__}: {exc}"}
    out["warnings"] = warnings
    return out


def _guarded(fn: Any, *args: Any) -> dict[str, Any]:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a plugin's hook raised: shown, not fatal
        return {"error": _error(exc)}


def _registry_warnings(out: dict[str, Any]) -> list[str]:
    """A registration hook that raised (start-up stops on it) and names two plugins registered."""
    from tokenmill.attention.registry import AttentionBackendRegistry
    from tokenmill.layers.custom_op import CustomOpRegistry
    from tokenmill.model_loader.registry import ModelRegistry
    from tokenmill.worker.logits_processor import LogitsProcessorRegistry

    found: list[str] = []
    seen: set[str] = set()
    for key in ("architectures", "attention_backends", "custom_ops", "quantization_methods", "tool_parsers",
                "logits_processors"):
        error = out.get(key, {}).get("error") if isinstance(out.get(key), dict) else None
        if isinstance(error, dict) and error["message"] not in seen:
            seen.add(error["message"])
            found.append(f"{error['message']} (start-up stops on it)")
    registries: list[Any] = [ModelRegistry, AttentionBackendRegistry, CustomOpRegistry, LogitsProcessorRegistry]
    try:
        from tokenmill.tool_parsers.tool_parser_manager import ToolParserManager

        registries.append(ToolParserManager)
    except ImportError:
        pass
    for registry in registries:
        try:
            found.extend(registry.get_conflicts())
        except Exception:  # noqa: BLE001 - the hook's error is reported above
            pass
    return found


def _platforms(warnings: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import os

    from tokenmill.platforms.selection import PLATFORM_ENV, _run_detector, select_platform

    tried = []
    for plugin in manager.get_platform_specs():
        r = _run_detector(plugin)
        tried.append({"name": plugin.name, "entry_point": plugin.entry_point, "distribution": plugin.distribution,
                      "platform_cls": plugin.spec.platform_cls, "description": plugin.spec.description,
                      "active": r.active, "reason": r.reason, "detector_error": r.error})
    active = [t["name"] for t in tried if t["active"]]
    if len(active) > 1:
        warnings.append(f"more than one platform plugin is active ({', '.join(active)}): start-up stops with "
                        "PlatformConflictError unless --platform / TOKENMILL_PLATFORM names one")
    for t in tried:
        if t["detector_error"]:
            warnings.append(f"the detector of platform {t['name']} ({t['distribution']}) raised "
                            f"{t['detector_error']}: start-up stops unless --platform names a platform")
    selection: dict[str, Any] = {"requested": os.environ.get(PLATFORM_ENV) or None}
    try:
        chosen = select_platform()
    except Exception as exc:  # noqa: BLE001 - the reason nothing is selected is the report
        selection.update(selected=None, error=_error(exc))
        return tried, selection
    cls = chosen.platform_cls
    selection.update(selected=cls.name, platform_cls=f"{cls.__module__}:{cls.__qualname__}", reason=chosen.reason,
                     device_type=cls.device_type, dist_backend=cls.dist_backend,
                     supported_dtypes=list(cls.supported_dtypes), default_dtype=cls.default_dtype,
                     supports_graph_capture=bool(cls.supports_graph_capture and cls.graph_capture_cls()),
                     supports_compile=cls.supports_compile, _cls=cls)
    return tried, selection


def _attention(platform_cls: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    from tokenmill.attention.registry import AttentionBackendRegistry

    try:
        backends = _registry(AttentionBackendRegistry, AttentionBackendRegistry.get_backend_names())
    except Exception as exc:  # noqa: BLE001
        return {"error": _error(exc)}, None
    if platform_cls is None:
        return backends, None
    from tokenmill.attention.selector import select_attn_backend
    from tokenmill.config import EngineConfig, ModelConfig

    config = EngineConfig(model_config=ModelConfig(model="", tokenizer="", hf_config=None))
    try:
        choice = select_attn_backend(platform_cls, config)
    except Exception as exc:  # noqa: BLE001
        return backends, {"error": _error(exc)}
    return backends, {"name": choice.name, "class": choice.path, "chosen_by": choice.reason,
                      "registered_by": choice.source}


def _architectures(model: str | None, out: dict[str, Any]) -> dict[str, Any]:
    from tokenmill.model_loader.registry import ModelRegistry

    try:
        archs = _registry(ModelRegistry, ModelRegistry.get_supported_archs())
    except Exception as exc:  # noqa: BLE001
        return {"error": _error(exc)}
    if model is not None:
        try:
            from tokenmill.model_loader.hf_config import load_hf_config, resolve_model_location

            loc = resolve_model_location(model)
            names = list(getattr(load_hf_config(loc.directory, loc.gguf_file), "architectures", None) or [])
            cls = ModelRegistry.resolve_model_cls(names)
            out["model"] = {"path": model, "architectures": names, "class": f"{cls.__module__}:{cls.__qualname__}"}
        except Exception as exc:  # noqa: BLE001
            out["model"] = {"path": model, "error": _error(exc)}
    return archs


def _custom_ops(platform_cls: Any) -> dict[str, dict[str, str]]:
    from tokenmill.layers.custom_op import CUSTOM_OPS, CustomOpRegistry
    from tokenmill.platforms.interface import Platform

    def platform_answer(cls: Any, name: str) -> str | None:
        if name == "fused_moe":
            return cls.get_fused_moe_cls()
        if name.startswith("quant_linear."):
            return cls.get_quant_method_cls(name.split(".", 1)[1])
        return cls.get_custom_op_cls(name)

    result = {}
    registered = CustomOpRegistry.get_registered_ops()
    for name, base in CUSTOM_OPS.items():
        builtin = platform_answer(Platform, name) or (None if name.startswith("quant_linear.") else base)
        if name in registered:
            result[name] = {"class": registered[name], "source": CustomOpRegistry.source_of(name)}
            continue
        path = platform_answer(platform_cls, name) if platform_cls is not None else None
        if path and path != builtin:
            result[name] = {"class": path, "source": f"platform {platform_cls.name}"}
        elif builtin is not None:
            result[name] = {"class": builtin, "source": "builtin"}
        else:
            result[name] = {"class": "not supported on this platform", "source": "-"}
    return result


def _quant_methods(platform_cls: Any) -> dict[str, str | None]:
    from tokenmill.config import QUANTIZATION_METHODS
    from tokenmill.layers.custom_op import CustomOpRegistry

    out: dict[str, str | None] = {}
    for method in QUANTIZATION_METHODS:
        target = CustomOpRegistry.lookup(f"quant_linear.{method}")
        if target is None and platform_cls is not None:
            target = platform_cls.get_quant_method_cls(method)
        out[method] = _path(target) if target is not None else None
    return out


def _tool_parsers() -> dict[str, Any]:
    from tokenmill.tool_parsers.tool_parser_manager import ToolParserManager

    try:
        return _registry(ToolParserManager, ToolParserManager.list_tool_parsers())
    except Exception as exc:  # noqa: BLE001
        return {"error": _error(exc)}


def _logits_processors() -> dict[str, Any]:
    from tokenmill.worker.logits_processor import LogitsProcessorRegistry

    try:
        return _registry(LogitsProcessorRegistry, LogitsProcessorRegistry.get_names())
    except Exception as exc:  # noqa: BLE001
        return {"error": _error(exc)}


def format_diagnosis(d: dict[str, Any]) -> str:
    """The report for people (what ``tokenmill plugins`` prints)."""
    lines = [f"tokenmill {d['tokenmill_version']}, plugin API {d['plugin_api_version']}", "", "Plugin distributions:"]
    for dist, info in sorted(d["distributions"].items()):
        lines.append(f"  {dist} {info['version']}")
        for ep in info["entry_points"]:
            state = ("loaded" if ep["loaded"] else "excluded by TOKENMILL_PLUGINS" if ep["excluded_by_TOKENMILL_PLUGINS"]
                     else "FAILED")
            req = f", requires plugin API {ep['requires_plugin_api']}" if ep["requires_plugin_api"] else ""
            lines.append(f"    [{ep['group']}] {ep['name']} = {ep['value']}: {state}{req}")
            if ep["hooks"]:
                lines.append(f"      hooks: {', '.join(ep['hooks'])}")
            if ep["error"]:
                lines.append(f"      error: {ep['error']}")
                lines.extend(f"      | {t}" for t in (ep["traceback_tail"] or "").splitlines())
    lines += ["", "Platforms tried:"]
    for p in d["platforms"]:
        if p["detector_error"]:
            outcome = f"detect() RAISED {p['detector_error']}"
        else:
            outcome = ("active" if p["active"] else "declined") + (f": {p['reason']}" if p["reason"] else "")
        lines.append(f"  {p['name']} ({p['distribution']}, {p['platform_cls']}): {outcome}")
    sel = d["selection"]
    lines.append("")
    if sel.get("selected"):
        lines.append(f"Selected platform: {sel['selected']} ({sel['platform_cls']}): {sel['reason']}")
        lines.append(f"  device {sel['device_type']}, {sel['dist_backend']}, dtypes {', '.join(sel['supported_dtypes'])} "
                     f"(default {sel['default_dtype']}), device graphs {'yes' if sel['supports_graph_capture'] else 'no'}, "
                     f"torch.compile {'yes' if sel['supports_compile'] else 'no'}")
        for k, v in (d.get("kernel_info") or {}).items():
            lines.append(f"  kernel {k}: {v}")
    else:
        err = sel.get("error", {})
        lines.append(f"Selected platform: none ({err.get('type')}):")
        lines.extend(f"  {line}" for line in str(err.get("message", "")).splitlines())
    ab = d.get("attention_backend")
    if ab:
        lines.append("Attention backend: " + (f"{ab['name']} ({ab['class']}), chosen by {ab['chosen_by']}, registered by "
                                              f"{ab['registered_by']}" if "name" in ab else f"ERROR {ab['error']['message']}"))
    if "model" in d:
        m = d["model"]
        lines.append("Model class: " + (f"{m['architectures']} -> {m['class']}" if "class" in m
                                        else f"ERROR {m['error']['message']}"))

    def table(title: str, entries: dict[str, Any]) -> None:
        lines.extend(["", f"{title}:"])
        if "error" in entries and isinstance(entries["error"], dict):
            lines.append(f"  ERROR {entries['error']['message']}")
            return
        if "unavailable" in entries:
            lines.append(f"  ({entries['unavailable']})")
            return
        if not entries:
            lines.append("  (none)")
        for name, info in sorted(entries.items()):
            if isinstance(info, dict):
                target = info.get("target") or info.get("class")
                lines.append(f"  {name:<28} {target}  [{info['source']}]")
            else:
                lines.append(f"  {name:<28} {info or 'not supported on this platform'}")

    table("Architectures", d["architectures"])
    table("Attention backends", d["attention_backends"])
    table("Custom ops", d["custom_ops"])
    table("Quantization methods", d["quantization_methods"])
    table("Tool parsers", d["tool_parsers"])
    table("Logits processors", d["logits_processors"])
    lines += ["", "Warnings:" if d["warnings"] else "Warnings: none"]
    lines.extend(f"  - {w}" for w in d["warnings"])
    return "\n".join(lines)
