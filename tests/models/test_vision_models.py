"""Vision-language models against transformers on tiny random checkpoints: greedy tokens for a batch of prompts
with 0, 1 and 2 images of different sizes, with chunked prefill splitting image placeholders across steps and
prefix caching on; the same text with another image shares no block; an image split across chunks is encoded
once (docs/multimodal.md)."""

from __future__ import annotations

import pytest
import torch

from tests.models.vision_models import build_llava, random_image
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_llava(str(tmp_path_factory.mktemp("llava")))


@pytest.fixture(scope="module")
def llava(llava_dir: str):
    from tokenmill.entrypoints.llm import LLM

    # 6-token steps and 4-token blocks: every 16-token image placeholder spans several prefill chunks and blocks
    llm = LLM(llava_dir, dtype="float32", block_size=4, max_num_batched_tokens=6, num_gpu_blocks_override=256,
              enable_prefix_caching=True, limit_mm_per_prompt='{"image": 2}')
    yield llm
    llm.llm_engine.shutdown()


def hf_greedy(model_dir: str, cases: list[tuple[str, list]]) -> list[list[int]]:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for text, images in cases:
            inputs = processor(text=[text], images=images or None, return_tensors="pt")
            ids = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            out.append(ids[0, inputs["input_ids"].shape[1]:].tolist())
    return out


def _runner(llm):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner


def _inputs(cases: list[tuple[str, list]]) -> list[dict]:
    return [{"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}
            for text, images in cases]


def test_llava_greedy_matches_transformers(llava, llava_dir):
    red, wide, tall = random_image(1, 40, 30), random_image(2, 64, 20), random_image(3, 17, 45)
    cases = [
        ("a picture: <image> what does it show?", [red]),
        ("plain text, no image at all", []),
        ("<image> first, then <image> second; compare", [wide, tall]),
        ("a picture: <image> what does it show?", [tall]),  # the same text as the first, another image
    ]
    want = hf_greedy(llava_dir, cases)
    runner = _runner(llava)
    runs_before = runner.encoder_runner.num_encoder_runs
    first = llava.generate(_inputs(cases), GREEDY, use_tqdm=False)
    for i, out in enumerate(first):
        assert list(out.outputs[0].token_ids) == want[i], f"prompt {i}"
    assert len(first[0].prompt_token_ids) == len(first[3].prompt_token_ids) > 16  # the placeholder is expanded
    assert want[0] != want[3]  # the image matters to the answer
    # each distinct image once (`tall` is in two prompts), though every placeholder is split across chunks
    assert runner.encoder_runner.num_encoder_runs - runs_before == 3
    image_start = first[0].prompt_token_ids.index(llava.llm_engine.model_config.hf_config.image_token_index)
    assert first[3].num_cached_tokens <= image_start  # another image: nothing past its placeholder is shared

    again = llava.generate(_inputs(cases), GREEDY, use_tqdm=False)
    for i, out in enumerate(again):
        assert list(out.outputs[0].token_ids) == want[i], f"prompt {i} with prefix-cache hits"
    assert again[0].num_cached_tokens > image_start + 16  # the same image: its blocks are reused
    assert again[2].num_cached_tokens >= 32
    pool = llava.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_llava_chat_with_image_parts(llava, llava_dir):
    from tests.models.vision_models import CHAT_TEMPLATE, data_url

    image = random_image(4, 33, 33)
    messages = [{"role": "user", "content": [{"type": "text", "text": "describe "},
                                              {"type": "image_url", "image_url": {"url": data_url(image)}}]}]
    out = llava.chat(messages, GREEDY, use_tqdm=False)[0]
    want = hf_greedy(llava_dir, [("user: describe <image>\nassistant:", [image])])[0]
    assert "<image>" in CHAT_TEMPLATE and list(out.outputs[0].token_ids) == want


def test_llava_bad_image_inputs(llava):
    image = random_image(5, 28, 28)
    with pytest.raises(InvalidRequestError, match="limit of 2") as err:
        llava.generate({"prompt": "<image> <image> <image>", "multi_modal_data": {"image": [image] * 3}}, GREEDY,
                       use_tqdm=False)
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="processor") as err:
        llava.generate({"prompt": "no placeholder", "multi_modal_data": {"image": [image]}}, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="could not be decoded") as err:
        llava.chat([{"role": "user", "content": [{"type": "image_url",
                                                   "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
                   GREEDY, use_tqdm=False)
    assert err.value.param == "messages[0].content[0]"
    out = llava.generate("still serving", GREEDY, use_tqdm=False)  # the engine keeps working
    assert len(out[0].outputs[0].token_ids) == MAX_TOKENS
