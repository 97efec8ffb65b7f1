"""EngineArgs: the one source of engine flags for ``tokenmill serve``, ``LLM(...)`` and ``tokenmill bench``.

Flag names follow vLLM's where the concept is the same (``--max-model-len``, ``--max-num-seqs``, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

import logging

from tokenmill.config import (
    COMPILE_MODES,
    DATA_PARALLEL_BACKENDS,
    DATA_PARALLEL_ROUTING,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    MODEL_DTYPES,
    QUANTIZATION_METHODS,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    MultiModalConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    canonical_kv_cache_dtype,
    parse_json_object,
)

logger = logging.getLogger(__name__)

# default step budget of encoder-only pooling models (without --max-num-batched-tokens): 16 sequences of 512 tokens
ENCODER_MAX_NUM_BATCHED_TOKENS = 8192
# the context length of a model whose config names none, unless --max-model-len gives one (vLLM's default)
DEFAULT_MAX_MODEL_LEN = 2048

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_size(value: str | int | None) -> int | None:
    """Parse a byte size such as ``4GiB``, ``512MiB``, ``2G`` or ``1000000`` into bytes.

    Raises:
        ValueError: the text is not a size.
    """
    if value is None or isinstance(value, int):
        return value
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"kv_cache_memory: cannot parse size {value!r} (examples: 4GiB, 512MiB, 2000000000)")
    number, unit = float(m.group(1)), (m.group(2) or "").lower()
    base = 1024 if "i" in unit else 1000
    power = "bkmgt".index(unit[0]) if unit else 0
    return int(number * base**power)


@dataclass
class EngineArgs:
    """Engine settings as users give them (CLI flags or keyword arguments of ``LLM``).

    ``model=None`` means the embedded default model (see :mod:`tokenmill.model_loader.default_model`).
    """

    # Flat fields, one per CLI flag, that mirror the *Config dataclasses' fields; create_engine_config groups them.
    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_memory: str | int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    data_parallel_backend: str = "mp"
    data_parallel_routing: str = "least-loaded"
    ray_address: str | None = None
    seed: int = 0
    enforce_eager: bool = False
    compile_mode: str | None = None
    platform: str | None = None
    attention_backend: str | None = None
    logits_processors: list[Any] | None = None
    logits_processor_pattern: str | None = None
    trust_remote_code: bool = False
    quantization: str | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    speculative_config: dict[str, Any] | str | None = None
    structured_outputs_backend: str = "auto"
    runner: str = "auto"
    convert: str = "auto"
    hf_overrides: dict[str, Any] | str | None = None
    limit_mm_per_prompt: dict[str, int] | str | None = None
    allowed_local_media_path: str | None = None
    allow_image_http: bool = False
    mm_processor_kwargs: dict[str, Any] | str | None = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one flag per field (``--max-model-len`` for ``max_model_len``)."""
        d = EngineArgs()
        g = parser.add_argument_group("engine")
        g.add_argument("--tokenizer", default=d.tokenizer, help="Tokenizer directory (default: the model's).")
        g.add_argument("--served-model-name", default=d.served_model_name, help="Model name the API reports.")
        g.add_argument("--dtype", default=d.dtype, choices=list(MODEL_DTYPES))
        g.add_argument("--max-model-len", type=int, default=d.max_model_len,
                       help="Context length in tokens (default: the model's; 2048 for a model whose config names "
                            "none, such as Mamba2, which takes any length).")
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="Most requests per step.")
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                       help="Token budget of one step (default: max(2048, max_model_len) capped at 8192; "
                            "encoder-only pooling models: 8192, or their context length if larger).")
        g.add_argument("--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold)
        g.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"])
        g.add_argument("--block-size", type=int, default=d.block_size, help="Tokens per KV-cache block.")
        g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
                       help="Element type of the KV cache (default auto: the model's dtype). A float32 model with "
                            "a bfloat16 cache reads half the KV bytes per decode step; int8 (per-token scales) and "
                            "fp8 (= fp8_e4m3) / fp8_e5m2 (scale 1.0) quantize keys and values when they are "
                            "written (docs/quantization.md).")
        g.add_argument("--kv-cache-memory", default=d.kv_cache_memory,
                       help="KV cache size on CPU, e.g. 4GiB (default: min(4 GiB, 1/4 of available RAM)).")
        g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d.enable_prefix_caching)
        g.add_argument("--num-gpu-blocks-override", type=int, default=d.num_gpu_blocks_override)
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                       help="Ranks that split every layer of one pipeline stage.")
        g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=d.pipeline_parallel_size,
                       help="Pipeline stages that split the layers (micro-batches keep every stage busy).")
        g.add_argument("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size,
                       help="Engine cores behind this server, each with its own KV cache and workers.")
        g.add_argument("--distributed-executor-backend", default=d.distributed_executor_backend,
                       choices=list(DISTRIBUTED_EXECUTOR_BACKENDS),
                       help="How one engine core runs its ranks: uni (in process, one rank), mp (local "
                            "processes; default for more than one rank) or ray (Ray actors in a placement group).")
        g.add_argument("--data-parallel-backend", "-dpb", default=d.data_parallel_backend,
                       choices=list(DATA_PARALLEL_BACKENDS),
                       help="Engine cores as local processes (mp) or Ray actors placed on the cluster (ray).")
        g.add_argument("--data-parallel-routing", default=d.data_parallel_routing,
                       choices=list(DATA_PARALLEL_ROUTING),
                       help="How requests are spread over the engine cores: least-loaded (queue length, then "
                            "KV-cache usage) or prefix-aware (same prompt prefix -> same engine core).")
        g.add_argument("--ray-address", default=d.ray_address,
                       help="Ray cluster to join, e.g. 10.0.0.1:6379 (default: $RAY_ADDRESS, else a local "
                            "cluster is started).")
        g.add_argument("--runner", default=d.runner, choices=["auto", "generate", "pooling"],
                       help="generate (sampling) or pooling (embeddings, classification, scores; docs/pooling.md); "
                            "auto: from the architecture and the checkpoint's sentence-transformers files.")
        g.add_argument("--convert", default=d.convert, choices=["auto", "none", "embed", "classify"],
                       help="How the pooling runner uses the model: embed (pooled hidden states) or classify "
                            "(its classification head); auto: classify for *ForSequenceClassification.")
        g.add_argument("--hf-overrides", default=d.hf_overrides, metavar="JSON",
                       help="Fields to set on the model's transformers config, as a JSON object (vLLM's flag), e.g. "
                            "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": "
                            "[\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}' serves a Qwen3-Reranker "
                            "checkpoint as a reranker (docs/pooling.md).")
        g.add_argument("--limit-mm-per-prompt", default=d.limit_mm_per_prompt, metavar="JSON",
                       help='The most images one prompt may hold, as JSON (vLLM\'s flag), e.g. \'{"image": 2}\' '
                            "(default: no limit; docs/multimodal.md).")
        g.add_argument("--allowed-local-media-path", default=d.allowed_local_media_path, metavar="DIR",
                       help="Allow file:// image URLs that point inside DIR (default: file:// URLs are refused).")
        g.add_argument("--allow-image-http", action="store_true", default=d.allow_image_http,
                       help="Fetch http(s) image URLs (default: refused with a 400; send base64 data: URLs).")
        g.add_argument("--mm-processor-kwargs", default=d.mm_processor_kwargs, metavar="JSON",
                       help="Keyword arguments for the model's Hugging Face processor, as a JSON object.")
        g.add_argument("--seed", type=int, default=d.seed)
        g.add_argument("--enforce-eager", action="store_true", default=d.enforce_eager)
        g.add_argument("--compile-mode", default=d.compile_mode, choices=list(COMPILE_MODES),
                       help="When torch.compile'd forward passes are made (platforms that compile, e.g. the CPU): "
                            "background = serve eagerly at once and switch each step kind to its compiled graph "
                            "when ready (default of `tokenmill serve`); blocking = compile before the engine "
                            "accepts requests (default elsewhere). Compiled graphs are cached on disk "
                            "(TOKENMILL_CACHE_DIR), so later starts load them.")
        g.add_argument("--platform", default=d.platform,
                       help="Platform plugin to use (skips detection); also TOKENMILL_PLATFORM.")
        g.add_argument("--attention-backend", default=d.attention_backend,
                       help="Registered attention backend to use instead of the platform's choice (e.g. "
                            "TORCH_PAGED); also TOKENMILL_ATTENTION_BACKEND. `tokenmill plugins` lists them.")
        g.add_argument("--logits-processors", nargs="+", default=d.logits_processors, metavar="MODULE:CLASS",
                       help="Logits processors to run besides those plugins register (see docs/plugins.md).")
        g.add_argument("--logits-processor-pattern", default=d.logits_processor_pattern, metavar="REGEX",
                       help="Let requests name their own logits processors (the logits_processors request field) "
                            "whose qualified name this regular expression matches in full (vLLM's flag; default: "
                            "requests may name none). Only allow code you trust: it runs in the workers.")
        g.add_argument("--trust-remote-code", action="store_true", default=d.trust_remote_code)
        g.add_argument("--quantization", "-q", default=d.quantization, choices=list(QUANTIZATION_METHODS),
                       help="Quantized weights used for small batches (faster decode): int8 or int4 (CPU: GGUF Q8_0 / "
                            "Q4_1 blocks of 32 with 14-bit integer activations); a GGUF file's weights then stay "
                            "quantized from the file, for every batch (docs/quantization.md). Outputs may differ "
                            "slightly from full precision.")
        g.add_argument("--enable-lora", action="store_true", default=d.enable_lora,
                       help="Serve LoRA adapters (PEFT format) next to the base model (docs/lora.md).")
        g.add_argument("--max-loras", type=int, default=d.max_loras,
                       help="Adapters one batch can mix (GPU-side slots, swapped LRU).")
        g.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                       help="Largest adapter rank accepted (slots are sized for it).")
        g.add_argument("--max-cpu-loras", type=int, default=d.max_cpu_loras,
                       help="Adapters kept loaded in host memory, LRU (default: --max-loras).")
        g.add_argument("--speculative-config", default=d.speculative_config,
                       help='Speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                            '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": PATH, '
                            '"num_speculative_tokens": 4}\' (see docs/speculative_decoding.md).')
        g.add_argument("--structured-outputs-backend", default=d.structured_outputs_backend,
                       choices=["auto", "xgrammar", "guidance"],
                       help="Library that compiles JSON schemas, regexes and grammars for constrained decoding: "
                            "xgrammar, guidance (llguidance), or auto (xgrammar, and guidance for what xgrammar "
                            "cannot compile; chosen per request).")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def create_model_config(self) -> ModelConfig:
        """Resolve the model location, read its config and pick the context length: ``max_model_len``, at most
        the config's limit (:func:`~tokenmill.model_loader.hf_config.derived_max_model_len`); a config that
        names no limit (state-space models) takes any positive ``max_model_len`` and defaults to
        :data:`DEFAULT_MAX_MODEL_LEN` (vLLM's rule).

        Raises:
            FileNotFoundError: the model path does not exist.
            ValueError: ``max_model_len`` exceeds what the model supports or is not positive.
        """
        from tokenmill.model_loader.hf_config import derived_max_model_len, load_hf_config, resolve_model_location

        loc = resolve_model_location(self.model)
        hf_config = load_hf_config(loc.directory, loc.gguf_file, trust_remote_code=self.trust_remote_code,
                                   gguf_tokenizer=self.tokenizer is None)
        from tokenmill.model_loader.pooling_setup import resolve_runner
        from tokenmill.model_loader.token_classifier import apply_hf_overrides, parse_hf_overrides

        apply_hf_overrides(hf_config, parse_hf_overrides(self.hf_overrides))

        choice = resolve_runner(loc.directory, hf_config, self.runner, self.convert)
        if loc.gguf_file is None:
            from tokenmill.model_loader.hf_quant_config import parse_hf_quant_config

            parse_hf_quant_config(hf_config)  # an unsupported quant_method fails here, before any weight is read
        derived = derived_max_model_len(hf_config)
        if derived is not None and choice.encoder_only \
                and getattr(hf_config, "model_type", "") in ("xlm-roberta", "roberta"):
            derived -= int(getattr(hf_config, "pad_token_id", 1) or 0) + 1  # positions start after padding_idx
        max_len = self.max_model_len if self.max_model_len is not None else derived
        if max_len is None:
            # as vLLM: a config without a position limit (Mamba2) takes any --max-model-len, else 2048
            max_len = DEFAULT_MAX_MODEL_LEN
            logger.warning("the model's config names no context length (max_position_embeddings, n_positions, "
                           "max_seq_len or seq_length): max_model_len is %d; set --max-model-len for longer "
                           "sequences", max_len)
        if max_len <= 0:
            raise ValueError(f"max_model_len: must be positive, got {max_len}")
        if derived is not None and max_len > derived:
            raise ValueError(f"max_model_len: {max_len} exceeds the model's maximum context length {derived}")
        return ModelConfig(
            model=loc.path,
            tokenizer=self.tokenizer or loc.directory,
            hf_config=hf_config,
            gguf_file=loc.gguf_file,
            dtype=self.dtype,
            max_model_len=max_len,
            served_model_name=self.served_model_name or loc.default_served_name,
            seed=self.seed,
            trust_remote_code=self.trust_remote_code,
            quantization=self.quantization,
            runner_type=choice.runner_type,
            convert=choice.convert,
            pooler_config=choice.pooler_config,
        )

    def create_engine_config(self) -> EngineConfig:
        """Build the full, validated EngineConfig, with the platform's adjustments applied.

        Raises:
            ValueError: an argument is out of range (the message starts with the field name).
            tokenmill.platforms.PlatformError: no usable platform, or a conflict between platform plugins.
        """
        from tokenmill.platforms import get_platform_selection, set_current_platform

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:  # before the model's config is read: cheap to refuse
            raise ValueError(f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.platform or os.environ.get("TOKENMILL_PLATFORM"):
            platform = set_current_platform(self.platform or os.environ["TOKENMILL_PLATFORM"])
        else:
            from tokenmill.platforms import get_current_platform

            platform = get_current_platform()
        if self.structured_outputs_backend not in ("auto", "xgrammar", "guidance"):
            raise ValueError(
                "structured_outputs_backend: must be auto, xgrammar or guidance, got "
                f"{self.structured_outputs_backend!r}"
            )
        logger.info("platform: %s", get_platform_selection().describe())
        attention_backend = self.attention_backend or os.environ.get("TOKENMILL_ATTENTION_BACKEND") or None
        if attention_backend is not None and ":" not in attention_backend:
            from tokenmill.attention.registry import AttentionBackendRegistry

            if not AttentionBackendRegistry.is_registered(attention_backend):
                known = ", ".join(AttentionBackendRegistry.get_backend_names())
                raise ValueError(f"attention_backend: unknown attention backend {attention_backend!r}; "
                                 f"registered: {known}")
        for name in ("max_num_seqs", "block_size", "tensor_parallel_size", "pipeline_parallel_size",
                     "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        parallel_config = self._create_parallel_config()
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        model_config = self.create_model_config()
        max_batched = self.max_num_batched_tokens
        if max_batched is None:
            max_batched = min(max(2048, self.max_num_seqs), 8192)
        if max_batched < 1:
            raise ValueError(f"max_num_batched_tokens: must be at least 1, got {max_batched}")
        if model_config.runner_type == "pooling" and self.pipeline_parallel_size > 1:
            raise ValueError("pipeline_parallel_size: the pooling runner does not support pipeline parallelism")
        from tokenmill.model_loader.pooling_setup import is_encoder_only

        encoder_only = model_config.runner_type == "pooling" and is_encoder_only(model_config.hf_config)
        if encoder_only:
            # bidirectional attention needs each prompt whole in one step, and its KV is never reusable
            if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < model_config.max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens: {self.max_num_batched_tokens} is less than max_model_len "
                    f"{model_config.max_model_len}; an encoder model runs every prompt in one step"
                )
            if self.max_num_batched_tokens is None:
                # Larger steps for encoders: every step's token is prefill, nothing decodes beside it, and each
                # element-wise op and attention call of a step has a fixed cost (thread start and barrier) that
                # weighs most on a loaded CPU (docs/benchmarks.md, "Embedding throughput against
                # sentence-transformers")
                max_batched = max(max_batched, ENCODER_MAX_NUM_BATCHED_TOKENS)
            max_batched = max(max_batched, model_config.max_model_len)
            if self.tensor_parallel_size > 1:
                raise ValueError("tensor_parallel_size: encoder models run on one rank")
        config = EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                cache_dtype=canonical_kv_cache_dtype(self.kv_cache_dtype),
                kv_cache_memory=parse_size(self.kv_cache_memory),
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching and not encoder_only,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_batched,
                long_prefill_token_threshold=0 if encoder_only else self.long_prefill_token_threshold,
                enable_chunked_prefill=not encoder_only,
                policy=self.scheduling_policy,
            ),
            parallel_config=parallel_config,
            device_config=DeviceConfig(platform=platform.name, device_type=platform.device_type),
            enforce_eager=self.enforce_eager,
            structured_outputs_config=StructuredOutputsConfig(backend=self.structured_outputs_backend),
            attention_backend=attention_backend,
            logits_processors=list(self.logits_processors or []),
            logits_processor_pattern=_checked_pattern(self.logits_processor_pattern),
            compile_mode=self.compile_mode or "blocking",
            lora_config=self._create_lora_config(),
            multimodal_config=self._create_multimodal_config(),
        )
        from tokenmill.model_loader.hybrid_setup import configure_hybrid_cache

        configure_hybrid_cache(config)
        from tokenmill.model_loader.mm_prefix_setup import configure_mm_prefix_lm

        configure_mm_prefix_lm(config)
        num_layers = model_config.num_layers
        if self.pipeline_parallel_size > num_layers:
            raise ValueError(
                f"pipeline_parallel_size: {self.pipeline_parallel_size} stages but the model has only "
                f"{num_layers} layers (each stage needs at least one)"
            )
        platform.check_and_update_config(config)
        if self.speculative_config is not None:
            from tokenmill.spec_decode.setup import create_speculative_config

            config.speculative_config = create_speculative_config(self.speculative_config, config)
        return config

    def _create_multimodal_config(self) -> MultiModalConfig:
        """Raises: ValueError for a malformed ``limit_mm_per_prompt`` or ``mm_processor_kwargs``."""
        limits = parse_json_object(self.limit_mm_per_prompt, "limit_mm_per_prompt") if self.limit_mm_per_prompt \
            else {}
        for modality, limit in limits.items():
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise ValueError(f"limit_mm_per_prompt: the limit of {modality!r} must be a non-negative integer, "
                                 f"got {limit!r}")
            if modality != "image":
                raise ValueError(f"limit_mm_per_prompt: unsupported modality {modality!r} (only 'image')")
        kwargs = parse_json_object(self.mm_processor_kwargs, "mm_processor_kwargs") if self.mm_processor_kwargs \
            else {}
        return MultiModalConfig(limit_per_prompt=limits, allowed_local_media_path=self.allowed_local_media_path,
                                allow_http=self.allow_image_http, mm_processor_kwargs=kwargs)

    def _create_parallel_config(self) -> ParallelConfig:
        """The parallel layout, with the executor backend resolved.

        Raises:
            ValueError: an unknown backend or routing policy, or ``uni`` with more than one rank.
        """
        if self.data_parallel_backend not in DATA_PARALLEL_BACKENDS:
            raise ValueError(f"data_parallel_backend: must be one of {DATA_PARALLEL_BACKENDS}, "
                             f"got {self.data_parallel_backend!r}")
        if self.data_parallel_routing not in DATA_PARALLEL_ROUTING:
            raise ValueError(f"data_parallel_routing: must be one of {DATA_PARALLEL_ROUTING}, "
                             f"got {self.data_parallel_routing!r}")
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        backend = self.distributed_executor_backend
        if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend: must be one of {DISTRIBUTED_EXECUTOR_BACKENDS}, "
                             f"got {backend!r}")
        if backend is None:
            if world == 1:
                backend = "uni"
            else:
                backend = "ray" if self.data_parallel_backend == "ray" or self.ray_address else "mp"
        if backend == "uni" and world > 1:
            raise ValueError(
                f"distributed_executor_backend: 'uni' runs one rank, but tensor_parallel_size x "
                f"pipeline_parallel_size = {world}; use 'mp' or 'ray'"
            )
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            distributed_executor_backend=backend,
            data_parallel_backend=self.data_parallel_backend,
            data_parallel_routing=self.data_parallel_routing,
            ray_address=self.ray_address or os.environ.get("RAY_ADDRESS") or None,
        )

    def _create_lora_config(self) -> LoRAConfig | None:
        """``None`` without ``enable_lora``.

        Raises:
            ValueError: ``max_loras`` or ``max_lora_rank`` below 1, ``max_cpu_loras`` below ``max_loras``.
        """
        if not self.enable_lora:
            return None
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        cpu = self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
        if cpu < self.max_loras:
            raise ValueError(f"max_cpu_loras: must be at least max_loras ({self.max_loras}), got {cpu}")
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank, max_cpu_loras=cpu)

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)


def _checked_pattern(pattern: str | None) -> str | None:
    """``--logits-processor-pattern`` after checking that it compiles.

    Raises:
        ValueError: not a valid regular expression.
    """
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"logits_processor_pattern: not a valid regular expression: {exc}") from exc
    return pattern
