"""Stage-level beam search on the real tiny Mllama, in the continuous engine.

The tiny model is trained (``vlm_demo.models.tiny``) so that sampled CAPTION and CONCLUSION candidates sometimes
name a wrong colour, and so that its judge prefers the candidate naming the image's colour. So these tests
can check the search's decisions, not only that it runs.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Iterator

import pytest
import torch
from support import door, wait_until

from vlm_demo.config import Config
from vlm_demo.cot.judge import judge_question, parse_choice
from vlm_demo.cot.stages import STAGES, parse_stages
from vlm_demo.engine.batching.base import Engine as BaseEngine
from vlm_demo.engine.batching.continuous import ContinuousEngine
from vlm_demo.engine.batching.dynamic import DynamicEngine
from vlm_demo.engine.search.beam import StageBeam
from vlm_demo.errors import InvalidRequestError, RequestCancelledError, UnsupportedError
from vlm_demo.models.tiny import COLOURS, answer_for, solid_image, stage_text
from vlm_demo.request import STAGE_BEAM, Limits, SamplingParams, ValidRequest, sampling_from
from vlm_demo.tools.bench import BatchCounter

COLOUR_WORDS = re.compile(r"\b(" + "|".join(COLOURS) + r")\b")


def beam(k: int, seed: int, temperature: float = 1.0, max_new_tokens: int = 300, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens, temperature, 1.0, seed=seed, reasoning=STAGE_BEAM, beams=k, **kw)


def inputs(*values: object) -> dict[str, object]:
    """The page's sampling inputs by name, in its order."""
    return dict(zip(("max_new_tokens", "temperature", "top_p", "reasoning", "beams"), values))


def one_at_a_time(valid: ValidRequest) -> ValidRequest:
    """The benchmarks' switch: the same search, one candidate and one judge call at a time."""
    return dataclasses.replace(valid, serial_beams=True)


def ends_on(text: str, colour: str) -> bool:
    """The last colour the text names is ``colour`` (what the tiny judge reads of a candidate)."""
    said = COLOUR_WORDS.findall(text)
    return bool(said) and said[-1] == colour


class Spy:
    """Records what each real prefill call held (the worker's own method still runs)."""

    def __init__(self, worker) -> None:
        self.calls: list[list[str]] = []
        self._prefill = worker.prefill

    def __call__(self, requests, images=None, reserve=0):
        self.calls.append([r.question for r in requests])
        return self._prefill(requests, images, reserve)


@pytest.fixture
def make_engine(worker) -> Iterator:
    engines: list[BaseEngine] = []

    def make(**kwargs) -> ContinuousEngine:
        config = Config(**{"batching": "continuous", "max_batch_size": 8, "batch_window_ms": 0.0, **kwargs})
        engine = ContinuousEngine(worker, config).start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


def test_a_judge_prompt_reuses_the_prepared_image_exactly(worker) -> None:
    image = solid_image("green", 300, 40)
    prepared = worker.prepare(image, "What colour is this image?")
    question = judge_question("caption", "What colour?", "The image is red.", "The image is green.")
    direct = worker.prepare(image, question)
    reused = worker.prepare_with(prepared, question)
    assert direct.keys() == reused.keys()
    for key in direct:
        assert torch.equal(direct[key], reused[key]), key


def test_parse_choice_reads_the_papers_format_and_never_raises() -> None:
    assert parse_choice("Since response 2 names the colour, I choose response 2.") == 1
    assert parse_choice("Since [it is clear], I choose response [1].") == 0
    assert parse_choice("I CHOOSE THE RESPONSE 2") == 1
    for junk in ["", "response 3", "choose response", "<CONCLUSION>", "\x00" * 5]:
        assert parse_choice(junk) is None


def test_the_door_takes_reasoning_and_beams_with_clear_errors() -> None:
    limits = Limits()
    assert sampling_from(inputs(10, 0, 1), limits).reasoning == "normal"
    params = sampling_from(inputs(10, 0.5, 1, "Stage_Beam", "4"), limits)
    assert (params.reasoning, params.beams) == ("stage-beam", 4)
    for reasoning, beams, message in [
        ("tree-of-thought", 2, "reasoning must be one of"),
        ("stage-beam", 1, "beams must be a whole number from 2 to 8"),
        ("stage-beam", 9, "beams must be a whole number from 2 to 8"),
        ("stage-beam", 2.5, "beams must be a whole number from 2 to 8"),
        (3, 2, "reasoning must be one of"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            sampling_from(inputs(10, 0.5, 1, reasoning, beams), limits)


def test_winners_follow_the_judges_answers_and_name_the_images_colour(worker, make_engine) -> None:
    """Sampled at temperature 1, candidates disagree. Each stage's winner is the one the judge calls chose
    (knockout replayed from the recorded answers); identical candidates are not judged; and the tiny judge's
    rule holds where the candidates have the form it was trained on: whenever a candidate's last colour is the
    image's, so is the winner's."""
    engine = make_engine()
    question = "What colour is this image?"
    jobs = [(colour, seed) for seed in range(3) for colour in COLOURS]
    handles = [engine.submit(door(solid_image(colour, 40, 40), question, beam(4, seed))) for colour, seed in jobs]
    contested = wrong_beaten = 0
    for handle, (colour, _) in zip(handles, jobs, strict=True):
        result = handle.result(300)
        view = result.beam
        assert view is not None and view.phase == "done"
        assert [s.stage for s in view.stages] == list(STAGES)
        for choice in view.stages:
            assert len(choice.candidates) == 4 and choice.winner is not None
            # the engine judges the candidates that reached the closing tag (all of them if none did)
            closed = [text for text, tagged in zip(choice.candidates, choice.closed, strict=True) if tagged]
            closed = closed or list(choice.candidates)
            unique = list(dict.fromkeys(closed))
            winner = choice.candidates[choice.winner]
            if len(unique) > 1:
                contested += 1
                assert choice.judgements, choice
                # a judge's row stops at its choice: no end of turn, no words after it
                assert all(re.search(r"I choose response [12]$", said) for said in choice.judgements), choice
                # a judge's words are free text: the stage structure never forces a tag into them
                assert not any("<" in said for said in choice.judgements), choice
                if len(choice.judgements) == len(unique) - 1:  # every distinct candidate contended (all tagged)
                    assert winner == replay_knockout(unique, choice.judgements), choice
                # the judge learnt its rule on candidates of the trained form; at temperature 1 a candidate may
                # be garbled ("... one plain, part of the image."), and on those the tiny judge is unreliable
                trained = {stage_text(choice.stage, question, c) for c in COLOURS}
                if any(ends_on(text, colour) for text in unique) and all(text in trained for text in unique):
                    assert ends_on(winner, colour), choice
                    wrong_beaten += any(COLOUR_WORDS.search(t) and not ends_on(t, colour) for t in unique)
            else:
                assert not choice.judgements, "identical candidates must not be judged"
        assert result.text.startswith("<SUMMARY>") and result.batch_size >= 4, result.text
        assert result.finish_reason in ("stop", "length")
    assert contested >= 3, "sampled candidates should sometimes disagree: the judging was hardly tested"
    assert wrong_beaten >= 3, "a candidate naming a wrong colour should sometimes lose to a right one"


def replay_knockout(contenders: list[str], said: tuple[str, ...]) -> str:
    """The winner the recorded judge answers imply: pairs in order, a last odd one goes through."""
    answers = iter(said)
    while len(contenders) > 1:
        winners = [b if parse_choice(next(answers)) == 1 else a for a, b in zip(contenders[::2], contenders[1::2])]
        contenders = winners + contenders[len(winners) * 2 :]
    return contenders[0]


def test_the_prompt_is_prefilled_once_and_a_rounds_judge_calls_run_as_one_batch(worker, make_engine) -> None:
    engine = make_engine(prefill_batch_size=8)
    spy = Spy(worker)
    worker.prefill = spy
    try:
        question = "Which colour fills it?"
        seen_judging = False
        for seed in range(6):  # hot sampling and 6 candidates: distinct candidates, rounds of several judge calls
            result = engine.generate(door(solid_image("blue", 32, 64), question, beam(6, seed, temperature=1.5)))
            assert result.beam is not None
            if result.beam.judge_calls >= 2:
                seen_judging = True
    finally:
        del worker.prefill
    prompt_calls = [call for call in spy.calls if question in call]
    assert len(prompt_calls) == 6, "each answer's prompt and image are prefilled once; stages fork, not recompute"
    judge_calls = [call for call in spy.calls if question not in call]
    assert seen_judging and any(len(call) >= 2 for call in judge_calls), "a round's judge calls share a prefill"


def test_batched_and_serial_searches_give_the_same_answer(worker, make_engine, monkeypatch) -> None:
    """fp32: each candidate's seeded draws do not depend on its neighbours, so running them one at a time
    changes the cost, not the text or the decisions. That holds for the batched search's speculation too:
    while a stage is judged it writes the next stage ahead from one contender, and keeps those rows when
    that one wins or starts over from the winner (both responses win last rounds here)."""
    forks: list[bool] = []
    fork = StageBeam.fork

    def spy(self, rows):
        forks.append(self.speculating)
        return fork(self, rows)

    monkeypatch.setattr(StageBeam, "fork", spy)
    engine = make_engine()
    image = solid_image("green", 64, 32)
    last_rounds = set()
    for k, seed in [(3, 0), (3, 3), (4, 4), (4, 5), (4, 12), (3, 12)]:
        batched = engine.generate(door(image, "What colour?", beam(k, seed)))
        serial = engine.generate(one_at_a_time(door(image, "What colour?", beam(k, seed))))
        assert serial.text == batched.text
        assert serial.beam == batched.beam
        assert batched.batch_size >= k and serial.batch_size == 1
        last_rounds |= {parse_choice(c.judgements[-1]) for c in batched.beam.stages[:-1] if c.judgements}
    assert last_rounds == {0, 1}, "the judge should both keep response 1 and choose response 2 in a last round"
    assert any(forks), "the next stage was never written ahead"


def test_greedy_beam_search_keeps_the_trained_answer_and_the_normal_mode_is_untouched(worker, make_engine) -> None:
    engine = make_engine()
    image = solid_image("red", 50, 50)
    normal = engine.generate(door(image, "What colour is this image?", SamplingParams(200, 0.0)))
    assert normal.text == answer_for("red", "What colour is this image?") and normal.beam is None
    searched = engine.generate(door(image, "What colour is this image?", beam(2, 0, temperature=0.0)))
    assert parse_stages(searched.text, final=True).conclusion == "The image is red."


def test_missing_tags_never_crash_the_search_fuzzed(worker, make_engine) -> None:
    """Hot sampling and tiny token budgets make candidates miss their closing tags (or every tag);
    each search still ends with a result or a clean length stop, and normal rows beside them are unharmed."""
    engine = make_engine(max_batch_size=16)
    rng = random.Random(7)
    handles = []
    for i in range(24):
        params = beam(
            rng.randint(2, 5), seed=i, temperature=rng.choice([1.0, 1.6, 2.0]), max_new_tokens=rng.randint(1, 90)
        )
        colour = rng.choice(list(COLOURS))
        handles.append((engine.submit(door(solid_image(colour, rng.randint(16, 200), 40), "colour?", params)), params))
    plain = engine.submit(door(solid_image("black", 40, 40), "What colour is this image?", SamplingParams(200, 0.0)))
    for handle, params in handles:
        result = handle.result(300)
        assert result.finish_reason in ("stop", "length")
        assert result.completion_tokens <= params.max_new_tokens
        assert result.beam is not None and result.beam.phase == "done"
        parse_stages(result.text, final=True)
    assert plain.result(120).text == answer_for("black", "What colour is this image?")
    wait_until(lambda: not engine.beams and not len(engine.rows), 10, what="every search and row to leave")
    assert_every_page_returned(engine)


def test_cancelling_a_search_frees_its_rows_and_spares_others(worker, make_engine) -> None:
    engine = make_engine()
    long = door(solid_image("blue", 40, 40), "Describe this image in detail.", beam(4, 3, max_new_tokens=800))
    search = engine.submit(long)
    other = engine.submit(door(solid_image("white", 40, 40), "What colour is this image?", SamplingParams(200, 0.0)))
    wait_until(lambda: len(engine.rows) >= 4, 60, every=0.01, what="the search's four candidates")
    search.cancel()
    with pytest.raises(RequestCancelledError):
        search.result(10)
    assert other.result(60).text == answer_for("white", "What colour is this image?")
    wait_until(lambda: not engine.beams and not len(engine.rows), 10, what="the cancelled search's rows to leave")
    assert_every_page_returned(engine)


def assert_every_page_returned(engine) -> None:
    """Searches keep caches aside (their start, each stage's winner): once they are over, every page is back
    in the pool or holds a remembered picture."""
    pool = engine.rows.pool
    assert pool.free_pages + engine.images.pages == pool.pages


def test_dynamic_batching_refuses_stage_beam_clearly(worker) -> None:
    engine = DynamicEngine(worker, Config(batching="dynamic", max_batch_size=2)).start()
    try:
        with pytest.raises(UnsupportedError, match="continuous batching; this server runs --batching dynamic"):
            engine.submit(door(solid_image("red", 20, 20), "colour?", beam(2, 0)))
    finally:
        engine.shutdown()


def test_more_candidates_than_free_rows_run_in_waves_within_the_row_limit(worker, make_engine) -> None:
    engine = make_engine(max_batch_size=4)
    sizes = BatchCounter()
    engine.add_listener(sizes)
    result = engine.generate(door(solid_image("yellow", 30, 30), "What colour is this image?", beam(6, 4)))
    assert result.beam is not None and [len(c.candidates) for c in result.beam.stages] == [6, 6, 6, 6]
    assert max(sizes.sizes) == 4, "the row limit was exceeded (or the candidates never shared a step)"


def test_a_rambling_candidate_is_cut_and_does_not_hold_the_answer(worker, make_engine) -> None:
    """At temperature 1.2, one REASONING candidate of this seed drifts into the long form's part counting (~200
    tokens) while the other three close the stage in about 19. Once half have closed, it may take 2 x 19 + 16
    tokens: it is cut there, without its tag, so it is not judged; batched and serial searches cut it alike, and
    the batched one stops its row instead of writing the rest (the steps are counted). (The tiny model is sure
    enough of its answers that at temperature 1 such a drift is rare.)"""
    engine = make_engine()
    image, question = solid_image("yellow", 64, 64), "Which colour do you see here?"
    before = engine.steps_run
    batched = engine.generate(door(image, question, beam(4, 977, temperature=1.2)))
    steps = engine.steps_run - before
    serial = engine.generate(one_at_a_time(door(image, question, beam(4, 977, temperature=1.2))))
    assert serial.text == batched.text and serial.beam == batched.beam
    reasoning = batched.beam.stages[2]
    assert reasoning.closed.count(False) == 1, reasoning
    cut = reasoning.candidates[reasoning.closed.index(False)]
    assert re.search(r"part \d+ is yellow, part \d+ is", cut) and "</" not in cut, cut  # the long form, cut short
    assert reasoning.closed[reasoning.winner] and not reasoning.judgements  # the three closed ones are identical
    assert parse_stages(batched.text, final=True).text("reasoning") == reasoning.candidates[reasoning.winner]
    assert steps < 200, f"the straggler's row ran on: {steps} steps"  # its long form alone takes ~200


def test_a_candidate_the_structure_steered_to_its_tag_is_judged_only_when_none_closed_on_its_own(
    worker, make_engine
) -> None:
    """At temperature 1.5 some candidates try to leave their stage the wrong way and the stage structure closes
    the stage for them. Such a candidate is passed over whenever another closed the stage on its own: over
    many searches, no judge call ever weighs one against a naturally closed candidate."""
    engine = make_engine()
    seen_steered = judged_steered = 0
    original = StageBeam._judge_or_decide

    def spy(self: StageBeam) -> None:
        nonlocal seen_steered, judged_steered
        original(self)
        steered = [c for c in self.candidates if c.tagged and not c.closed_itself]
        seen_steered += len(steered)
        if any(c.closed_itself for c in self.candidates):
            judged_steered += sum(c in self.contenders for c in steered)

    StageBeam._judge_or_decide = spy  # type: ignore[method-assign]
    try:
        jobs = [
            door(solid_image(c, 40, 40), "What colour is this image?", beam(4, s, temperature=1.5))
            for s in range(6)
            for c in COLOURS
        ]
        for handle in [engine.submit(job) for job in jobs]:
            handle.result(300)
    finally:
        StageBeam._judge_or_decide = original  # type: ignore[method-assign]
    assert seen_steered > 0, "no candidate needed steering: the rule was not exercised"
    assert judged_steered == 0
