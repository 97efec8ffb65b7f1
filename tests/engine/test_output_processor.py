"""OutputProcessor: stop strings, output kinds, n > 1 merging, errors, aborts, logprobs, metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.engine.engine_fakes import byte_level_tokenizer, make_config
from tokenmill.engine.input_processor import InputProcessor, RequestInput
from tokenmill.engine.messages import EngineCoreOutput, FinishReason
from tokenmill.engine.output_processor import (
    OutputProcessor,
    OutputProcessorResult,
    RequestOutputCollector,
)
from tokenmill.errors import EngineDeadError, EngineGenerateError
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

EOS = 2
CUM, DELTA, FINAL = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


@pytest.fixture(scope="module")
def tok() -> Any:
    return byte_level_tokenizer()


def add(tok: Any, params: SamplingParams, request_id: str = "r", queue: RequestOutputCollector | None = None,
        prompt: str = "Hello") -> tuple[OutputProcessor, list[str]]:
    processor = OutputProcessor(tok)
    processed = InputProcessor(make_config().model_config, tok).process(
        RequestInput(request_id=request_id, prompt=prompt, params=params))
    processor.add_request(processed, queue)
    return processor, [r.request_id for r in processed.engine_requests]


def step(processor: OutputProcessor, engine_id: str, token: int, finish: FinishReason | None = None,
         **kwargs: Any) -> OutputProcessorResult:
    return processor.process_outputs([EngineCoreOutput(engine_id, [token], finish_reason=finish, **kwargs)])


def run(tok: Any, text: str, params: SamplingParams, finish: FinishReason = FinishReason.LENGTH,
        extra: list[int] | None = None) -> tuple[list[RequestOutput], list[list[str]]]:
    """Feed ``text`` (plus ``extra`` ids) one token per step; the last step carries ``finish``.

    Returns every RequestOutput and, per step, the engine ids to abort. Stops feeding once the request
    finished on the front end.
    """
    processor, (engine_id,) = add(tok, params)
    ids = tok.encode(text, add_special_tokens=False) + (extra or [])
    outputs, aborts = [], []
    for i, token in enumerate(ids):
        result = step(processor, engine_id, token, finish if i == len(ids) - 1 else None)
        outputs += result.request_outputs
        aborts.append(result.reqs_to_abort)
        if outputs and outputs[-1].finished:
            break
    assert not processor.has_unfinished_requests()
    return outputs, aborts


STOP_TEXT = "The quick brown fox STOP jumps"


@pytest.mark.parametrize("kind", [CUM, DELTA])
@pytest.mark.parametrize(("stop", "kept"), [("STOP", "The quick brown fox "), ("own fox STOP", "The quick br")])
def test_stop_string_is_cut_and_never_streamed(tok: Any, kind: RequestOutputKind, stop: str, kept: str) -> None:
    outputs, aborts = run(tok, STOP_TEXT, SamplingParams(max_tokens=100, stop=[stop], output_kind=kind))
    texts = [o.outputs[0].text for o in outputs]
    streamed = "".join(texts) if kind == DELTA else texts[-1]
    assert streamed == kept
    if kind == CUM:
        assert all(kept.startswith(t) for t in texts)  # nothing past the cut was ever shown
    final = outputs[-1].outputs[0]
    assert outputs[-1].finished and final.finish_reason == "stop" and final.stop_reason == stop
    assert aborts[-1] == ["r"] and not any(aborts[:-1])


def test_stop_string_spanning_tokens_and_false_start(tok: Any) -> None:
    params = SamplingParams(max_tokens=100, stop=["fox STOP"], output_kind=DELTA)
    outputs, _ = run(tok, "a fox jumps, the fox STOP jumps", params)
    texts = [o.outputs[0].text for o in outputs]
    assert "".join(texts) == "a fox jumps, the "
    # "fox" was held back while it could start the stop string, then released with " jumps".
    assert not any(t.endswith("fox") for t in texts)


def test_include_stop_str_in_output(tok: Any) -> None:
    params = SamplingParams(max_tokens=100, stop=["STOP"], include_stop_str_in_output=True)
    outputs, _ = run(tok, STOP_TEXT, params)
    assert outputs[-1].outputs[0].text == "The quick brown fox STOP"


def test_earliest_of_several_stop_strings_wins(tok: Any) -> None:
    params = SamplingParams(max_tokens=100, stop=["jumps", "brown"])
    outputs, _ = run(tok, STOP_TEXT, params)
    assert outputs[-1].outputs[0].text == "The quick "
    assert outputs[-1].outputs[0].stop_reason == "brown"


def test_stop_strings_ignored_until_min_tokens(tok: Any) -> None:
    params = SamplingParams(max_tokens=100, stop=["The", "fox"], min_tokens=1)
    outputs, _ = run(tok, STOP_TEXT, params)
    assert outputs[-1].outputs[0].text == "The quick brown "


def test_held_text_released_when_engine_finishes(tok: Any) -> None:
    outputs, aborts = run(tok, "The quick ST", SamplingParams(max_tokens=100, stop=["STOP"]))
    final = outputs[-1].outputs[0]
    assert final.text == "The quick ST" and final.finish_reason == "length" and final.stop_reason is None
    assert not any(aborts)


def test_eos_is_in_token_ids_but_not_text(tok: Any) -> None:
    outputs, _ = run(tok, "Hello world", SamplingParams(skip_special_tokens=False), FinishReason.STOP, extra=[EOS])
    final = outputs[-1].outputs[0]
    assert final.text == "Hello world" and final.token_ids[-1] == EOS and final.finish_reason == "stop"


def test_output_kinds(tok: Any) -> None:
    text = "naïve café 🎉 done"
    ids = tok.encode(text, add_special_tokens=False)
    cum, _ = run(tok, text, SamplingParams(max_tokens=100, output_kind=CUM))
    delta, _ = run(tok, text, SamplingParams(max_tokens=100, output_kind=DELTA))
    final, _ = run(tok, text, SamplingParams(max_tokens=100, output_kind=FINAL))
    assert len(cum) == len(delta) == len(ids) and len(final) == 1
    assert [len(o.outputs[0].token_ids) for o in cum] == list(range(1, len(ids) + 1))
    assert all(len(o.outputs[0].token_ids) == 1 for o in delta)
    assert cum[-1].outputs[0].text == "".join(o.outputs[0].text for o in delta) == final[0].outputs[0].text == text
    assert [t for o in delta for t in o.outputs[0].token_ids] == cum[-1].outputs[0].token_ids == ids
    assert [o.finished for o in cum] == [False] * (len(ids) - 1) + [True]
    assert final[0].finished and final[0].outputs[0].finish_reason == "length"


def test_n_children_are_merged(tok: Any) -> None:
    params = SamplingParams(n=2, seed=7, max_tokens=3, output_kind=CUM)
    processor, engine_ids = add(tok, params, "p")
    assert engine_ids == ["0_p", "1_p"]
    a, b = tok.encode("ab", add_special_tokens=False), tok.encode("xy", add_special_tokens=False)
    out = processor.process_outputs([EngineCoreOutput("0_p", [a[0]]), EngineCoreOutput("1_p", [b[0]])])
    (ro,) = out.request_outputs
    assert ro.request_id == "p" and [c.index for c in ro.outputs] == [0, 1] and not ro.finished
    out = processor.process_outputs([EngineCoreOutput("1_p", [b[1]], finish_reason=FinishReason.LENGTH)])
    (ro,) = out.request_outputs
    assert [c.text for c in ro.outputs] == ["a", "xy"] and [c.finish_reason for c in ro.outputs] == [None, "length"]
    assert not ro.finished
    out = processor.process_outputs([EngineCoreOutput("0_p", [a[1]], finish_reason=FinishReason.LENGTH)])
    (ro,) = out.request_outputs
    assert ro.finished and [c.text for c in ro.outputs] == ["ab", "xy"]
    assert not processor.has_unfinished_requests()


def test_n_children_delta_and_final_only(tok: Any) -> None:
    processor, _ = add(tok, SamplingParams(n=2, max_tokens=3, output_kind=DELTA), "d")
    (ro,) = processor.process_outputs([EngineCoreOutput("1_d", [40])]).request_outputs
    assert [c.index for c in ro.outputs] == [1]  # only the sequence that changed
    processor, _ = add(tok, SamplingParams(n=2, max_tokens=3, output_kind=FINAL), "f")
    done = FinishReason.LENGTH
    assert processor.process_outputs([EngineCoreOutput("0_f", [40], finish_reason=done)]).request_outputs == []
    (ro,) = processor.process_outputs([EngineCoreOutput("1_f", [41], finish_reason=done)]).request_outputs
    assert ro.finished and len(ro.outputs) == 2


def test_child_stop_string_aborts_only_that_child(tok: Any) -> None:
    processor, _ = add(tok, SamplingParams(n=2, max_tokens=50, stop=["!"]), "s")
    bang = tok.encode("!", add_special_tokens=False)[0]
    result = processor.process_outputs([EngineCoreOutput("0_s", [bang]), EngineCoreOutput("1_s", [40])])
    assert result.reqs_to_abort == ["0_s"]
    (ro,) = result.request_outputs
    assert [c.finish_reason for c in ro.outputs] == ["stop", None] and not ro.finished
    assert processor.process_outputs([EngineCoreOutput("0_s", [40])]).request_outputs == []  # late output ignored


def test_engine_error_sync_path(tok: Any) -> None:
    processor, _ = add(tok, SamplingParams(n=2, max_tokens=5), "e")
    result = processor.process_outputs(
        [EngineCoreOutput("0_e", [], finish_reason=FinishReason.ERROR, error="too long for the KV cache")]
    )
    assert result.reqs_to_abort == ["1_e"]
    (ro,) = result.request_outputs
    assert ro.finished and ro.outputs[0].finish_reason == "error"
    assert ro.outputs[0].stop_reason == "too long for the KV cache"
    assert not processor.has_unfinished_requests()


def test_engine_error_and_dead_engine_raise_in_consumer(tok: Any) -> None:
    async def main() -> None:
        queue = RequestOutputCollector(CUM)
        processor, _ = add(tok, SamplingParams(), "e", queue)
        processor.process_outputs([EngineCoreOutput("e", [], finish_reason=FinishReason.ERROR, error="boom")])
        with pytest.raises(EngineGenerateError, match="boom"):
            await queue.get()
        queue = RequestOutputCollector(CUM)
        processor.add_request(
            InputProcessor(make_config().model_config, tok).process(
                RequestInput(request_id="x", prompt="Hi", params=SamplingParams())), queue
        )
        processor.propagate_error(EngineDeadError("dead"))
        with pytest.raises(EngineDeadError):
            await queue.get()
        assert not processor.has_unfinished_requests()

    asyncio.run(main())


def test_abort_returns_engine_ids_and_finishes_the_stream(tok: Any) -> None:
    queue = RequestOutputCollector(DELTA)
    processor, _ = add(tok, SamplingParams(n=3), "a", queue)
    assert processor.abort_requests(["a", "unknown"]) == ["0_a", "1_a", "2_a"]
    out = queue.get_nowait()
    assert out is not None and out.finished and {c.finish_reason for c in out.outputs} == {"abort"}
    assert not processor.has_unfinished_requests()


def test_collector_merges_deltas(tok: Any) -> None:
    queue = RequestOutputCollector(DELTA)
    processor, (engine_id,) = add(tok, SamplingParams(max_tokens=10, output_kind=DELTA), "m", queue)
    for token in tok.encode("Hello world", add_special_tokens=False):
        step(processor, engine_id, token)
    merged = queue.get_nowait()
    assert merged is not None and merged.outputs[0].text == "Hello world"
    assert queue.get_nowait() is None


def test_logprobs(tok: Any) -> None:
    processor, (engine_id,) = add(tok, SamplingParams(logprobs=2, max_tokens=2), "l")
    first = processor.process_outputs(
        [EngineCoreOutput(engine_id, [40], new_logprobs=[([40, 41, 40], [-0.5, -0.1, -0.5], 2)])]
    ).request_outputs[0]
    (entry,) = first.outputs[0].logprobs
    assert set(entry) == {40, 41} and entry[40].rank == 2 and entry[41].rank == 1
    assert entry[40].decoded_token == tok.decode([40])
    second = processor.process_outputs(
        [EngineCoreOutput(engine_id, [41], FinishReason.LENGTH, new_logprobs=[([41], [-1.0], 1)])]
    ).request_outputs[0]
    assert second.outputs[0].cumulative_logprob == pytest.approx(-1.5)
    assert len(second.outputs[0].logprobs) == 2


def test_metrics_and_cached_tokens(tok: Any) -> None:
    processor, (engine_id,) = add(tok, SamplingParams(max_tokens=2), "t")
    processor.process_outputs([EngineCoreOutput(engine_id, [40], num_cached_tokens=16)], now=100.0)
    (ro,) = processor.process_outputs(
        [EngineCoreOutput(engine_id, [41], finish_reason=FinishReason.LENGTH)], now=101.0
    ).request_outputs
    assert ro.num_cached_tokens == 16 and ro.prompt == "Hello" and ro.prompt_token_ids
    assert ro.metrics is not None
    assert (ro.metrics.first_token_time, ro.metrics.last_token_time, ro.metrics.finished_time) == (100.0, 101.0, 101.0)
    assert ro.metrics.arrival_time > 0


def test_duplicate_request_id_rejected(tok: Any) -> None:
    processor, _ = add(tok, SamplingParams(), "dup")
    processed = InputProcessor(make_config().model_config, tok).process(
        RequestInput(request_id="dup", prompt="Hi", params=SamplingParams()))
    with pytest.raises(ValueError, match="already in flight"):
        processor.add_request(processed)


def test_prompt_logprobs(tok: Any) -> None:
    for kind in (CUM, DELTA):
        processor, (engine_id,) = add(tok, SamplingParams(prompt_logprobs=1, max_tokens=2, output_kind=kind), "p")
        first = processor.process_outputs(
            [EngineCoreOutput(engine_id, [40], prompt_logprobs=[([41], [-0.25], 3)])]
        ).request_outputs[0]
        assert first.prompt_logprobs is not None and first.prompt_logprobs[0] is None
        assert first.prompt_logprobs[1][41].rank == 3 and first.prompt_logprobs[1][41].logprob == -0.25
        (second,) = processor.process_outputs(
            [EngineCoreOutput(engine_id, [41], finish_reason=FinishReason.LENGTH)]
        ).request_outputs
        assert (second.prompt_logprobs is None) == (kind == DELTA)  # DELTA sends them once
