"""The scheduler's side of image inputs, without a model: which steps encode which images (once per image,
within the encoder budget, chunks stopping before an image that does not fit), encoder-cache references and
eviction, and image hashes in prefix-cache block hashes (docs/multimodal.md)."""

from __future__ import annotations

from tests.core.test_scheduler import fake_run, make_request, make_scheduler
from tokenmill.config import MultiModalConfig
from tokenmill.multimodal.inputs import MultiModalFeature, PlaceholderRange

IMG = 9  # the placeholder token id of these tests


def image(mm_hash: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature("image", mm_hash, PlaceholderRange(offset, length), {})


def image_request(prompt_len: int, images: list[MultiModalFeature], rid: str | None = None, max_tokens: int = 2):
    prompt = [1] * prompt_len
    for f in images:
        prompt[f.placeholder.offset : f.placeholder.end] = [IMG] * f.placeholder.length
    request = make_request(prompt, max_tokens=max_tokens, rid=rid)
    request.mm_features = images
    return request


def run_to_end(sched, steps: list) -> None:
    while sched.has_unfinished_requests():
        so = sched.schedule()
        steps.append(so)
        sched.update_from_output(so, fake_run(sched, so))


def test_a_chunked_image_is_encoded_once_and_released():
    sched = make_scheduler(budget=8, block_size=4)
    request = image_request(30, [image("a", 4, 12)], rid="r")
    sched.add_request(request)
    steps: list = []
    run_to_end(sched, steps)
    encoded = [so.scheduled_encoder_inputs for so in steps if so.scheduled_encoder_inputs]
    assert encoded == [{"r": [0]}]  # its 12 placeholder tokens span two 8-token chunks
    manager = sched.encoder_cache_manager
    assert manager.refs["a"] == set() and "a" in manager.freeable  # still cached for a later request
    again = image_request(30, [image("a", 4, 12)], rid="again")
    sched.add_request(again)
    steps = []
    run_to_end(sched, steps)
    assert not any(so.scheduled_encoder_inputs for so in steps)  # served from the encoder cache


def test_chunk_stops_before_an_image_over_the_encoder_budget():
    sched = make_scheduler(budget=16)
    sched.encoder_cache_manager.cache_size = 10  # per-step budget: one 6-row image, not two
    sched.encoder_cache_manager.num_free_rows = 10
    request = image_request(20, [image("a", 2, 6), image("b", 10, 6)], rid="r")
    sched.add_request(request)
    first = sched.schedule()
    assert first.scheduled_encoder_inputs == {"r": [0]}
    assert first.num_scheduled_tokens["r"] == 10  # up to image b's placeholder
    sched.update_from_output(first, fake_run(sched, first))
    second = sched.schedule()
    assert second.scheduled_encoder_inputs == {"r": [1]}
    assert second.free_encoder_mm_hashes == ["a"]  # a's rows were needed for b
    sched.update_from_output(second, fake_run(sched, second))


def test_the_same_image_in_two_requests_of_one_step_is_encoded_once():
    sched = make_scheduler(budget=64, caching=False)
    sched.add_request(image_request(12, [image("x", 2, 6)], rid="p"))
    sched.add_request(image_request(14, [image("x", 4, 6)], rid="q"))
    so = sched.schedule()
    assert so.scheduled_encoder_inputs == {"p": [0]}
    # both placeholders are computed in this step, so neither request holds the entry afterwards
    assert sched.encoder_cache_manager.refs["x"] == set() and "x" in sched.encoder_cache_manager.freeable


def test_block_hashes_depend_on_the_images():
    sched = make_scheduler(block_size=4)
    kv = sched.kv_cache_manager
    a, b, c = (image_request(12, [image(h, 4, 4)]) for h in ("one", "two", "one"))
    for r in (a, b, c):
        kv._update_block_hashes(r)
    assert a.block_hashes[0] == b.block_hashes[0]  # text before the image: shared
    assert a.block_hashes[1] != b.block_hashes[1] and a.block_hashes[2] != b.block_hashes[2]
    assert a.block_hashes == c.block_hashes


def test_an_image_larger_than_the_encoder_cache_is_refused():
    import pytest

    from tokenmill.errors import InvalidRequestError

    sched = make_scheduler()
    sched.encoder_cache_manager.cache_size = 8
    with pytest.raises(InvalidRequestError, match="encoder cache"):
        sched.add_request(image_request(20, [image("big", 2, 9)]))
    assert MultiModalConfig().encoder_cache_size == 0


def test_encoder_room_is_given_back_when_the_chunk_gets_no_kv_blocks():
    sched = make_scheduler(num_blocks=6, block_size=4, budget=32, caching=False)
    sched.add_request(make_request([1] * 16, max_tokens=2, rid="text"))
    sched.add_request(image_request(12, [image("img", 2, 6)], rid="pic"))
    first = sched.schedule()
    assert list(first.num_scheduled_tokens) == ["text"]  # no blocks left for "pic"
    assert "img" not in sched.encoder_cache_manager.sizes  # its encoder room was given back, not leaked
    assert sched.encoder_cache_manager.num_free_rows == sched.encoder_cache_manager.cache_size
    sched.update_from_output(first, fake_run(sched, first))
    steps = [first]
    run_to_end(sched, steps)
    assert [so.scheduled_encoder_inputs for so in steps if so.scheduled_encoder_inputs] == [{"pic": [0]}]


def test_an_image_with_text_among_its_tokens_costs_only_its_embedding_rows():
    """vLLM's ``is_embed``: a 12-token range of which 8 positions take rows (Idefics3-style tiles with text
    between them) needs 8 rows of encoder budget and cache, not 12."""
    sched = make_scheduler(budget=16)
    sched.encoder_cache_manager.cache_size = 8
    sched.encoder_cache_manager.num_free_rows = 8
    mask = (True,) * 4 + (False,) * 4 + (True,) * 4
    feature = MultiModalFeature("image", "tiles", PlaceholderRange(2, 12, mask), {})
    request = image_request(20, [feature], rid="r")
    sched.add_request(request)
    first = sched.schedule()
    assert first.scheduled_encoder_inputs == {"r": [0]}
    assert first.num_scheduled_tokens["r"] == 16
    assert sched.encoder_cache_manager.num_free_rows == 0


def prefix_lm_scheduler(**kw):
    """A scheduler for a multimodal prefix-LM (Gemma 3: bidirectional attention among an image's tokens)."""
    sched = make_scheduler(**kw)
    sched.mm_prefix_lm = True
    return sched


def chunk_ends(steps: list, rid: str) -> list[int]:
    """Tokens of request ``rid`` computed after each step."""
    ends, done = [], 0
    for so in steps:
        done += so.num_scheduled_tokens.get(rid, 0)
        ends.append(done)
    return ends


def test_a_prefix_lm_chunk_never_ends_inside_an_image():
    sched = prefix_lm_scheduler(budget=8, block_size=4)
    sched.add_request(image_request(24, [image("a", 5, 6), image("b", 12, 7)], rid="r"))
    steps: list = []
    run_to_end(sched, steps)
    ends = chunk_ends(steps, "r")
    # 8-token steps would end at 8 (inside a) and 16 (inside b): the chunks stop before each image instead
    assert ends[:4] == [5, 12, 20, 24]
    assert [so.scheduled_encoder_inputs for so in steps if so.scheduled_encoder_inputs] == [{"r": [0]}, {"r": [1]}]


def test_a_prefix_cache_hit_inside_an_image_is_followed_by_the_rest_of_the_image_in_one_chunk():
    sched = prefix_lm_scheduler(budget=8, block_size=4)
    sched.add_request(image_request(16, [image("a", 5, 6)], rid="first"))
    run_to_end(sched, [])
    again = image_request(16, [image("a", 5, 6)], rid="again")
    again.prompt_token_ids[11] = again.all_token_ids[11] = 3  # the same first two blocks, then other text
    sched.add_request(again)
    so = sched.schedule()
    assert again.num_cached_tokens == 8  # the hit ends inside the image (positions 5..10)
    assert so.num_scheduled_tokens["again"] == 8  # positions 8..15 in one chunk: the image's rest included
    # with room for less than the image's rest, such a chunk waits rather than split it
    late = image_request(16, [image("b", 5, 6)], rid="late")
    assert sched._schedule_encoder_inputs(late, 8, 2, 100)[1] == 0
    assert sched._schedule_encoder_inputs(late, 8, 3, 100)[1] == 3


def test_a_prefix_lm_image_longer_than_a_step_is_refused():
    import pytest

    from tokenmill.errors import InvalidRequestError

    sched = prefix_lm_scheduler(budget=8, threshold=6)
    with pytest.raises(InvalidRequestError, match="one step") as err:
        sched.add_request(image_request(20, [image("big", 2, 7)]))
    assert err.value.param == "prompt"
    sched.add_request(image_request(20, [image("fits", 2, 6)]))  # within the 6-token prefill threshold


def test_a_prefix_lm_chunk_may_end_between_the_runs_of_one_image():
    """An image of several runs (Gemma 3's pan-and-scan crops, text between them): each run is one block of
    bidirectional attention, so a chunk may end between runs, never inside one; a run longer than a step is
    refused, the whole image need not fit."""
    sched = prefix_lm_scheduler(budget=8, block_size=4)
    mask = (True,) * 6 + (False,) * 3 + (True,) * 4
    feature = MultiModalFeature("image", "crops", PlaceholderRange(3, 13, mask), {})
    sched.add_request(image_request(20, [feature], rid="r"))
    steps: list = []
    run_to_end(sched, steps)
    ends = chunk_ends(steps, "r")
    # runs at 3..8 and 12..15: 8 would split the first; 3 + 8 = 11 lies between the runs
    assert ends[:4] == [3, 11, 19, 20]
    assert [so.scheduled_encoder_inputs for so in steps if so.scheduled_encoder_inputs] == [{"r": [0]}]
