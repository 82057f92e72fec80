"""``/v1/responses``' wire format without a server: the response object and its event stream for any chunking."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
from test_openai_wire import ANSWER

from vlm_demo.cot.stages import split_thinking
from vlm_demo.results import GenerationResult
from vlm_demo.web.api.responses_wire import Events, Reply, thinking_and_answer

RESULT = GenerationResult(ANSWER, "stop", 1, 20, 60, 0.0, 0.1, 0.5)


def stream_in(pieces: list[str], result: GenerationResult = RESULT) -> tuple[list[dict], dict]:
    events, text = Events(Reply("tiny", {"store": True})), ""
    out = events.start()
    for piece in pieces:
        text += piece
        out += events.advance(text)
    last, body = events.finish(result)
    return out + last, body


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(ANSWER)), max_size=40))
def test_any_chunking_streams_each_stage_once_in_order_and_ends_with_the_whole_response(cuts: list[int]) -> None:
    bounds = sorted({0, len(ANSWER), *cuts})
    events, body = stream_in([ANSWER[a:b] for a, b in zip(bounds, bounds[1:])])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed" and events[-1]["response"] == body
    texts, answer = thinking_and_answer(ANSWER, final=True)
    stages = [
        "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta" and e["content_index"] == i)
        for i in range(3)
    ]
    summaries = [
        "".join(
            e["delta"]
            for e in events
            if e["type"] == "response.reasoning_summary_text.delta" and e["summary_index"] == i
        )
        for i in range(3)
    ]
    assert (
        stages
        == summaries
        == texts
        == ["I will find the colour.", "A plain green image; x < 5 and a <b> tag.", "Every part is green."]
    )
    assert (
        "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        == answer
        == "The image is green."
    )
    last_thought = max(i for i, k in enumerate(kinds) if k == "response.reasoning_text.delta")
    assert last_thought < kinds.index("response.output_item.done") < kinds.index("response.output_text.delta")
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1]
    assert kinds.count("response.output_item.done") == 2 and kinds.count("response.content_part.done") == 4


def test_the_response_object_holds_the_stages_the_conclusion_and_the_usage() -> None:
    body = Reply("tiny", {"instructions": None}).finished(RESULT)
    thinking, answer = split_thinking(ANSWER, final=True)
    assert body["object"] == "response" and body["status"] == "completed" and body["incomplete_details"] is None
    reasoning, message = body["output"]
    assert [p["text"] for p in reasoning["summary"]] == [p["text"] for p in reasoning["content"]]
    assert message["content"][0] == {
        "type": "output_text",
        "text": "The image is green.",
        "annotations": [],
        "logprobs": [],
    }
    assert body["usage"] == {
        "input_tokens": 20,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 60,
        "output_tokens_details": {"reasoning_tokens": round(60 * len(thinking) / (len(thinking) + len(answer)))},
        "total_tokens": 80,
    }


def test_an_answer_cut_by_the_token_limit_is_incomplete_and_a_failure_is_failed() -> None:
    cut = dataclasses.replace(RESULT, finish_reason="length")
    events, body = stream_in([ANSWER], cut)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["type"] == "response.incomplete" and body["output"][1]["status"] == "incomplete"
    no_conclusion = dataclasses.replace(RESULT, text=ANSWER.split("<CONCLUSION>")[0], finish_reason="length")
    events, body = stream_in([no_conclusion.text], no_conclusion)
    assert body["output"][1]["content"][0]["text"] == "" and len(body["output"][0]["content"]) == 3
    stream = Events(Reply("tiny", {}))
    stream.start()
    event, failed = stream.fail("engine_stopped", "The model is restarting.")
    assert event["type"] == "response.failed" and event["sequence_number"] == 3
    assert failed["status"] == "failed" and failed["error"] == {
        "code": "engine_stopped",
        "message": "The model is restarting.",
    }
