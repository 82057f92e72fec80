"""Follow-up questions: the earlier turns reach the model through its own chat template, the engine answers
a follow-up exactly as ``generate`` does on that prompt (CPU fp32), next to single-turn rows in one batch,
and the page's conversation state records, retries and renders turns. The page itself is in
``test_browser.py``."""

from __future__ import annotations

import pytest
import torch
from support import door

from vlm_demo.engine.batching.continuous import ContinuousEngine
from vlm_demo.engine.batching.dynamic import DynamicEngine
from vlm_demo.errors import InvalidRequestError
from vlm_demo.models.tiny import solid_image
from vlm_demo.prompt import MAX_HISTORY_CHARS, MAX_HISTORY_TURNS, Turn, chat_messages, recent_turns
from vlm_demo.request import SamplingParams, validate_history
from vlm_demo.web.page.conversation import Conversation
from vlm_demo.web.page.render import history_html

GREEDY = SamplingParams(max_new_tokens=120, temperature=0.0)
FIRST = Turn("What colour is this image?", "<SUMMARY>s</SUMMARY><CAPTION>red</CAPTION><CONCLUSION>red</CONCLUSION>")


def test_the_prompt_is_the_models_own_chat_template_with_the_image_in_the_first_turn(worker) -> None:
    history = [FIRST, Turn("And the border?", "<CONCLUSION>none</CONCLUSION>")]
    prompt = worker.prompt("Are you sure?", history)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": FIRST.question}]},
        {"role": "assistant", "content": [{"type": "text", "text": FIRST.answer}]},
        {"role": "user", "content": [{"type": "text", "text": "And the border?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "<CONCLUSION>none</CONCLUSION>"}]},
        {"role": "user", "content": [{"type": "text", "text": "Are you sure?"}]},
    ]
    assert chat_messages("Are you sure?", history) == messages
    assert prompt == worker.processor.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt.count("<|image|>") == 1 and prompt.index("<|image|>") < prompt.index(FIRST.question)
    assert prompt.index(FIRST.answer) < prompt.index("Are you sure?")
    assert worker.prompt("Colour?") == worker.prompt("Colour?", ())  # no history: the single-turn prompt


def reference(worker, image, question: str, history) -> str:
    """What ``generate`` writes, greedy, for the processor's inputs of the multi-turn prompt."""
    inputs = worker.to_device(worker.prepare(image, question, history))
    with torch.inference_mode():
        out = worker.model.generate(
            **inputs, generation_config=worker.generation_config(GREEDY.max_new_tokens), eos_token_id=worker.eos_ids
        )
    return worker.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize("kind", [ContinuousEngine, DynamicEngine], ids=["continuous", "dynamic"])
def test_a_follow_up_is_answered_as_generate_answers_its_prompt_next_to_single_turn_rows(engines, worker, kind) -> None:
    red, blue = solid_image("red", 64, 64), solid_image("blue", 40, 90)
    history = [[FIRST.question, FIRST.answer]]
    engine = engines(kind, structured_stages=False)
    follow_up = engine.submit(door(red, "Describe this picture in detail.", GREEDY, history))
    plain = engine.submit(door(blue, "What colour is this image?", GREEDY))
    same_question = engine.submit(door(red, "Describe this picture in detail.", GREEDY))
    results = [r.result(timeout=120) for r in (follow_up, plain, same_question)]
    assert max(r.batch_size for r in results) >= 2, "the rows did not share a batch"
    assert (
        results[0].text.strip()
        == reference(worker, red, "Describe this picture in detail.", validate_history(history, 2000)).strip()
    )
    assert results[0].prompt_tokens > results[2].prompt_tokens  # the earlier turn was in the prompt
    assert "blue" in results[1].text


def test_the_history_is_checked_at_the_door_with_messages_that_name_the_turn() -> None:
    assert validate_history(None, 100) == ()
    assert validate_history([("q ", " a")], 100) == (Turn("q", "a"),)
    cases = [
        ("not a list", "must be a list of [question, answer] pairs"),
        ([["q"]], "Turn 1 is not"),
        ([["q", "a"], ["q", 3]], "Turn 2 is not"),
        ([["  ", "a"]], "Turn 1 of the conversation history has an empty question"),
        ([["q", "a\x00"]], "NUL"),
        ([["x" * 101, "a"]], "Turn 1's question is too long (101 characters; the limit is 100)"),
        ([["q", "a"]] * (MAX_HISTORY_TURNS + 1), f"{MAX_HISTORY_TURNS + 1} turns"),
        ([["q", "a" * MAX_HISTORY_CHARS]], "The conversation history is too long"),
    ]
    for history, message in cases:
        with pytest.raises(
            InvalidRequestError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
        ) as err:
            validate_history(history, 100)
        assert err.value.param == "history"


def test_the_page_keeps_the_newest_turns_that_fit_and_says_how_many_are_left_out() -> None:
    turns = [Turn(f"q{i}", "a" * 5000) for i in range(7)]
    kept = recent_turns(turns)
    assert kept == tuple(turns[-4:])  # 4 × 5002 characters fit in 24 000, 5 do not
    talk = Conversation(tuple(turns))
    assert talk.history() == kept and talk.dropped == 3
    assert "the oldest 3 no longer reach the model" in history_html(talk.history(), talk.dropped)
    many = [Turn(f"q{i}", "a") for i in range(12)]
    assert recent_turns(many) == tuple(many[-MAX_HISTORY_TURNS:])


def test_only_finished_answers_become_turns_and_retry_takes_the_last_one_back() -> None:
    talk = Conversation().finished("What colour?", FIRST.answer)
    assert talk.turns == (Turn("What colour?", FIRST.answer),) and talk.asked == "What colour?"
    stopped = talk.unfinished("Why?")
    assert stopped.turns == talk.turns and stopped.asked == "Why?" and not stopped.answered
    assert stopped.retry() == Conversation(talk.turns, "Why?", False)  # nothing to forget: ask again
    second = talk.finished("Why?", "<CONCLUSION>because</CONCLUSION>")
    again = second.retry()
    assert again.turns == talk.turns and again.asked == "Why?"  # its answer forgotten, the question kept
    assert Conversation.of(None) == Conversation() and Conversation.of(second) is second


def test_earlier_turns_are_rendered_collapsed_escaped_with_their_conclusion_in_the_line() -> None:
    shown = history_html((Turn("<b>what</b>?", FIRST.answer), Turn("and?", "plain words, no tags")))
    assert shown.count('<details class="turn"') == 2 and " open" not in shown
    assert "&lt;b&gt;what&lt;/b&gt;?" in shown and "<b>what</b>" not in shown
    assert '<span class="turn-a">→ red</span>' in shown  # the CONCLUSION is the turn's one-line answer
    assert "→ plain words, no tags" in shown
    assert "2 earlier questions" in shown and history_html(()) == ""
