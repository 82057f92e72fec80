"""The stage parser: well-formed, broken and half-streamed LLaVA-CoT answers."""

from __future__ import annotations

import codecs
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from vlm_demo.cot.stages import CONTROL, STAGES, parse_stages

WELL_FORMED = (
    "<SUMMARY>I will look at the image.</SUMMARY>\n\n"
    "<CAPTION>A red square.</CAPTION>\n\n"
    "<REASONING>The whole image is one colour, x < 5.</REASONING>\n\n"
    "<CONCLUSION>red</CONCLUSION>"
)
ANY_TAG = re.compile(r"</?\s*(SUMMARY|CAPTION|REASONING|CONCLUSION)\s*>", re.IGNORECASE)


def test_well_formed_answer_splits_into_four_stages() -> None:
    s = parse_stages(WELL_FORMED, final=True)
    assert s.as_tuple() == (
        "I will look at the image.",
        "A red square.",
        "The whole image is one colour, x < 5.",
        "red",
    )
    assert s.extra == "" and s.active is None and s.seen == STAGES


def test_active_stage_is_the_open_one() -> None:
    assert parse_stages("<SUMMARY>plan").active == "summary"
    assert parse_stages("<SUMMARY>plan</SUMMARY><CAPTION>a cat").active == "caption"
    assert parse_stages("<SUMMARY>plan</SUMMARY>").active is None
    assert parse_stages("").active is None


def test_trailing_partial_tag_is_held_back_until_it_resolves() -> None:
    s = parse_stages("<SUMMARY>plan</SUMMARY><CONC")
    assert s.summary == "plan" and s.extra == "" and s.conclusion == ""
    assert parse_stages("<SUMMARY>plan</SUM").summary == "plan"
    assert parse_stages("<SUMMARY>plan</SUM").active == "summary"  # not closed until '>' arrives
    assert parse_stages("<REASONING>x <").reasoning == "x"
    assert parse_stages("<REASONING>x < 5").reasoning == "x < 5"  # a plain '<' shows once ruled out
    assert parse_stages("<REASONING>a <b>bold").reasoning == "a <b>bold"


def test_final_parse_keeps_a_dangling_fragment_as_text() -> None:
    assert parse_stages("<CONCLUSION>blue <CONC", final=True).conclusion == "blue <CONC"


def test_text_outside_tags_goes_to_extra() -> None:
    s = parse_stages("Sure! <SUMMARY>plan</SUMMARY> and then <CONCLUSION>red</CONCLUSION> bye", final=True)
    assert s.extra == "Sure!  and then  bye"
    assert s.summary == "plan" and s.conclusion == "red"


def test_missing_closing_tags_are_closed_by_the_next_stage() -> None:
    s = parse_stages("<SUMMARY>plan<CAPTION>cap<REASONING>why<CONCLUSION>red", final=True)
    assert s.as_tuple() == ("plan", "cap", "why", "red")
    assert s.active == "conclusion"


def test_missing_opening_tags_and_no_tags_at_all() -> None:
    assert parse_stages("just an answer", final=True).extra == "just an answer"
    s = parse_stages("plan</SUMMARY><CONCLUSION>red</CONCLUSION>", final=True)
    assert s.extra == "plan" and s.conclusion == "red" and s.summary == ""


def test_repeated_stage_is_appended_not_lost() -> None:
    s = parse_stages("<REASONING>one</REASONING><REASONING>two</REASONING>", final=True)
    assert s.reasoning == "one\n\ntwo"
    assert s.seen == ("reasoning",)


def test_tags_are_case_and_space_tolerant() -> None:
    s = parse_stages("<summary>plan</summary>< CONCLUSION >red</ CONCLUSION >", final=True)
    assert s.summary == "plan" and s.conclusion == "red"


def test_tag_reformed_across_a_dropped_tag_is_removed() -> None:
    s = parse_stages("a<SUM</SUMMARY>MARY>b", final=True)
    assert not ANY_TAG.search(s.extra)


_pieces = st.sampled_from(
    ["<SUMMARY>", "</SUMMARY>", "<CAPTION>", "</CAPTION>", "<REASONING>", "</REASONING>", "<CONCLUSION>",
     "</CONCLUSION>", "<", "</", "<SUM", "MARY>", ">", "<CONC", "red", " ", "\n", "x < 5", "é", "<b>", "\x1f", "\t", "\x7f"]
)  # fmt: skip
_texts = st.lists(st.one_of(_pieces, st.text(max_size=8)), max_size=25).map("".join)


@settings(max_examples=300, deadline=None)
@given(_texts, st.booleans())
def test_fuzz_never_raises_and_never_leaks_a_tag_or_a_control_character(text: str, final: bool) -> None:
    s = parse_stages(text, final=final)
    for field in (*STAGES, "extra"):
        assert not ANY_TAG.search(s.text(field)), (field, s)
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", s.text(field)), (field, s)  # newline, tab: kept
    assert s.active in (None, *STAGES)


_content = st.text(alphabet=st.characters(blacklist_characters="<>", blacklist_categories=("Cs",)), max_size=20)


@settings(max_examples=150, deadline=None)
@given(st.tuples(_content, _content, _content, _content))
def test_fuzz_streamed_prefixes_only_ever_grow_toward_the_final_text(contents: tuple[str, ...]) -> None:
    """What a viewer sees mid-stream is always a prefix of the final stage text: no flicker, no tag bits."""
    text = "".join(f"<{n.upper()}>{c}</{n.upper()}>\n" for n, c in zip(STAGES, contents, strict=True))
    final = parse_stages(text, final=True)
    assert final.as_tuple() == tuple(CONTROL.sub("", c).strip() for c in contents)  # control characters dropped
    for cut in range(len(text) + 1):
        partial = parse_stages(text[:cut])
        for stage in STAGES:
            assert final.text(stage).startswith(partial.text(stage)), (text[:cut], stage)
        assert "<" not in partial.extra + "".join(partial.as_tuple())


_unicode = st.text(alphabet=st.characters(blacklist_characters="<>", blacklist_categories=("Cs",)), max_size=12)


@settings(max_examples=150, deadline=None)
@given(st.tuples(_unicode, _unicode, _unicode, _unicode), _texts)
def test_fuzz_a_stream_cut_at_any_byte_shows_no_tag_and_only_grows(contents: tuple[str, ...], noise: str) -> None:
    """The answer's bytes cut anywhere (mid-tag, mid-UTF-8 character) and decoded as a client does, held-back
    bytes included: no intermediate parse shows a tag bit, and each stage only grows toward its final text."""
    text = "".join(f"<{n.upper()}>{c}</{n.upper()}>\n" for n, c in zip(STAGES, contents, strict=True))
    for whole in (text, noise + text + noise):
        data = whole.encode("utf-8")
        final = parse_stages(whole, final=True)
        for cut in range(len(data) + 1):
            shown = parse_stages(codecs.getincrementaldecoder("utf-8")().decode(data[:cut]))
            for field in (*STAGES, "extra"):
                assert not ANY_TAG.search(shown.text(field)), (data[:cut], field)
            if whole is text:
                for stage in STAGES:
                    assert final.text(stage).startswith(shown.text(stage)), (data[:cut], stage)
