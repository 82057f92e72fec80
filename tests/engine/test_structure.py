"""Stage-structured decoding (``engine/decoding/structure.py``): every answer has four ordered, non-empty stages.

The tracker passes a well-formed answer token for token and repairs a broken one (a tag never closed, a
stage repeated or out of order, an end of turn mid-answer, an empty stage); the engines apply it to every
row in both batching modes and in Think harder; a reserve keeps room for the CONCLUSION; and greedy answers
the model already writes well are token-identical with and without it.
"""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import door

from vlm_demo.config import Config
from vlm_demo.cot.stages import STAGES, parse_stages
from vlm_demo.engine.batching.base import Engine
from vlm_demo.engine.batching.continuous import ContinuousEngine
from vlm_demo.engine.batching.dynamic import DynamicEngine
from vlm_demo.engine.decoding.structure import RESAMPLE, StageGrammar, StageTracker, conclusion_reserve
from vlm_demo.models import realshape
from vlm_demo.models.tiny import COLOURS as PALETTE
from vlm_demo.models.tiny import solid_image
from vlm_demo.request import STAGE_BEAM, SamplingParams

WELL_FORMED = [
    "<SUMMARY> I will find the colour. </SUMMARY>\n\n<CAPTION> The image is red. </CAPTION>\n\n"
    "<REASONING> Every part is red → so it is red. </REASONING>\n\n<CONCLUSION> The image is red. </CONCLUSION>",
    "<SUMMARY>Plan: a < 5 and <b>bold</b> is fine.</SUMMARY><CAPTION>c</CAPTION>\n<REASONING>x<y</REASONING>"
    "<CONCLUSION>Done.</CONCLUSION>",
]
# Held out: sizes and wordings the tiny model was not trained on verbatim.
COLOURS = list(PALETTE)
SIZES = [(17, 23), (1024, 200), (200, 1024), (333, 77), (9, 9), (640, 480)]
WORDINGS = ["Which colour dominates here?", "tell me what this shows", "Any idea what hue this is?", "What now?"]


def four_stages(text: str) -> bool:
    """Exactly the four stages, in order, none empty, nothing outside them."""
    stages = parse_stages(text, final=True)
    return stages.seen == STAGES and all(stages.text(s) for s in STAGES) and not stages.extra


def replay(grammar: StageGrammar, tracker: StageTracker, tokens: list[int], redraw: int) -> list[int]:
    """A scripted "model" that writes ``tokens`` (and ``redraw`` when asked to draw again): what the tracker
    commits. The script does not adapt to replacements; forced tokens simply take their steps."""
    committed: list[int] = []
    queue = list(tokens)
    while queue and not tracker.done and len(committed) < tracker.budget:
        sampled = queue[0]
        token = tracker.check(sampled, len(committed))
        if token == RESAMPLE:
            token = tracker.check(redraw, len(committed), redrawn=True)
            queue.pop(0)
        elif token == sampled:
            queue.pop(0)
        committed.append(token)
    return committed


@pytest.fixture(scope="module")
def grammar(worker) -> StageGrammar:
    return worker.grammar


def test_a_well_formed_answer_passes_token_for_token(worker, grammar) -> None:
    synthetic = realshape.synthetic_tokenizer()  # the real vocabulary size and Llama-3 specials
    for tokenizer, eos in ((worker.tokenizer, worker.eos_ids), (synthetic, realshape.EOS_IDS)):
        own = grammar if tokenizer is worker.tokenizer else StageGrammar(tokenizer, eos)
        for text in WELL_FORMED:
            tokens = own.encode(text)
            tracker = own.answer(budget=len(tokens) + 200)
            assert replay(own, tracker, tokens, redraw=0) == tokens, text
            assert tracker.done and tracker.corrections == 0 and tracker.cut is None and not tracker.repaired


@pytest.mark.parametrize(
    "broken, expected",
    [
        ("<SUMMARY de part. </SUMMARY>", "<SUMMARY> de part. </SUMMARY>"),  # an opening tag never closed
        ("Sure! <SUMMARY> plan", "<SUMMARY>"),  # text before the first tag
        ("<SUMMARY> a </SUMMARY><CAPTION> b <SUMMARY>", "<CAPTION> b </CAPTION>"),  # a stage again
        ("<SUMMARY> a </SUMMARY><CONCLUSION>", "</SUMMARY><CAPTION>"),  # out of order
        ("<SUMMARY> a </SUMMARY><CAPTION> b", "<CAPTION> b</CAPTION>"),  # end of turn mid-stage (eos appended)
    ],
)
def test_a_broken_answer_is_repaired_where_it_breaks(worker, grammar, broken, expected) -> None:
    tokens = grammar.encode(broken) + [worker.eos_ids[0]]
    tracker = grammar.answer(budget=400)
    text = worker.tokenizer.decode(replay(grammar, tracker, tokens, redraw=grammar.encode(" x")[0]))
    assert expected in text and tracker.corrections > 0 and tracker.repaired, text
    stages = parse_stages(text, final=True)
    assert list(stages.seen) == list(STAGES[: len(stages.seen)]), text  # whatever was written is in order


def test_a_stage_with_no_text_is_drawn_again_without_tags(grammar) -> None:
    tracker = grammar.answer(budget=400)
    for token in grammar.encode("<SUMMARY>"):
        assert tracker.check(token, 0) == token
    closing = grammar.encode(" </SUMMARY>")
    assert tracker.check(closing[0], 2) == RESAMPLE and tracker.repaired  # closing an empty SUMMARY
    word = grammar.encode(" plan")[0]
    assert tracker.check(word, 2, redrawn=True) == word
    assert [tracker.check(t, 3) for t in closing] == closing  # now it may close
    ban = grammar.ban_mask(len(grammar.texts), "cpu")
    assert all(ban[i] for i in grammar.banned_ids) and not ban[word]


def test_the_reserve_closes_the_running_stage_and_opens_the_conclusion(worker, grammar) -> None:
    budget = 64
    reserve = conclusion_reserve(budget, grammar.overhead)
    assert grammar.overhead < reserve < budget // 2 and conclusion_reserve(30, grammar.overhead) == 0
    rambling = grammar.encode("<SUMMARY> " + "word " * 200)
    tracker = grammar.answer(budget)
    committed = replay(grammar, tracker, rambling, redraw=0)
    text = worker.tokenizer.decode(committed)
    assert len(committed) == budget
    stages = parse_stages(text, final=True)
    assert stages.seen == ("summary", "conclusion") and stages.conclusion and text.endswith("</CONCLUSION>")
    assert tracker.cut == "summary"


def test_a_closing_tag_broken_off_at_the_budgets_end_is_written_whole(worker, grammar) -> None:
    """Four tokens left in the CONCLUSION: "</" may start its closing tag, but "b" after it ("</b") puts the
    whole tag back to write, so the tag is forced then, while it still fits (hypothesis found it)."""
    budget = 60
    head = grammar.encode("<SUMMARY>a</SUMMARY><CAPTION>b</CAPTION><REASONING>c</REASONING><CONCLUSION>")
    filler = grammar.encode(" x") * (budget - len(head) - 4)
    tail = grammar.encode("</") + grammar.encode("b") + grammar.encode(" y") * 3
    tracker = grammar.answer(budget)
    committed = replay(grammar, tracker, head + filler + tail, redraw=0)
    text = worker.tokenizer.decode(committed)
    assert len(committed) <= budget and tracker.done and text.endswith("</CONCLUSION>"), text
    assert malformed(text, cut=tracker.cut is not None) is None, text


def test_a_control_character_split_over_two_byte_tokens_is_drawn_again(worker, grammar) -> None:
    """U+009B is two bytes (C2 9B), two byte tokens of the tokenizer, each harmless alone: the second is drawn
    again, and a second draw never takes a token that starts inside a character (Hypothesis found this)."""
    lone = [i for i, text in enumerate(grammar.texts) if text == "\ufffd"]
    lead, finish = next((a, b) for a in lone for b in grammar.continuing if grammar.decode([a, b]) == "\x9b")
    assert lead not in grammar.control and finish not in grammar.control
    tracker, committed = grammar.answer(120), []
    for token in [*grammar.encode("<SUMMARY>It is"), lead]:
        committed.append(tracker.check(token, len(committed)))
    assert committed[-1] == lead
    assert tracker.check(finish, len(committed)) == RESAMPLE
    assert finish in grammar.banned_ids and lead in grammar.banned_ids  # the second draw cannot finish it either
    harmless = next(b for b in grammar.continuing if grammar.decode([lead, b]) == "\xa0")  # no-break space
    assert tracker.check(harmless, len(committed)) == harmless  # a character, not a control one, is left alone


def test_a_redraw_that_starts_with_a_space_gives_a_blank_stage_its_text_and_the_answer_still_closes(worker, grammar):
    """A "model" that writes nothing but newlines: each stage's text is drawn again, and the redraw " point" starts
    with a space past the whitespace limit; the word is the stage's text all the same, so the CONCLUSION still
    closes within the budget (Hypothesis found an answer cut at "</CONCLUSION" when it was not)."""
    newline, word = grammar.encode("\n")[0], grammar.encode(" point")[0]
    assert grammar.texts[word].startswith(" ") and word not in grammar.banned_ids
    tracker, committed = grammar.answer(60), []
    while not tracker.done and len(committed) < 60:
        token = tracker.check(newline, len(committed))
        if token == RESAMPLE:
            token = tracker.check(word, len(committed), redrawn=True)
        committed.append(token)
    text = worker.tokenizer.decode(committed)
    assert tracker.done and text.endswith("</CONCLUSION>"), text
    assert malformed(text, cut=tracker.cut is not None) is None, (malformed(text, tracker.cut is not None), text)


# Pieces a hot sample writes where tags go wrong (each tokenised as the model's tokenizer splits it).
ADVERSARIAL = ["<SUMMARY>", "</SUMMARY>", "<CAPTION>", "</CAPTION>", "<REASONING>", "</REASONING>", "<CONCLUSION>",
               "</CONCLUSION>", "</<SUMMARY>", "</<", "</", "<", "< ", "</ ", "</cONCLUSION>", "<summary>", "</SUM",
               "MARY>", "x < 5", "<b>bold</b>", "<<", "</>", " word", ".", "\n\n", "\x1f", "\x0e", "\r", "\t"]  # fmt: skip
EXACT_TAG = re.compile(r"<(/?)(SUMMARY|CAPTION|REASONING|CONCLUSION)>")
TAG_BITS = re.compile(r"<\s*/?\s*(SUMMARY|CAPTION|REASONING|CONCLUSION)|</\s*<|</\s|</$", re.I)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_adversarial_tokens_never_break_a_tag_or_write_a_control_character(worker, grammar, data) -> None:
    """A "model" that writes any mix of tag pieces, broken tags, control characters and random byte-level
    tokens of the tiny tokenizer (drawn again, when asked, as random tokens the redraw allows): whatever it
    writes, the committed answer is exactly the four stages in order, each tag once and whole, no stage empty,
    no piece of a stage tag inside a stage's text, no control character but newline and tab."""
    size = len(grammar.texts)
    allowed = [i for i in range(size) if i not in set(grammar.banned_ids)]
    piece = st.sampled_from([tokens for text in ADVERSARIAL for tokens in [grammar.encode(text)]])
    noise = st.lists(st.integers(0, size - 1), min_size=1, max_size=3)
    script = [t for chunk in data.draw(st.lists(st.one_of(piece, noise), min_size=1, max_size=60)) for t in chunk]
    budget = data.draw(st.integers(60, 200))
    tracker, committed = grammar.answer(budget), []
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    while not tracker.done and len(committed) < budget:
        sampled = script[len(committed) % len(script)]
        token = tracker.check(sampled, len(committed))
        if token == RESAMPLE:
            token = tracker.check(rng.choice(allowed), len(committed), redrawn=True)
        committed.append(token)
    text = worker.tokenizer.decode(committed)
    assert tracker.done and text.endswith("</CONCLUSION>"), text
    assert malformed(text, cut=tracker.cut is not None) is None, (malformed(text, tracker.cut is not None), text)


def malformed(text: str, cut: bool = False) -> str | None:
    """What is wrong with an answer's stage structure, strictly (``None``: nothing): each stage opened then
    closed with its exact tags, in order, once; all four, or with ``cut`` (the reserve cut a stage short) those
    written then the CONCLUSION; no stage empty; no piece of a stage tag in a stage's text; only whitespace
    between stages, nothing before or after; no control character but newline and tab."""
    if re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", text):
        return "a control character"
    tags = list(EXACT_TAG.finditer(text))
    names = [m.group(2).lower() for m in tags[::2]]
    if [m.group(1) for m in tags] != ["", "/"] * len(names) or [m.group(2) for m in tags[1::2]] != [
        m.group(2) for m in tags[::2]
    ]:
        return "tags not in open/close pairs"
    if names != sorted(set(names), key=STAGES.index) or not names or names[-1] != "conclusion":
        return f"stages out of order or repeated: {names}"
    if not cut and names != list(STAGES):
        return f"stages missing: {names}"
    pieces = EXACT_TAG.split(text)[::3]  # the text around the tags: before, then body, gap, body, ..., after
    if pieces[0].strip() or pieces[-1]:
        return "text outside the stages"
    for i, piece in enumerate(pieces[1:-1]):
        if i % 2 == 0 and (not piece.strip() or TAG_BITS.search(piece)):
            return f"an empty stage or a tag's piece in its text: {piece!r}"
        if i % 2 == 1 and piece.strip():
            return f"text between stages: {piece!r}"
    return None


# ---- in the engines ----------------------------------------------------------------------------------------


def held_out(n: int, temperature: float, max_new_tokens: int = 400, offset: int = 0) -> list:
    jobs = []
    for i in range(offset, offset + n):
        (w, h), question = SIZES[(i // 6) % len(SIZES)], WORDINGS[i % len(WORDINGS)]
        params = SamplingParams(max_new_tokens, temperature, 1.0, seed=i)
        jobs.append(door(solid_image(COLOURS[i % 6], w, h, noise=3, seed=i), question, params))
    return jobs


def answers(engine: Engine, jobs: list) -> list:
    handles = [engine.submit(job) for job in jobs]
    return [h.result(timeout=120) for h in handles]


@pytest.mark.parametrize("kind", [ContinuousEngine, DynamicEngine])
def test_held_out_answers_hot_and_greedy_all_have_four_stages(engines, kind) -> None:
    """36 at temperature 1.3 / top_p 1.0 and 12 greedy, on sizes and wordings never trained on."""
    engine = engines(kind, max_batch_size=8)
    jobs = held_out(36, 1.3) + held_out(12, 0.0, offset=36)
    results = answers(engine, jobs)
    broken = [(why, r.text) for r in results if (why := malformed(r.text, cut=r.cut_stage is not None))]
    assert not broken, broken[:3]
    unstructured = answers(engines(kind, max_batch_size=8, structured_stages=False), jobs[:36])
    assert sum(not four_stages(r.text) for r in unstructured) >= 5, "the flag should turn the structure off"


def test_held_out_answers_with_int8_weights_are_strictly_well_formed(tiny_dir) -> None:
    """The same 48 held-out answers (36 at temperature 1.3) on the tiny model loaded with ``--quantize int8``."""
    from vlm_demo.engine.weights.loader import load

    engine = ContinuousEngine(load(tiny_dir, device="cpu", quantize="int8"),
                              Config(batching="continuous", max_batch_size=8, batch_window_ms=0.0)).start()  # fmt: skip
    try:
        results = answers(engine, held_out(36, 1.3) + held_out(12, 0.0, offset=36))
    finally:
        engine.shutdown()
    broken = [(why, r.text) for r in results if (why := malformed(r.text, cut=r.cut_stage is not None))]
    assert not broken, broken[:3]


def test_hundreds_of_sampled_answers_up_to_temperature_2_have_four_ordered_stages(engines) -> None:
    """Held-out pictures and wordings at temperatures 1.3 to 2.0 (top_p 1.0): every answer strictly well formed
    (``malformed``: exact tags once each, in order, no piece of a tag or control character in the text)."""
    engine = engines(max_batch_size=16, max_queue=512)
    temperatures = (1.3, 1.6, 1.8, 2.0)
    jobs = [job for t in temperatures for job in held_out(75, t, max_new_tokens=300, offset=int(t * 100))]
    results = answers(engine, jobs)
    broken = [(why, r.text) for r in results if (why := malformed(r.text, cut=r.cut_stage is not None))]
    assert not broken, (len(broken), broken[:3])


@pytest.mark.parametrize("kind", [ContinuousEngine, DynamicEngine])
def test_greedy_answers_are_token_identical_with_and_without_the_structure(engines, kind) -> None:
    jobs = [
        door(solid_image(colour, 50 + 7 * i, 30 + 5 * i), question, SamplingParams(400, 0.0))
        for i, colour in enumerate(COLOURS)
        for question in ("What colour is this image?", "Describe this picture in detail.", "what do you see")
    ]
    on, off = engines(kind, max_batch_size=8), engines(kind, max_batch_size=8, structured_stages=False)
    together = [on.submit(job) for job in jobs]  # batched
    for handle in together:
        handle.result(timeout=120)
    for job, batched in zip(jobs, together, strict=True):
        alone, plain = on.submit(job), off.submit(job)
        alone.result(timeout=60)
        plain_text = plain.result(timeout=60).text
        assert batched.token_ids == alone.token_ids == plain.token_ids
        assert four_stages(plain_text)


@pytest.mark.parametrize("kind", [ContinuousEngine, DynamicEngine])
@pytest.mark.parametrize("budget", [64, 96, 160])
def test_an_answer_cut_by_the_token_budget_still_ends_with_a_conclusion(engines, kind, budget) -> None:
    engine = engines(kind, max_batch_size=8)
    result = engine.submit(
        door(solid_image("blue", 40, 40), "Describe this picture in detail.", SamplingParams(budget, 0.0))
    ).result(60)
    stages = parse_stages(result.text, final=True)
    assert "conclusion" in stages.seen and stages.conclusion, result.text
    assert result.text.endswith("</CONCLUSION>") and result.completion_tokens <= budget
    assert result.finish_reason == "length" and result.cut_stage in STAGES


def test_think_harder_candidates_start_inside_their_stage_and_no_stage_is_empty(engines) -> None:
    engine = engines(max_batch_size=16)
    jobs = [
        door(
            solid_image(COLOURS[i % 3], 60, 60),
            WORDINGS[i % 4],
            SamplingParams(300, 1.0, 1.0, seed=i, reasoning=STAGE_BEAM, beams=4),
        )
        for i in range(12)
    ]
    for result in answers(engine, jobs):
        assert four_stages(result.text), result.text
        assert all(text for choice in result.beam.stages for text in choice.candidates), result.beam
        assert all(choice.closed[choice.winner] for choice in result.beam.stages), result.beam  # winners closed
    cut = engine.submit(
        door(
            solid_image("red", 60, 60),
            "Describe this picture in detail.",
            SamplingParams(90, 1.0, 1.0, seed=3, reasoning=STAGE_BEAM, beams=3),
        )
    ).result(60)
    assert "conclusion" in parse_stages(cut.text, final=True).seen and cut.text.endswith("</CONCLUSION>")
    assert cut.finish_reason == "length" and cut.cut_stage in STAGES
