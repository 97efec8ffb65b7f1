"""CpuPagedAttentionBackend: the torch paged backend with decode attention in tokenmill-cpu's C++ kernel.

Same cache layout as tokenmill's ``TorchPagedAttentionBackend``, through its documented extension points:
the cache write goes to :func:`tokenmill_cpu.kernels.write_kv_cache` (``write_kv``; int8 and fp8 caches, see
``--kv-cache-dtype``, quantized there), one-token queries (pure decode steps, and the decodes of mixed steps) go
to :func:`tokenmill_cpu.kernels.paged_decode` (``forward_decode``), which reads the cache blocks in place (sliding
windows and logit soft caps included; int8 and fp8 caches dequantized as they are read), the fresh prompts of a
step to :func:`tokenmill_cpu.kernels.prefill_attention_varlen` in one call (``forward_prefills``), and prompt chunks after
a cached prefix (which the torch backend gathers from the cache) to :func:`tokenmill_cpu.kernels.prefill_attention`
(``forward_prefill``), and an encoder model's sequences to the same varlen kernel without the causal mask
(``forward_bidirectional``); with a logit soft cap prompts stay on torch's path. The kernels build in the background
(:func:`tokenmill_cpu.kernels.load_async`) while the model loads; until they are ready, and when they cannot be
built, the backend behaves exactly like the torch one.
"""

from __future__ import annotations

import torch

from tokenmill.plugin_api import AttentionImpl, TorchPagedAttentionBackend, TorchPagedAttentionImpl, is_quantized_kv_dtype
from tokenmill_cpu import kernels

KERNEL_MAX_ENCODER_LEN = 128  # longer encoder sequences go to SDPA (CpuPagedAttentionImpl.forward_bidirectional)

_WIDENED = (torch.bfloat16, torch.float16)  # caches the kernels take under a float32 model (--kv-cache-dtype)


def _kernel_converts(model_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the kernels take this model dtype over this cache dtype as they are (same dtype, or a reduced cache
    under float32)."""
    return model_dtype == cache_dtype or (model_dtype == torch.float32 and cache_dtype in _WIDENED)


class CpuPagedAttentionBackend(TorchPagedAttentionBackend):
    name = "CPU_PAGED"

    @classmethod
    def wait_until_ready(cls) -> None:
        kernels.load()

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return CpuPagedAttentionImpl


class CpuPagedAttentionImpl(TorchPagedAttentionImpl):
    # Same signature as AttentionImpl.__init__: every impl takes the backend's constructor arguments.
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window, logits_soft_cap)
        kernels.load_async()  # the model loads meanwhile; steps use the torch path until the kernels are ready
        self._use_kernel: bool | None = None  # None: whenever the kernels are ready

    @property
    def use_kernel(self) -> bool:
        return kernels.ready() if self._use_kernel is None else self._use_kernel

    @use_kernel.setter
    def use_kernel(self, value: bool) -> None:
        self._use_kernel = value

    def forward_decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """The C++ kernel (:func:`tokenmill_cpu.kernels.paged_decode`) under the torch backend's decode contract
        (:meth:`TorchPagedAttentionImpl.forward_decode`)."""
        if not self.use_kernel or kv_cache.device.type != "cpu":
            return super().forward_decode(q, kv_cache, block_table, seq_lens, block_size)
        dtype = q.dtype
        if is_quantized_kv_dtype(kv_cache.dtype):
            q = q.float()  # the kernel reads quantized caches under float32 queries
        elif not _kernel_converts(q.dtype, kv_cache.dtype):
            q = q.to(kv_cache.dtype)  # a combination the kernel does not widen
        out = kernels.paged_decode(
            q, kv_cache, block_table.to(torch.int32).contiguous(), seq_lens.to(torch.int32),
            self.scale, self.sliding_window, self.logits_soft_cap,
        )
        return out.to(dtype)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The C++ cache write (:func:`tokenmill_cpu.kernels.write_kv_cache`) under the torch backend's contract
        (:meth:`TorchPagedAttentionImpl.write_kv`); torch's indexed assignment for a cache dtype it does not
        convert to."""
        if (not self.use_kernel or kv_cache.device.type != "cpu" or slot_mapping.dtype != torch.int64
                or not (_kernel_converts(k.dtype, kv_cache.dtype) or is_quantized_kv_dtype(kv_cache.dtype))):
            return super().write_kv(k, v, kv_cache, slot_mapping)
        kernels.write_kv_cache(k, v, kv_cache, slot_mapping)

    def forward_prefills(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranges: list[tuple[int, int]], out: torch.Tensor
    ) -> None:
        """All fresh prompts of a step in one call of the C++ kernel
        (:func:`tokenmill_cpu.kernels.prefill_attention_varlen`) under the torch backend's contract
        (:meth:`TorchPagedAttentionImpl.forward_prefills`); torch's path with a logit soft cap."""
        if not self.use_kernel or q.device.type != "cpu" or self.logits_soft_cap is not None:
            return super().forward_prefills(q, k, v, ranges, out)
        kernels.prefill_attention_varlen(q, k, v, torch.tensor(ranges, dtype=torch.int32).view(-1, 2), self.scale,
                                         self.sliding_window, out)

    def forward_bidirectional(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              ranges: list[tuple[int, int]]) -> torch.Tensor:
        """An encoder step's sequences of up to :data:`KERNEL_MAX_ENCODER_LEN` tokens in one call of the C++ kernel,
        bidirectionally (:func:`tokenmill_cpu.kernels.prefill_attention_varlen` with ``causal=False``), longer ones
        on torch's batched SDPA, under the torch backend's contract
        (:meth:`TorchPagedAttentionImpl.forward_bidirectional`); all on torch's path with a logit soft cap.

        Why split by length: SDPA's CPU flash kernel has a large cost per sequence and head, so the kernel's tiles
        took a third to a half of its time on sequences of 64-128 tokens (Zen 4, 12 heads of 32 or 64); its
        blocked products overtake the tiles from about 200 tokens (at 512 tokens the kernel took 1.3-2x as long).
        """
        if not self.use_kernel or q.device.type != "cpu" or self.logits_soft_cap is not None:
            return super().forward_bidirectional(q, k, v, ranges)
        short = [r for r in ranges if r[1] - r[0] <= KERNEL_MAX_ENCODER_LEN]
        if len(short) == len(ranges):
            out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        else:  # the long ones first; the kernel then fills the other rows of the same output
            long = [r for r in ranges if r[1] - r[0] > KERNEL_MAX_ENCODER_LEN]
            out = super().forward_bidirectional(q, k, v, long).reshape(q.shape[0], -1)
        if short:
            kernels.prefill_attention_varlen(q, k, v, torch.tensor(short, dtype=torch.int32).view(-1, 2), self.scale,
                                             None, out, causal=False)
        return out

    def forward_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The C++ kernel (:func:`tokenmill_cpu.kernels.prefill_attention`) under the torch backend's contract
        (:meth:`TorchPagedAttentionImpl.forward_prefill`); torch's path with a logit soft cap."""
        if not self.use_kernel or q.device.type != "cpu" or self.logits_soft_cap is not None:
            return super().forward_prefill(q, k, v)
        return kernels.prefill_attention(q, k, v, self.scale, self.sliding_window)
