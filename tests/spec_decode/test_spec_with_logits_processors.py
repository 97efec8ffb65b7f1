"""Logits processors (plugins' and ``--logits-processors``) act on every verified position, with the drafts
before it counted as outputs: speculation changes nothing in the tokens."""

from __future__ import annotations

import torch

from tests.spec_decode.engine_utils import NGRAM, make_core, run
from tokenmill.plugin_api import LogitsProcessor
from tokenmill.sampling_params import SamplingParams

LOOP = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]


class BanAfterOutputs(LogitsProcessor):
    """Bans the token ``extra_args["ban"]`` once a request has ``extra_args["after"]`` outputs: a processor
    that depends on the outputs so far, which a draft position must see."""

    def apply(self, logits: torch.Tensor, batch) -> torch.Tensor:
        for row, (params, out) in enumerate(zip(batch.sampling_params, batch.output_token_ids)):
            args = params.extra_args or {}
            if "ban" in args and len(out) >= args["after"]:
                logits[row, args["ban"]] = float("-inf")
        return logits


def test_logits_processors_with_ngram_speculation_give_the_same_tokens(tiny_llama_dir: str) -> None:
    processors = [f"{__name__}:BanAfterOutputs"]
    plain = run(make_core(tiny_llama_dir, None), [("r", LOOP, SamplingParams(temperature=0, max_tokens=30,
                                                                           ignore_eos=True))]).tokens["r"]
    ban = plain[6]
    requests = [("banned", LOOP, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                extra_args={"ban": ban, "after": 4})),
                ("plain", LOOP, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))]
    expected = run(make_core(tiny_llama_dir, None, logits_processors=processors), requests)
    assert ban not in expected.tokens["banned"][4:] and expected.tokens["plain"] == plain
    spec = run(make_core(tiny_llama_dir, NGRAM, logits_processors=processors), requests)
    assert spec.tokens == expected.tokens
    assert spec.spec.num_draft_tokens > 0
