"""The worker's half of image inputs: run the vision encoder for the images a step schedules, keep the outputs
in the encoder cache (keyed by ``mm_hash``) and build the step's input embeddings with each image's rows written
over its placeholder tokens (docs/multimodal.md)."""

from __future__ import annotations

import torch

from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.model_contract import merge_multimodal_embeddings
from tokenmill.worker.input_batch import CachedRequestState


class EncoderRunner:
    """Encoder outputs of one worker.

    Args:
        model: a model with the ``SupportsMultiModal`` contract.
        device: where the model runs.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.encoder_cache: dict[str, torch.Tensor] = {}  # mm_hash -> [rows, hidden]
        self.num_encoder_runs = 0  # images encoded so far (tests check that a chunked image is encoded once)

    def execute(self, so: SchedulerOutput, requests: dict[str, CachedRequestState]) -> None:
        """Drop the evicted entries, then encode this step's scheduled images one by one.

        Raises:
            ValueError: an encoder output's row count differs from the image's placeholder length.
        """
        for mm_hash in so.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        for req_id, indices in so.scheduled_encoder_inputs.items():
            features = requests[req_id].mm_features or []
            for index in indices:
                feature = features[index]
                if feature.mm_hash in self.encoder_cache:
                    continue  # encoded by an earlier request of this step
                item = {name: t.to(self.device) for name, t in feature.tensors().items()}
                out = self.model.get_multimodal_embeddings(**item)  # type: ignore[operator]
                if out.shape[0] != feature.placeholder.num_embeds:
                    raise ValueError(f"the encoder gave {out.shape[0]} rows for an image with "
                                     f"{feature.placeholder.num_embeds} embedding positions")
                self.encoder_cache[feature.mm_hash] = out
                self.num_encoder_runs += 1

    def input_embeddings(self, input_ids: torch.Tensor, states: list[CachedRequestState], counts: list[int],
                         query_start_loc: list[int]) -> torch.Tensor | None:
        """``[T, hidden]`` embeddings of the step's tokens with image rows merged, or ``None`` when no scheduled
        token is an image placeholder (the model then embeds ``input_ids`` itself).

        Args:
            input_ids: ``[T]`` the flattened batch.
            states: the step's requests (``num_computed_tokens`` not yet advanced).
            counts: tokens scheduled per request.
            query_start_loc: ``[B + 1]`` offsets of each request's tokens in the batch.

        Raises:
            KeyError: an image the chunk needs is not in the encoder cache (a scheduler bug).
        """
        rows: list[int] = []
        pieces: list[torch.Tensor] = []
        for i, (state, n) in enumerate(zip(states, counts)):
            if not state.mm_features:
                continue
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            for feature in state.mm_features:
                first, embed_positions = feature.placeholder.embeds_in(start, end)
                if not embed_positions:
                    continue
                cached = self.encoder_cache[feature.mm_hash]
                pieces.append(cached[first : first + len(embed_positions)])
                base = query_start_loc[i] - start
                rows.extend(base + p for p in embed_positions)
        if not rows:
            return None
        embeds = self.model.get_input_embeddings(input_ids)  # type: ignore[operator]
        index = torch.tensor(rows, dtype=torch.int64, device=embeds.device)
        return merge_multimodal_embeddings(embeds, index, pieces)


def mm_prefix_ranges(states: list[CachedRequestState], counts: list[int]) -> list[list[tuple[int, int]]] | None:
    """The step's ``AttentionMetadata.mm_prefix_ranges`` for a multimodal prefix-LM: per request, the runs of
    image embedding positions (``PlaceholderRange.embed_runs``) that overlap its scheduled tokens; ``None`` when
    no request has one.

    Args:
        states: the step's requests (``num_computed_tokens`` not yet advanced).
        counts: tokens scheduled per request.
    """
    ranges: list[list[tuple[int, int]]] = []
    for state, n in zip(states, counts):
        start, end = state.num_computed_tokens, state.num_computed_tokens + n
        ranges.append([(a, b) for feature in state.mm_features or () for a, b in feature.placeholder.embed_runs()
                       if a < end and b > start])
    return ranges if any(ranges) else None
