"""StructuredOutputManager: compiles constraints off the engine core's busy loop and builds token bitmasks.

After vLLM V1's design (``vllm/v1/structured_output/__init__.py``): the scheduler hands each constrained
request to :meth:`grammar_init`, which compiles it on a thread pool (the request waits in
``WAITING_FOR_GRAMMAR`` meanwhile); compiled grammars are cached by constraint, so a repeated schema costs
one matcher creation. Each step the scheduler asks :meth:`grammar_bitmask` for the rows of the scheduled
constrained requests that sample, and the worker applies them to the logits before sampling.

The engine core never detokenizes outputs, but grammar compilation needs the vocabulary: the manager loads
the model's tokenizer itself, in the pool, when the first constrained request arrives (so an engine that is
never asked for structured outputs never loads it).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    grammar_key,
)
from tokenmill.structured_output.request import StructuredOutputRequest
from tokenmill.structured_output.validation import backend_class

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.core.request import Request

logger = logging.getLogger(__name__)

# Distinct compiled grammars kept (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 256


class StructuredOutputManager:
    """Grammar compilation, caching and bitmasks for one engine core.

    Args:
        config: the engine configuration (model vocabulary, tokenizer location, the configured backend).
        tokenizer: the tokenizer to compile against (default: the model's, loaded on first use).
        max_workers: compile threads (default: half the CPUs, 1 to 4).
    """

    def __init__(self, config: EngineConfig, tokenizer: Any = None, max_workers: int | None = None) -> None:
        self.model_config = config.model_config
        self.default_backend = config.structured_outputs_config.backend
        self._tokenizer = tokenizer
        self._max_workers = max_workers or max(1, min(4, (os.cpu_count() or 2) // 2))
        self._executor: ThreadPoolExecutor | None = None
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[object, ...], Any] = OrderedDict()
        self._live: dict[str, StructuredOutputRequest] = {}
        self.num_compiled = 0  # compilations run (cache misses)
        self.num_cache_hits = 0

    @property
    def vocab_size(self) -> int:
        return int(self.model_config.vocab_size)

    # ------------------------------------------------------------------ requests

    def grammar_init(self, request: Request) -> None:
        """Start compiling ``request``'s constraint (``request.structured_output_request`` must be set)."""
        so_request = request.structured_output_request
        assert so_request is not None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="tokenmill-grammar")
        so_request.set_future(self._executor.submit(self._create_grammar, so_request.params))
        self._live[request.request_id] = so_request

    def free(self, request: Request) -> None:
        """Forget ``request``'s matcher (finished, aborted or failed); cancels a compilation not yet started."""
        so_request = self._live.pop(request.request_id, None)
        if so_request is not None:
            so_request.cancel()

    @property
    def num_live_requests(self) -> int:
        """Requests holding a matcher or a pending compilation (0 when the engine is idle: nothing leaked)."""
        return len(self._live)

    def wait_for_grammars(self, requests: Iterable[Request], timeout_s: float) -> None:
        """Block until one of ``requests``' compilations finishes or ``timeout_s`` passes (the engine core
        calls it instead of spinning when nothing else can run)."""
        futures: list[Future[StructuredOutputGrammar]] = []
        for request in requests:
            so_request = request.structured_output_request
            if so_request is not None and so_request.future is not None:
                futures.append(so_request.future)
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    # ------------------------------------------------------------------ compilation

    def _backend(self, name: str) -> StructuredOutputBackend:
        with self._lock:
            backend = self._backends.get(name)
            if backend is None:
                tokenizer = self._get_tokenizer()
                cls = backend_class(name)
                backend = cls(tokenizer, self.vocab_size, self._stop_token_ids(tokenizer))
                self._backends[name] = backend
            return backend

    def _get_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from tokenmill.tokenizer import get_tokenizer

            logger.info("loading the tokenizer for structured outputs")
            self._tokenizer = get_tokenizer(self.model_config)
        return self._tokenizer

    def _stop_token_ids(self, tokenizer: Any) -> list[int]:
        ids: list[int] = []
        eos = getattr(tokenizer, "eos_token_id", None)
        for t in ([eos] if eos is not None else []) + list(self.model_config.eos_token_ids):
            if 0 <= int(t) < self.vocab_size and int(t) not in ids:
                ids.append(int(t))
        return ids

    def _create_grammar(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        name = params.backend or ("xgrammar" if self.default_backend == "auto" else self.default_backend)
        backend = self._backend(name)
        key = (name, *grammar_key(params))
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
        if compiled is None:
            compiled = backend.compile(params)
            with self._lock:
                self._cache[key] = compiled
                self.num_compiled += 1
                while len(self._cache) > GRAMMAR_CACHE_SIZE:
                    self._cache.popitem(last=False)
        return backend.new_grammar(compiled)

    # ------------------------------------------------------------------ bitmasks

    def grammar_bitmask(self, requests: list[Request]) -> np.ndarray:
        """The next-token bitmask of each request (ready matchers), one row each, in order.

        A request still in a reasoning model's thinking gets an all-allowed row (the grammar applies to the
        answer), or, once its thinking budget is spent, a row allowing only the next token of the end marker.

        Returns:
            ``[len(requests), ceil(vocab_size / 32)]`` int32; bit ``t % 32`` of word ``t // 32`` set when token
            ``t`` is allowed.
        """
        bitmask = torch.full((len(requests), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        for row, request in enumerate(requests):
            if request.in_reasoning:
                # the grammar applies to the answer: nothing is masked before the end-of-thinking marker,
                # except the marker's own tokens once the thinking budget is spent
                forced = request.reasoning.forced_token(request.output_token_ids)  # type: ignore[union-attr]
                if forced is not None and 0 <= forced < self.vocab_size:
                    bitmask[row] = 0
                    bitmask[row, forced // 32] = _bit(forced % 32)
                continue
            so_request = request.structured_output_request
            grammar = so_request.grammar if so_request is not None else None
            if grammar is not None and not grammar.is_terminated():
                grammar.fill_bitmask(bitmask, row)
        return bitmask.numpy()

    def shutdown(self) -> None:
        """Stop the compile threads and drop every matcher and cached grammar."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        for so_request in self._live.values():
            so_request.cancel()
        self._live.clear()
        with self._lock:
            for backend in self._backends.values():
                backend.destroy()
            self._backends.clear()
            self._cache.clear()


def _bit(position: int) -> int:
    """The int32 word with only bit ``position`` (0-31) set (bit 31 is the sign bit)."""
    return (1 << position) - (1 << 32 if position == 31 else 0)
