"""Engine configuration: EngineConfig = ModelConfig + CacheConfig + SchedulerConfig + ParallelConfig.

Built by :class:`tokenmill.engine_args.EngineArgs.create_engine_config`; every field is resolved (no
``None`` meaning "decide later") once the platform's ``check_and_update_config`` has run, except
``CacheConfig.num_gpu_blocks`` which the worker fills in after sizing the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

QUANTIZATION_METHODS = ("int8", "int4")  # see tokenmill.layers.quantization
COMPILE_MODES = ("background", "blocking")  # see tokenmill.worker.compiled_runner

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # torch dtypes of these: tokenmill.dtypes.TORCH_DTYPES
MODEL_DTYPES = ("auto", *DTYPE_NAMES)  # see ModelConfig.dtype
# Quantized KV caches (vLLM's names; "fp8" is "fp8_e4m3"): tokenmill.attention.kv_cache_quant, docs/quantization.md
QUANTIZED_KV_CACHE_DTYPES = ("int8", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPES = ("auto", *DTYPE_NAMES, *QUANTIZED_KV_CACHE_DTYPES)  # see CacheConfig.cache_dtype


def canonical_kv_cache_dtype(name: str) -> str:
    """``name`` with vLLM's alias resolved (``"fp8"`` -> ``"fp8_e4m3"``); other names unchanged."""
    return "fp8_e4m3" if name == "fp8" else name


@dataclass
class ModelConfig:
    """What model to run and how.

    Attributes:
        model: local directory (Hugging Face layout) or path of a ``.gguf`` file.
        tokenizer: directory the tokenizer loads from (defaults to ``model``'s directory).
        gguf_file: file name inside ``tokenizer`` when the model is a GGUF file, else ``None``.
        hf_config: the ``transformers.PretrainedConfig`` of the model.
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"`` once resolved (``"auto"`` before).
        max_model_len: longest sequence (prompt + output) in tokens.
        served_model_name: the name the API reports and accepts.
        seed: seed of the engine's global random generators.
        trust_remote_code: passed to transformers when reading configs and tokenizers.
        quantization: ``"int8"`` or ``"int4"``: quantized weight copies made after loading, used for small
            batches (:mod:`tokenmill.layers.quantization`), or for a GGUF file on the CPU the only weights, kept
            quantized from the file (:mod:`tokenmill.model_loader.quantized_loading`); ``None``: full precision.
        runner_type: ``"generate"`` (sampling) or ``"pooling"`` (embeddings, classification; docs/pooling.md).
        convert: ``"none"``, ``"embed"`` or ``"classify"``: how a pooling model is used (``"embed"``: the
            base model's hidden states are pooled; ``"classify"``: through its classification head).
        pooler_config: the pooler of a pooling model (``None`` for generation).
        is_mm_prefix_lm: the model class declares ``is_mm_prefix_lm`` (vLLM's multimodal prefix-LM: an
            image's tokens attend to each other in both directions, Gemma 3): prefill chunks never end inside a
            run of an image's tokens and the attention backend must support ``mm_prefix_ranges``. Set when the engine
            configuration is built.
    """

    model: str
    tokenizer: str
    hf_config: Any
    gguf_file: str | None = None
    dtype: str = "auto"
    max_model_len: int = 0
    served_model_name: str = ""
    seed: int = 0
    trust_remote_code: bool = False
    quantization: str | None = None
    runner_type: str = "generate"
    convert: str = "none"
    pooler_config: Any = None  # tokenmill.pooler_config.PoolerConfig with the pooling runner
    is_mm_prefix_lm: bool = False

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [])

    @property
    def hf_text_config(self) -> Any:
        """The config of the text decoder: ``hf_config`` itself, or a vision-language model's ``text_config``."""
        return text_config_of(self.hf_config)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_text_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_text_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        cfg = self.hf_text_config
        return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)

    @property
    def head_dim(self) -> int:
        cfg = self.hf_text_config
        return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = getattr(self.hf_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.hf_text_config, "eos_token_id", None)
        if eos is None:
            return []
        return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


@dataclass
class CacheConfig:
    """Paged KV cache settings.

    Attributes:
        block_size: tokens per KV block.
        cache_dtype: element type of the KV cache, ``"float32"``, ``"bfloat16"`` or ``"float16"``, or a quantized
            cache ``"int8"``, ``"fp8_e4m3"`` or ``"fp8_e5m2"`` once resolved (``"auto"``, the model's dtype, and
            ``"fp8"``, an alias of ``"fp8_e4m3"``, before). vLLM's ``--kv-cache-dtype``: a float32 model with a
            bfloat16 cache reads half the KV bytes per decode step; keys and values are rounded (or quantized,
            :mod:`tokenmill.attention.kv_cache_quant`) once when they are written, queries and outputs stay in the
            model dtype.
        kv_cache_memory: bytes for the KV cache on CPU (``None``: the platform decides).
        gpu_memory_utilization: fraction of accelerator memory the engine may use.
        enable_prefix_caching: share full blocks between requests by content hash.
        num_gpu_blocks: number of KV blocks, filled in by the worker after sizing the cache.
        num_gpu_blocks_override: force the number of blocks (tests use tiny caches).
        num_state_slots: state slots of a hybrid model's state layers (one per running request, taken from
            the same memory as the KV blocks); 0 for models without state layers.
        attention_free: the model has state layers only (its blocks count tokens, no memory behind them).
    """

    block_size: int = 16
    cache_dtype: str = "auto"
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_gpu_blocks: int | None = None
    num_gpu_blocks_override: int | None = None
    num_state_slots: int = 0
    attention_free: bool = False


@dataclass
class SchedulerConfig:
    """Continuous-batching limits.

    Attributes:
        max_num_seqs: most requests running in one step.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        enable_chunked_prefill: split long prompts across steps.
        long_prefill_token_threshold: a prompt chunk is capped at this many tokens (0: no cap).
        policy: ``"fcfs"`` or ``"priority"``.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"


DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")
DATA_PARALLEL_BACKENDS = ("mp", "ray")
DATA_PARALLEL_ROUTING = ("least-loaded", "prefix-aware")


@dataclass
class ParallelConfig:
    """How the model is split across workers, and how many engine cores serve it.

    Ranks of one engine core: ``world_size = pipeline_parallel_size * tensor_parallel_size`` workers; global
    rank ``r`` is tensor-parallel rank ``r % tensor_parallel_size`` of pipeline stage
    ``r // tensor_parallel_size`` (vLLM's layout), so the ranks of one stage are neighbours.

    Attributes:
        tensor_parallel_size: ranks that split every layer (heads, MLP columns) of one stage.
        pipeline_parallel_size: stages that split the layers; each holds a contiguous range of decoder layers
            (the first also the embedding, the last also the final norm and the LM head).
        data_parallel_size: independent engine cores (each with its own scheduler, KV cache and
            ``world_size`` workers) behind one front end.
        distributed_executor_backend: ``"uni"``, ``"mp"`` or ``"ray"`` (``None``: uni for one rank, else mp;
            ray when ``data_parallel_backend`` is ray and there is more than one rank).
        data_parallel_backend: ``"mp"`` (engine cores are local processes) or ``"ray"`` (Ray actors, placed
            on the cluster with one placement group per engine core).
        data_parallel_routing: ``"least-loaded"`` (queue length, then KV-cache usage) or ``"prefix-aware"``
            (requests sharing a prompt prefix go to the engine that saw it, unless it is much busier).
        data_parallel_rank: index of this engine core among the ``data_parallel_size`` (set per engine core).
        ray_address: Ray cluster to join (``None``: ``$RAY_ADDRESS``, else a local cluster is started).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    data_parallel_backend: str = "mp"
    data_parallel_routing: str = "least-loaded"
    data_parallel_rank: int = 0
    ray_address: str | None = None

    @property
    def world_size(self) -> int:
        """Workers of one engine core (tensor x pipeline ranks)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class DeviceConfig:
    """Which platform runs the model.

    Attributes:
        platform: the chosen platform's name (``"cpu"``, ``"cuda"``, ...).
        device_type: torch device type of that platform (``"cpu"``, ``"cuda"``).
    """

    platform: str = ""
    device_type: str = "cpu"


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (``--enable-lora``; see docs/lora.md).

    Attributes:
        max_loras: adapters one step can use at once (the GPU-side slots of every LoRA layer).
        max_lora_rank: the largest adapter rank accepted; slots are sized for it.
        max_cpu_loras: adapters kept loaded in host memory (LRU; at least ``max_loras``).
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1


def text_config_of(hf_config: Any) -> Any:
    """``hf_config.get_text_config()`` where transformers offers it (a vision-language model's decoder config),
    else ``hf_config``."""
    get = getattr(hf_config, "get_text_config", None)
    return get() if callable(get) else hf_config


@dataclass
class MultiModalConfig:
    """Image inputs (docs/multimodal.md).

    Attributes:
        limit_per_prompt: the most items of each modality one prompt may hold (vLLM's ``--limit-mm-per-prompt``,
            e.g. ``{"image": 2}``); a modality left out has no limit.
        allowed_local_media_path: ``file://`` image URLs must point inside this folder (``None``: refused).
        allow_http: fetch ``http(s)`` image URLs (off: such URLs are refused with a 400).
        mm_processor_kwargs: keyword arguments for every call of the Hugging Face processor (e.g. image sizes).
        encoder_cache_size: encoder outputs (embedding rows) the workers keep between steps, so an image whose
            placeholder spans several prefill chunks is encoded once; also the most rows one step encodes (``0``:
            the larger of 8192 and the scheduler's token budget).
    """

    limit_per_prompt: dict[str, int] = field(default_factory=dict)
    allowed_local_media_path: str | None = None
    allow_http: bool = False
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    encoder_cache_size: int = 0


@dataclass
class StructuredOutputsConfig:
    """Constrained decoding (JSON schemas, regexes, grammars; see docs/structured_outputs.md).

    Attributes:
        backend: ``"auto"`` (xgrammar, or llguidance for what xgrammar cannot compile, chosen per request),
            ``"xgrammar"`` or ``"guidance"``.
    """

    backend: str = "auto"


@dataclass
class EngineConfig:
    """Everything the engine core, executor and workers need; picklable (sent to engine-core processes).

    Attributes:
        enforce_eager: no device graphs and no ``torch.compile`` (every step eager).
        attention_backend: registered attention-backend name the user asked for (``--attention-backend``), or
            ``None``: the platform chooses (see :mod:`tokenmill.attention.selector`).
        logits_processors: ``"module:Class"`` paths (or classes, in-process) of logits processors run besides
            the ones plugins register (see :mod:`tokenmill.worker.logits_processor`).
        logits_processor_pattern: a regular expression; requests may name per-request logits processors whose
            qualified name it matches in full (see :mod:`tokenmill.worker.request_logits_processors`); ``None``:
            requests may name none.
    """

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    enforce_eager: bool = False
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    attention_backend: str | None = None
    logits_processors: list[Any] = field(default_factory=list)
    logits_processor_pattern: str | None = None
    # "blocking": compile before serving; "background": serve eagerly and swap compiled graphs in when ready.
    compile_mode: str = "blocking"
    lora_config: LoRAConfig | None = None  # None: LoRA adapters are off
    multimodal_config: MultiModalConfig = field(default_factory=MultiModalConfig)
    # speculative decoding (tokenmill.spec_decode.config.SpeculativeConfig), or None
    speculative_config: Any = None


def parse_json_object(value: dict[str, Any] | str, name: str) -> dict[str, Any]:
    """A flag that takes a JSON object (``--speculative-config``, ``--hf-overrides``): the text parsed, or the
    dict given (``LLM(...)`` keyword arguments), copied.

    Raises:
        ValueError: not valid JSON, or not an object (the message starts with ``name``).
    """
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: must be a JSON object, got {type(value).__name__}")
    return dict(value)
