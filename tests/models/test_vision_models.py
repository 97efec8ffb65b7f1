"""Vision-language models against transformers on tiny random checkpoints: greedy tokens for a batch of prompts
with 0, 1 and 2 images of different sizes, with chunked prefill splitting image placeholders across steps (for
Gemma 3, whose image tokens attend to each other both ways, chunking the prompts but never inside an image) and
prefix caching on; the same text with another image shares no block; an image split across chunks is encoded
once (docs/multimodal.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

from tests.models.vision_models import (
    build_gemma3,
    build_idefics3,
    build_llava,
    build_llava_next,
    build_qwen2_5_vl,
    build_qwen2_vl,
    data_url,
    random_image,
)
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@dataclass(frozen=True)
class VisionSpec:
    name: str
    build: Callable[[str], str]
    placeholder: str  # what a prompt holds once per image
    hf_class: str
    step_tokens: int = 5  # max_num_batched_tokens: image placeholders span several prefill chunks


SPECS = [
    VisionSpec("llava", build_llava, "<image>", "LlavaForConditionalGeneration"),
    # any-resolution tiles: images of different sizes take different token counts
    VisionSpec("llava_next", build_llava_next, "<image>", "LlavaNextForConditionalGeneration", step_tokens=16),
    VisionSpec("qwen2_vl", build_qwen2_vl, "<|vision_start|><|image_pad|><|vision_end|>",
               "Qwen2VLForConditionalGeneration"),
    VisionSpec("qwen2_5_vl", build_qwen2_5_vl, "<|vision_start|><|image_pad|><|vision_end|>",
               "Qwen2_5_VLForConditionalGeneration"),
    # images split into tiles: text tokens between an image's runs of <image> tokens (PlaceholderRange.is_embed)
    VisionSpec("idefics3", build_idefics3, "<image>", "Idefics3ForConditionalGeneration"),
    # bidirectional attention among an image's 9 tokens: prompts are chunked, but never inside an image
    VisionSpec("gemma3", build_gemma3, "<start_of_image>", "Gemma3ForConditionalGeneration", step_tokens=12),
]


@pytest.fixture(scope="module", params=SPECS, ids=[s.name for s in SPECS])
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from tokenmill.entrypoints.llm import LLM

    spec: VisionSpec = request.param
    model_dir = spec.build(str(tmp_path_factory.mktemp(spec.name)))
    # small steps and 4-token blocks: prompts (and, but for Gemma 3, image placeholders) span several prefill
    # chunks and blocks
    llm = LLM(model_dir, dtype="float32", block_size=4, max_num_batched_tokens=spec.step_tokens,
              num_gpu_blocks_override=256,
              enable_prefix_caching=True, limit_mm_per_prompt='{"image": 2}')
    yield spec, model_dir, llm
    llm.llm_engine.shutdown()


def hf_greedy(spec: VisionSpec, model_dir: str, llm: Any, cases: list[tuple[str, list]],
              causal_only: bool = False, processor_kwargs: dict | None = None) -> list[list[int]]:
    """transformers' greedy tokens, its inputs made by the model's processor (transformers' own processor class
    for Llava, Idefics3 and Gemma 3; for Qwen2-VL, whose processor class needs torchvision, the engine's
    equivalent of it). ``causal_only``: without Gemma 3's ``token_type_ids`` (no bidirectional image
    attention); ``processor_kwargs`` go to every processor call."""
    import transformers

    processor = llm.llm_engine.input_processor.mm_processor.processor()
    processor = getattr(processor, "hf_processor", processor)  # Idefics3: transformers' own processor
    model = getattr(transformers, spec.hf_class).from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for text, images in cases:
            inputs = dict(processor(text=[text], images=images or None, return_tensors="pt",
                                    **(processor_kwargs or {})))
            inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
            if causal_only:
                inputs.pop("token_type_ids")
            if spec.name.startswith("qwen"):
                inputs["mm_token_type_ids"] = (inputs["input_ids"] == model.config.image_token_id).int()
            ids = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            out.append(ids[0, inputs["input_ids"].shape[1]:].tolist())
    return out


def _runner(llm):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner


def _record_chunk_ends(llm: Any) -> list[tuple[int, int, list]]:
    """From now on, ``(tokens computed after the step, prompt length, images)`` of every request each step (until
    ``del`` of the scheduler's ``schedule`` attribute)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule, ends = scheduler.schedule, []

    def recording():
        so = schedule()
        for req_id in so.num_scheduled_tokens:
            request = scheduler.requests[req_id]
            ends.append((request.num_computed_tokens, request.num_prompt_tokens, list(request.mm_features)))
        return so

    scheduler.schedule = recording
    return ends


def _inputs(cases: list[tuple[str, list]]) -> list[dict]:
    return [{"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}
            for text, images in cases]


def test_greedy_matches_transformers(vlm):
    spec, model_dir, llm = vlm
    p = spec.placeholder
    red, wide, tall = random_image(1, 40, 30), random_image(2, 64, 20), random_image(3, 17, 45)
    cases = [
        (f"a picture: {p} what does it show?", [red]),
        ("plain text, no image at all", []),
        (f"{p} first, then {p} second; compare", [wide, tall]),
        (f"a picture: {p} what does it show?", [tall]),  # the same text as the first, another image
    ]
    want = hf_greedy(spec, model_dir, llm, cases)
    runner = _runner(llm)
    runs_before = runner.encoder_runner.num_encoder_runs
    chunk_ends = _record_chunk_ends(llm)
    first = llm.generate(_inputs(cases), GREEDY, use_tqdm=False)
    del llm.llm_engine.engine_core.engine_core.scheduler.schedule
    for i, out in enumerate(first):
        assert list(out.outputs[0].token_ids) == want[i], f"prompt {i}"
    assert want[0] != want[3]  # the image matters to the answer
    # each distinct image once (`tall` is in two prompts), though placeholders are split across chunks
    assert runner.encoder_runner.num_encoder_runs - runs_before == 3
    image_id = type(runner.model).get_image_token_id(llm.llm_engine.model_config.hf_config)
    image_start = first[0].prompt_token_ids.index(image_id)
    image_len = first[0].prompt_token_ids.count(image_id)
    prompt_chunk_ends = [(end, features) for end, prompt_len, features in chunk_ends if end < prompt_len]
    assert len(prompt_chunk_ends) > len(cases)  # prompts are chunked
    split_images = [end for end, features in prompt_chunk_ends
                    if any(f.placeholder.offset < end < f.placeholder.end for f in features)]
    if spec.name == "gemma3":
        assert image_len == 9
        assert not split_images  # a chunk never ends inside an image (bidirectional attention among its tokens)
        assert hf_greedy(spec, model_dir, llm, cases[:1], causal_only=True) != want[:1]  # the mask matters
    else:
        assert image_len > spec.step_tokens and split_images  # longer than a step: split across chunks
    if spec.name == "idefics3":
        assert image_len == 5 * 16  # image splitting on: 2x2 tiles of 16 tokens and the global image
    assert first[3].num_cached_tokens <= image_start  # another image: nothing past its placeholder is shared

    again = llm.generate(_inputs(cases), GREEDY, use_tqdm=False)
    for i, out in enumerate(again):
        assert list(out.outputs[0].token_ids) == want[i], f"prompt {i} with prefix-cache hits"
    assert again[0].num_cached_tokens >= image_start + image_len  # the same image: its blocks are reused
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_chat_with_image_parts(vlm):
    spec, model_dir, llm = vlm
    image = random_image(4, 33, 47)
    content = [{"type": "text", "text": "describe "}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
    out = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "describe "},
                                                                       {"type": "image"}]}],
                                         tokenize=False, add_generation_prompt=True)
    assert spec.placeholder in text
    assert list(out.outputs[0].token_ids) == hf_greedy(spec, model_dir, llm, [(text, [image])])[0]


def test_bad_image_inputs(vlm):
    spec, _, llm = vlm
    image, p = random_image(5, 28, 28), spec.placeholder
    with pytest.raises(InvalidRequestError, match="limit of 2") as err:
        llm.generate({"prompt": f"{p} {p} {p}", "multi_modal_data": {"image": [image] * 3}}, GREEDY, use_tqdm=False)
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="processor"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": [image]}}, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="could not be decoded") as err:
        llm.chat([{"role": "user", "content": [{"type": "image_url",
                                                 "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
                 GREEDY, use_tqdm=False)
    assert err.value.param == "messages[0].content[0]"
    out = llm.generate("still serving", GREEDY, use_tqdm=False)  # the engine keeps working
    assert len(out[0].outputs[0].token_ids) == MAX_TOKENS


def test_preempted_image_requests_resume_correctly(vlm, tmp_path_factory):
    """A cache too small for all prompts at once: requests are preempted and recomputed (their images encoded
    again or served from the encoder cache; M-RoPE positions of generated tokens rebuilt) and answer as before.
    Run for Qwen2-VL only (M-RoPE is the part a resumed request could get wrong; the others share the path)."""
    from tokenmill.entrypoints.llm import LLM

    spec, model_dir, llm = vlm
    if spec.name != "qwen2_vl":
        pytest.skip("covered by the qwen2_vl case")
    inputs = [{"prompt": f"look {spec.placeholder} what? tell me", "multi_modal_data": {"image": random_image(i, 56, 56)}}
              for i in range(4)]
    want = [list(o.outputs[0].token_ids) for o in llm.generate(inputs, GREEDY, use_tqdm=False)]
    small = LLM(model_dir, dtype="float32", block_size=4, max_num_batched_tokens=8, num_gpu_blocks_override=16)
    scheduler = small.llm_engine.engine_core.engine_core.scheduler
    preempt, preempted = scheduler._preempt, []
    scheduler._preempt = lambda request: (preempted.append(request.request_id), preempt(request))[1]
    got = small.generate(inputs, GREEDY, use_tqdm=False)
    small.llm_engine.shutdown()
    assert preempted
    assert [list(o.outputs[0].token_ids) for o in got] == want


def test_pan_and_scan_crops(vlm):
    """Gemma 3's pan-and-scan: a wide image becomes its original and 4 crops, each a run of image tokens with text
    between them (each run bidirectional on its own, chunks may end between runs); a square one gets no crops."""
    spec, model_dir, llm = vlm
    if spec.name != "gemma3":
        pytest.skip("Gemma 3's processor option")
    crops = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 10}
    text, images = f"wide {spec.placeholder} and square {spec.placeholder}", [random_image(6, 120, 30),
                                                                               random_image(7, 30, 30)]
    want = hf_greedy(spec, model_dir, llm, [(text, images)], processor_kwargs=crops)[0]
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}, "mm_processor_kwargs": crops}, GREEDY,
                       use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == want
    image_id = type(_runner(llm).model).get_image_token_id(llm.llm_engine.model_config.hf_config)
    assert out.prompt_token_ids.count(image_id) == (1 + 4 + 1) * 9
