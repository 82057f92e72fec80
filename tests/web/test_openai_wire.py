"""The API's wire format without a server: the thinking/answer split while streaming, and errors' statuses."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlm_demo import errors
from vlm_demo.cot.stages import split_thinking
from vlm_demo.web.api.openai_wire import APIError, ThinkingSplitter

ANSWER = (
    "<SUMMARY> I will find the colour. </SUMMARY>\n\n<CAPTION> A plain green image; x < 5 and a <b> tag. </CAPTION>"
    "\n\n<REASONING> Every part is green. </REASONING>\n\n<CONCLUSION> The image is green. </CONCLUSION>"
)
PARTIAL_TAG = re.compile(r"<\s*/?\s*(S|SU|SUM|SUMM|SUMMA|SUMMAR|SUMMARY|C|CA|CO|R|RE|REA|CON|CONC|CONCL|/)?\s*$", re.I)


def stream_in(pieces: list[str]) -> tuple[list[str], list[str]]:
    """What a client receives when the answer arrives in these pieces (then the final flush)."""
    splitter, reasoning, content, text = ThinkingSplitter(), [], [], ""
    for piece in pieces:
        text += piece
        new_reasoning, new_content = splitter.advance(text)
        reasoning.append(new_reasoning)
        content.append(new_content)
        assert not PARTIAL_TAG.search("".join(reasoning)), f"half a tag sent after {text[-15:]!r}"
    new_reasoning, new_content = splitter.advance(text, final=True)
    return reasoning + [new_reasoning], content + [new_content]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(ANSWER)), max_size=40))
def test_any_chunking_streams_each_character_once_and_adds_up_to_the_whole_split(cuts: list[int]) -> None:
    bounds = sorted({0, len(ANSWER), *cuts})
    reasoning, content = stream_in([ANSWER[a:b] for a, b in zip(bounds, bounds[1:])])
    whole_reasoning, whole_content = split_thinking(ANSWER, final=True)
    assert "".join(reasoning) == whole_reasoning and "".join(content) == whole_content
    assert whole_content == "The image is green."
    assert whole_reasoning.endswith("</REASONING>") and "x < 5 and a <b> tag" in whole_reasoning
    first_content = next(i for i, piece in enumerate(content) if piece)
    assert not any(reasoning[first_content + 1 :]), "stage text came after the answer had begun"


def test_character_by_character_the_reasoning_waits_for_a_tag_to_be_complete() -> None:
    reasoning, _ = stream_in(list(ANSWER))
    sent = ""
    for piece in reasoning:
        sent += piece
        assert not sent.endswith(("<", "<S", "<SUMM", "</SUMMARY", "<CON")), sent[-12:]
    assert sent == split_thinking(ANSWER, final=True)[0]


def test_an_answer_cut_before_its_conclusion_is_all_reasoning_and_the_half_tag_is_flushed_at_the_end() -> None:
    cut = ANSWER[: ANSWER.index("<CONCLUSION>") + 5]  # "...</REASONING>\n\n<CONC"
    reasoning, content = stream_in([cut])
    assert "".join(content) == "" and "".join(reasoning).endswith("</REASONING>\n\n<CONC")
    assert reasoning[0].endswith("</REASONING>"), "the half tag was sent before the end"


def test_a_part_that_stops_extending_what_was_sent_sends_nothing_more() -> None:
    splitter = ThinkingSplitter()
    assert splitter.advance("<SUMMARY> abc") == ("<SUMMARY> abc", "")
    assert splitter.advance("<SUMMARY> xyz") == ("", "")  # never text twice, never a contradiction


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (errors.InvalidRequestError("bad"), 400),
        (errors.QueueFullError("busy"), 429),
        (errors.TooManyRequestsError("You already have 8 answers in progress"), 429),
        (errors.EngineStoppedError("restarting"), 503),
        (errors.BackendUnavailableError("down"), 503),
        (errors.BackendTimeoutError("slow"), 504),
        (errors.GenerationError("failed"), 500),
        (errors.OutOfMemoryError("oom"), 500),
    ],
)
def test_each_typed_error_has_its_status_and_keeps_its_code(error: errors.DemoError, status: int) -> None:
    refusal = APIError.of(error)
    assert refusal.status == status and refusal.body()["error"]["code"] == error.code
    assert refusal.body()["error"]["message"] == str(error)
    retry = refusal.response().headers.get("retry-after")
    assert (retry == "1") == (status in (429, 503))
