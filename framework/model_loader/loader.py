"""Build a model from the registry and fill its weights from a directory or a GGUF file."""

from __future__ import annotations

import logging

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.dtypes import str_to_dtype
from tokenmill.model_loader.registry import ModelRegistry

logger = logging.getLogger(__name__)


def get_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    """Instantiate the architecture named in the config and load its weights on ``device``.

    Raises:
        tokenmill.model_loader.registry.UnknownArchitectureError: no registered class for the architecture.
        ValueError: a parameter was left without weights, or pipeline parallelism with a model that does not
            support it.
    """
    model_cls = ModelRegistry.resolve_model_cls(model_config.architectures)
    from tokenmill.distributed import get_pp_size, get_tp_rank, get_tp_size
    from tokenmill.model_contract import check_model_class

    check_model_class(model_cls)
    if get_pp_size() > 1 and not getattr(model_cls, "supports_pp", False):
        raise ValueError(
            f"pipeline_parallel_size: {model_cls.__name__} does not support pipeline parallelism (it does not "
            "set supports_pp; see docs/distributed.md for the model contract)"
        )
    if get_tp_rank() == 0:
        arch = next((a for a in model_config.architectures if ModelRegistry.is_registered(a)), "?")
        logger.info("model class: %s -> %s.%s (registered by %s)", arch, model_cls.__module__, model_cls.__qualname__,
                    ModelRegistry.source_of(arch))
    dtype = str_to_dtype(model_config.dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(model_config)
    finally:
        torch.set_default_dtype(previous)
    # Weights stay quantized from a GGUF file on one process (tokenmill.model_loader.quantized_loading), in the
    # platform's formats (the CPU plugin's, the Triton ones of the CUDA and ROCm plugins); with tensor or
    # pipeline parallelism the model loads in float and gets quantized copies, as before. An AWQ/GPTQ checkpoint
    # (tokenmill.model_loader.hf_quant_weights) goes the same way, with or without --quantization; elsewhere its
    # weights are dequantized as the layers load them.
    from tokenmill.model_loader.hf_quant_config import parse_hf_quant_config

    hf_quant = None if model_config.gguf_file else parse_hf_quant_config(model_config.hf_config)
    keep_quantized = bool((model_config.gguf_file and model_config.quantization or hf_quant)
                          and get_tp_size() == 1 and get_pp_size() == 1)
    if model_config.gguf_file:
        from tokenmill.model_loader.gguf_weights import iterate_gguf_weights

        weights = iterate_gguf_weights(model_config.model, model_config.hf_config, keep_quantized)
    else:
        from tokenmill.model_loader.hf_dir import iterate_hf_weights

        weights = iterate_hf_weights(model_config.model)
        if hf_quant is not None:
            from tokenmill.model_loader.hf_quant_weights import iterate_hf_quant_weights

            weights = iterate_hf_quant_weights(weights, hf_quant)
    if keep_quantized:
        from tokenmill.model_loader import quantized_loading

        prepared = quantized_loading.prepare_quantized_loading(model, model_config.quantization,
                                                               embedding_blocks=bool(model_config.gguf_file)
                                                               and torch.device(device).type == "cpu")
        weights = quantized_loading.feeding_tied_heads(model, weights)
    with torch.no_grad():
        loaded = model.load_weights(weights)
    if keep_quantized:
        quantized_loading.finish_quantized_loading(model)
        held = sum(bool(getattr(m, "quant_only", False)) for m in model.modules())
        logger.info("%s weights kept quantized: %d of %d layers (the rest float); %.1f MiB of buffers",
                    "GGUF" if model_config.gguf_file else hf_quant.method.upper(), held,  # type: ignore[union-attr]
                    prepared, sum(b.numel() * b.element_size() for b in model.buffers()) / 2**20)
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"model: checkpoint has no weights for {sorted(missing)[:8]} ({len(missing)} in all)")
    return model.eval()
