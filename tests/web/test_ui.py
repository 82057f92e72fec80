"""The page as built (no server, no model): what the "Use via API" page shows, the controls' limits, and
the status line's honesty, driven through the page's real handler with a scripted backend stream.

The browser tests (``test_browser.py``) check the same page rendered, on the tiny model.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support import ROOT

from vlm_demo.backends.base import Features, Health
from vlm_demo.config import Config
from vlm_demo.request import DEFAULTS, KNOBS, ValidRequest
from vlm_demo.results import GenerationResult
from vlm_demo.stream import OutputStream
from vlm_demo.web.answers import Answers
from vlm_demo.web.metrics import Metrics
from vlm_demo.web.page import contract
from vlm_demo.web.page.layout import DemoUI

RED = str(ROOT / "assets" / "tiny" / "red.png")
# The public contract as users' scripts know it, pinned here: the page takes its names from
# ``vlm_demo.web.page.contract``, and this test fails if that module (or the page) drifts from them.
INPUTS = ["image", "question", "max_new_tokens", "temperature", "top_p", "reasoning", "beams"]
OUTPUTS = ["summary", "caption", "reasoning", "conclusion", "raw", "status", "extra", "stages_html", "beams_html"]


class ScriptedStream(OutputStream):
    """A backend stream the test writes into: queue position first, then text, then the ending."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = 2

    def ahead(self) -> int | None:
        return self.waiting

    def write(self, text: str) -> None:
        self.waiting = 0
        self._send(text)

    def finish(self, text: str, reason: str = "stop") -> None:
        self._end(GenerationResult(text, reason, 1, 10, 20, 0.0, 0.1, 0.5), None)

    def cancel(self) -> None:
        pass


class ScriptedBackend:
    name = "scripted"
    remote = False  # a test may set True: a remote model server (Triton)
    model = "scripted-model"
    notice = None
    features = Features()

    def __init__(self) -> None:
        self.streams: list[ScriptedStream] = []

    def submit(self, request: ValidRequest) -> ScriptedStream:
        self.streams.append(ScriptedStream())
        return self.streams[-1]

    def run_batch(self, items: list[ValidRequest]) -> list[Any]:
        raise AssertionError("not used here")

    def health(self) -> Health:
        return Health(True, 0)

    def add_listener(self, listener: Any) -> None:
        pass

    def pids(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def page() -> DemoUI:
    return DemoUI(Answers(ScriptedBackend(), Config(max_batch_size=4), Metrics()), notice="tiny model")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def api(page: DemoUI) -> dict[str, Any]:
    return page.build().get_api_info()["named_endpoints"]


def test_the_contract_module_is_the_published_one_and_handlers_must_follow_it(page: DemoUI) -> None:
    assert list(contract.INPUTS) == INPUTS and list(contract.OUTPUTS) == OUTPUTS
    assert contract.OPTIONAL_INPUTS == ("reasoning", "beams")

    def drifted(image, prompt, max_new_tokens, temperature, top_p, reasoning=None, beams=None):  # noqa: ANN001, ANN202
        pass

    with pytest.raises(TypeError, match="contract"):
        contract.check_signature(drifted)
    for handler in (page.handlers.ask, page.handlers.ask_page, page.handlers.ask_batch):
        contract.check_signature(handler)


def test_the_api_page_lists_only_ask_and_ask_batch_with_named_typed_parameters_and_outputs(api) -> None:
    assert set(api) == {"/ask", "/ask_batch"}, "a page-only event leaked into the API"
    for name in ("/ask", "/ask_batch"):
        params = api[name]["parameters"]
        assert [p["parameter_name"] for p in params] == INPUTS, name
        assert params[2]["type"]["type"] == "integer", "max_new_tokens must be typed as a whole number"
        assert params[6]["type"]["type"] == "integer", "beams must be typed as a whole number"
        assert [(p["parameter_has_default"], p["parameter_default"]) for p in params[5:]] == [
            (True, "normal"),
            (True, 2),
        ], "the stage-beam inputs are optional, after the first five"
        assert [r["label"] for r in api[name]["returns"]] == OUTPUTS, name
    description = api["/ask_batch"]["description"]
    assert description.startswith("Answer without streaming") and "#" not in description


def test_the_controls_offer_only_what_the_server_accepts(page: DemoUI) -> None:
    blocks = page.build().blocks.values()
    by_id = {b.elem_id: b for b in blocks if getattr(b, "elem_id", None)}
    assert by_id["top_p"].minimum > 0, "top_p 0 is rejected when sampling"
    assert by_id["max_new_tokens"].maximum == page.config.max_new_tokens
    question = by_id["q"]
    assert question.lines == 1 and question.max_lines > 1, "Enter must ask (Gradio: lines=1); Shift+Enter adds lines"
    assert "Shift+Enter" in question.info
    assert {"clear", "upload_error", "ask", "stop", "examples", "examples_tiny"} <= by_id.keys()
    cap = page.config.max_new_tokens
    for name, knob in KNOBS.items():  # each control is its sampling field's knob, as the server checks it
        if not knob.label:
            assert name not in by_id, name
            continue
        control = by_id[name]
        assert control.label == knob.label and control.value == DEFAULTS[name], name
        if knob.choices:
            assert [value for _, value in control.choices] == list(knob.values)
        else:
            low, high = knob.bounds(cap)
            assert (control.minimum, control.maximum, control.step) == (knob.page_low or low, high, knob.step)


async def _ask_page(page: DemoUI, *steps) -> list[tuple]:
    """The page's Ask handler to its end while ``steps`` (each given the stream) write into the backend's
    stream, one every 0.2 s, like a model that answers a little later."""

    async def collect() -> list[tuple]:
        return [u async for u in page.handlers.ask_page(RED, "What colour?", 64, 0.0, 1.0)]

    async def play() -> None:
        for step in steps:
            await asyncio.sleep(0.2)
            step(page.backend.streams[-1])

    updates, _ = await asyncio.wait_for(asyncio.gather(collect(), play()), timeout=20)
    return updates


def _statuses(updates: list[tuple]) -> list[str]:
    return [u[5] for u in updates if isinstance(u[5], str)]


def test_status_shows_the_queue_position_then_says_when_the_conclusion_is_missing(page: DemoUI) -> None:
    partial = "<SUMMARY>plan</SUMMARY><CAPTION>a red square</CAPTION>"
    updates = asyncio.run(_ask_page(page, lambda s: s.write(partial), lambda s: s.finish(partial)))
    statuses = _statuses(updates)
    assert statuses[0] == "Waiting for the model… 2 ahead of you · 0 s", statuses
    assert statuses[-1].startswith("Ended without a CONCLUSION"), statuses


def test_status_says_done_when_the_answer_has_its_conclusion(page: DemoUI) -> None:
    answer = "<SUMMARY>s</SUMMARY><CAPTION>c</CAPTION><REASONING>r</REASONING><CONCLUSION>red</CONCLUSION>"
    updates = asyncio.run(_ask_page(page, lambda s: s.write(answer), lambda s: s.finish(answer)))
    assert _statuses(updates)[-1].startswith("Done"), _statuses(updates)
    assert updates[-1][3] == "red"
    # The question leaves the box with the first update, and no later one writes the box: what the visitor
    # types while the answer streams stays.
    assert updates[0][-2].get("value") == "" and all("value" not in u[-2] for u in updates[1:]), updates


def test_a_bad_request_on_the_page_is_one_line_beside_the_input_not_an_error(page: DemoUI) -> None:
    """An input the door refuses is said once, on the error line beside it (the question's, the image's), and the
    status line points there; any other refusal stays in the status line."""

    async def ask(image: Any, question: str, top_p: float = 1.0) -> list[tuple]:
        return [u async for u in page.handlers.ask_page(image, question, 64, 0.0, top_p)]

    updates = asyncio.run(ask(RED, "   "))  # raises nothing: no toast, no error mark on the outputs
    assert len(updates) == 1
    image_line, question_line = updates[0][-4:-2]
    assert question_line == "⚠ Please type a question about the image." and image_line == "", updates[0]
    assert updates[0][5] == "⚠ Invalid input: see the message by the question", updates[0][5]
    assert updates[0][:4] == ("", "", "", ""), "the panels are cleared, not left holding an older answer"
    assert "value" not in updates[0][-2], "the question stays in the box, to be mended"
    missing = asyncio.run(ask(None, "What colour?"))[0]
    assert missing[-4:-2] == ("⚠ Please upload an image first.", ""), missing
    assert missing[5] == "⚠ Invalid input: see the message by the image", missing[5]
    wide = asyncio.run(ask(RED, "What colour?", 7.0))[0]  # no page input's fault: the status line says it
    assert wide[-4:-2] == ("", "") and wide[5].startswith("⚠ Invalid input: top_p must be"), wide[5]


def test_a_stage_cut_or_stopped_is_marked_so_never_done() -> None:
    """✓ means the stage was written to its end; one the budget cut short or one still open at Stop or an
    error is marked ✂ cut / ■ stopped, in the strip and (through its data attributes) on the panel."""
    from vlm_demo.results import GenerationResult
    from vlm_demo.web.page.render import render

    partial = "<SUMMARY>s</SUMMARY><CAPTION>c</CAPTION><REASONING>part 8 is red, part"
    stopped = render(partial, "Stopped after 1.0 s.", final=True, ended="cancelled").stages_html
    assert 'data-stopped="reasoning"' in stopped and 'data-done="summary caption"' in stopped
    assert "REASONING ■ stopped" in stopped and "REASONING ✓" not in stopped
    failed = render(partial, "⚠ Model restarting: …", final=True, ended="error").stages_html
    assert 'data-stopped="reasoning"' in failed
    answer = partial + "</REASONING><CONCLUSION>red</CONCLUSION>"
    cut = GenerationResult(answer, "length", 1, 10, 64, 0.0, 0.1, 0.5, cut_stage="reasoning")
    outputs = render(answer, final=True, result=cut)
    assert 'data-cut="reasoning"' in outputs.stages_html and "CONCLUSION ✓" in outputs.stages_html
    assert outputs.status.startswith("Stopped at the max new tokens limit · the REASONING was cut short")
    ran_out = render(partial, final=True, result=GenerationResult(partial, "length", 1, 10, 64, 0.0, 0.1, 0.5))
    assert 'data-cut="reasoning"' in ran_out.stages_html  # open when the tokens ran out (no structure)
    done = render(answer, final=True, result=GenerationResult(answer, "stop", 1, 10, 64, 0.0, 0.1, 0.5))
    assert 'data-cut=""' in done.stages_html and 'data-stopped=""' in done.stages_html
    assert 'data-done="summary caption reasoning conclusion"' in done.stages_html


def test_think_harders_view_says_stopped_after_stop() -> None:
    from vlm_demo.results import BeamView, StageChoice
    from vlm_demo.web.page.render import render

    view = BeamView((StageChoice("summary", ("a", "b")),), "writing", 2)
    assert "writing…" in render("<SUMMARY>a", view=view).beams_html
    stopped = render("<SUMMARY>a", "Stopped after 1.0 s.", final=True, view=view, ended="cancelled").beams_html
    assert "writing…" not in stopped and "stopped" in stopped


def test_the_status_counts_tokens_and_seconds_while_it_streams_and_uses_plurals() -> None:
    from vlm_demo.results import BeamView, GenerationResult, StageChoice
    from vlm_demo.web.page.render import progress, render

    # Waiting: whole seconds (one update a second). Streaming: tenths, so a sub-second answer's time moves too.
    assert progress("", ahead=3, elapsed=2.7).status == "Waiting for the model… 3 ahead of you · 2 s"
    assert progress("<SUMMARY>a", elapsed=0.34, tokens=1).status == "Generating · writing SUMMARY… · 1 token · 0.3 s"
    assert progress("<SUMMARY>a b", elapsed=4.2, tokens=12).status.endswith("· 12 tokens · 4.2 s")
    # Steady between stages: the next one is named as soon as one closes (its opening tag is being written).
    answer = "<SUMMARY>a</SUMMARY><CAPTION>b</CAPTION><REASONING>c</REASONING><CONCLUSION>d</CONCLUSION>"
    named = [progress(answer[:end], tokens=1).status for end in range(answer.index(">") + 1, len(answer) + 1)]
    assert all(s.startswith("Generating · writing ") for s in named), sorted(set(named))
    assert [s.split("writing ")[1].split("…")[0] for s in dict.fromkeys(named)] == [
        "SUMMARY",
        "CAPTION",
        "REASONING",
        "CONCLUSION",
    ], named
    searching = BeamView((StageChoice("caption", ("a", "b")),), "writing", 2)
    assert progress("<SUMMARY>a</SUMMARY>", searching, elapsed=0.56).status.endswith("2 candidates writing… · 0.6 s")
    view = BeamView((StageChoice("summary", ("a", "b", "c", "d"), winner=0),), "done", 4, judge_calls=1)
    result = GenerationResult("<SUMMARY>a</SUMMARY>", "stop", 5, 10, 20, 0.0, 0.1, 0.5, beam=view)
    status = render(result.text, final=True, result=result, view=view).status
    # Plain words: the candidates, the batch's fifth row as a fifth text written at once, one comparison.
    assert "Thought harder: 4 candidates per stage, written side by side, up to 5 texts at once" in status, status
    assert "batch of 5" not in status and "judge" not in status and "beam" not in status, status
    assert "the best picked in 1 comparison ·" in status, status
    assert "1 judge call" in render(result.text, final=True, result=result, view=view).beams_html


def test_think_harder_is_offered_only_where_the_backend_can_run_it() -> None:
    from vlm_demo.errors import UnsupportedError
    from vlm_demo.web.page.handlers import PageError

    backend = ScriptedBackend()
    backend.features = Features(stage_beam=False)
    blocks = DemoUI(Answers(backend, Config(max_batch_size=4), Metrics())).build().blocks.values()  # type: ignore[arg-type]
    by_id = {b.elem_id: b for b in blocks if getattr(b, "elem_id", None)}
    assert by_id["think"].visible is False and by_id["beams"].interactive is False
    error = PageError(UnsupportedError("Think harder needs continuous batching; this server runs --batching dynamic."))
    assert error.title == "Not available on this server"


def test_gradio_runs_a_handler_for_every_answer_the_engine_holds_and_idles_quietly(page: DemoUI) -> None:
    """Gradio runs at most ``max_threads`` events at once (40 unless set) and its idle queue polls every
    millisecond: the page lifts the first to every answer the engine can hold (running or waiting) and slows
    the second. The attributes it sets are Gradio's own (private): if an upgrade renames them, this fails
    rather than the settings silently doing nothing."""
    import inspect

    from gradio import queueing

    from vlm_demo.web.page.layout import QUEUE_POLL_S

    demo = page.build()
    limit = page.config.max_batch_size + page.config.max_queue
    assert demo.max_threads == demo._queue.max_thread_count == limit
    streaming = [fn for fn in demo.fns.values() if fn.api_name in ("ask", "ask_page")]
    assert streaming and all(fn.concurrency_limit == limit for fn in streaming)
    assert demo._queue.sleep_when_free == QUEUE_POLL_S and demo._queue.progress_update_sleep_when_free == 1.0
    source = inspect.getsource(queueing.Queue)
    assert "self.sleep_when_free)" in source and "self.progress_update_sleep_when_free)" in source


def test_think_harder_lists_identical_candidates_once_with_their_numbers() -> None:
    """Issue 30: eight candidates, seven the same, read as 28 lines of "(same as 1)"; now one line per text."""
    from vlm_demo.results import BeamView, StageChoice
    from vlm_demo.web.page.render import beams_html, numbers

    same, other = "The image is blue.", "The image is dark blue."
    choice = StageChoice("conclusion", (same, same, same, same, other, same, same, same), winner=4)
    shown = beams_html(BeamView((choice,), "done", 8, judge_calls=3))
    assert shown.count("<li") == 2 and "same as" not in shown, shown
    assert shown.count(same) == 1 and "1–4, 6–8." in shown and "7 identical" in shown
    winner = shown[shown.index('class="cand winner"') :]
    assert winner.startswith('class="cand winner" data-count="1"') and other in winner.split("</li>")[0]
    assert "8 candidates · candidate 5 chosen" in shown
    # A candidate that never closed its stage is told apart from the same text that did.
    unclosed = StageChoice("summary", ("a", "a", "a"), closed=(True, False, True))
    assert beams_html(BeamView((unclosed,), "writing", 3)).count("<li") == 2
    assert [numbers(i) for i in ([0], [0, 1], [0, 1, 2, 5], [1, 3, 4, 5, 6])] == ["1", "1, 2", "1–3, 6", "2, 4–7"]


def test_the_stage_strip_carries_each_arrow_with_the_step_it_points_to() -> None:
    """On a phone the strip wraps; a line must not end on an arrow (each ``hop`` wraps as one piece)."""
    import re

    from vlm_demo.cot.stages import parse_stages
    from vlm_demo.web.page.render import tracker_html

    strip = tracker_html(parse_stages("<SUMMARY>a</SUMMARY><CAPTION>b"), "caption")
    hops = re.findall(r'<span class="hop"><span class="arrow">→</span><span class="step [a-z]+">([A-Z]+)', strip)
    assert hops == ["CAPTION", "REASONING", "CONCLUSION"] and strip.count("→") == 3, strip


def test_a_remote_model_servers_failure_reads_as_plainly_as_the_local_ones(page: DemoUI, caplog) -> None:
    """Through Triton a visitor read "[StatusCode.UNAVAILABLE] failed to connect to all addresses…"; now the
    sentence the local path would give, under the same code, with the details in the operator's log."""
    from vlm_demo.errors import BackendTimeoutError, BackendUnavailableError, InvalidRequestError, QueueFullError
    from vlm_demo.web.page.render import for_visitor

    down = BackendUnavailableError(
        "Triton at grpc://10.0.0.5:8001 is unreachable ([StatusCode.UNAVAILABLE] failed to connect to all "
        "addresses; last error: UNKNOWN: ipv4:10.0.0.5:8001). Is the server running?"
    )
    shown = for_visitor(down, remote=True)
    assert type(shown) is BackendUnavailableError and str(shown).startswith("The model server is not reachable")
    assert for_visitor(down, remote=False) is down, "the local path's own messages are already plain"
    slow = for_visitor(BackendTimeoutError("Triton at http://h:8000 did not answer within 120 s."), remote=True)
    assert "Triton" not in str(slow) and slow.code == "backend_timeout"
    for own in (InvalidRequestError("Please type a question about the image."), QueueFullError("Server busy.")):
        assert for_visitor(own, remote=True) is own, "the visitor's own errors already say what to do"

    page.backend.remote = True
    try:
        with caplog.at_level("WARNING", logger="vlm_demo.web.page.handlers"):
            updates = asyncio.run(_ask_page(page, lambda s: s.write("<SUMMARY>a"), lambda s: s.fail(down)))
    finally:
        page.backend.remote = False
    status = _statuses(updates)[-1]
    assert status == "⚠ Model unavailable: The model server is not reachable right now; please try again in a minute."
    assert "StatusCode.UNAVAILABLE" in caplog.text and "10.0.0.5" in caplog.text, "the operator still gets the details"
    assert updates[-1][-1].asked == "What colour?", "a server failure can be retried"


def test_zerogpus_refusal_mid_answer_is_the_status_line_in_its_own_words_over_the_text_so_far(page: DemoUI) -> None:
    """A ZeroGPU call aborted mid-answer (or refused at its start: out of quota): the status line gives ZeroGPU's
    title and message, the panels keep what was written, and Retry is offered (waiting can help)."""
    from vlm_demo.errors import ZeroGPUError

    aborted = ZeroGPUError("GPU task aborted", "ZeroGPU worker error")
    updates = asyncio.run(_ask_page(page, lambda s: s.write("<SUMMARY>a plan"), lambda s: s.fail(aborted)))
    assert _statuses(updates)[-1] == "⚠ ZeroGPU worker error: GPU task aborted"
    assert updates[-1][0] == "a plan", "the panels keep what was written"
    assert updates[-1][-1].asked == "What colour?", "Retry is offered"


def test_where_each_call_borrows_a_gpu_ask_batch_runs_one_batch_at_a_time() -> None:
    """On ZeroGPU each GPU call batches only its own requests: /ask_batch gets a lane of one, so the requests that
    arrive while a batch runs gather into the next; /ask keeps a handler for every answer."""
    backend = ScriptedBackend()
    backend.features = Features(gpu_per_call=True)
    demo = DemoUI(Answers(backend, Config(max_batch_size=4), Metrics())).build()  # type: ignore[arg-type]
    by_name = {fn.api_name: fn for fn in demo.fns.values()}
    batch, ask = by_name["ask_batch"], by_name["ask"]
    assert (batch.concurrency_limit, batch.max_batch_size) == (1, 4) and batch.concurrency_id != ask.concurrency_id
    assert ask.concurrency_limit == 4 + Config().max_queue


def test_retry_is_not_offered_after_an_input_error(page: DemoUI) -> None:
    async def ask(question: str) -> list[tuple]:
        return [u async for u in page.handlers.ask_page(RED, question, 64, 0.0, 1.0)]

    rejected = asyncio.run(ask("   "))[-1][-1]
    retry, _, box = DemoUI.after_answer(rejected, "   ")
    assert retry["visible"] is False and "value" not in box, "the box keeps what the visitor typed, to mend it"


def test_an_answered_question_leaves_the_box_and_stays_above_the_panels() -> None:
    """Left in the box, Enter asked the same question again as a follow-up."""
    from vlm_demo.web.page.conversation import Conversation
    from vlm_demo.web.page.render import history_html

    answered = Conversation().finished("What <colour>?", "<CONCLUSION>red</CONCLUSION>")
    retry, new_chat, box = DemoUI.after_answer(answered, "")
    assert "value" not in box and retry["visible"] and new_chat["visible"], "answered: the box stays empty"
    assert "value" not in DemoUI.after_answer(answered, "And the")[2], "typed while it streamed: kept"
    stopped = answered.unfinished("And now?")
    assert DemoUI.after_answer(stopped, "")[2]["value"] == "And now?", "a stopped question comes back"
    assert "value" not in DemoUI.after_answer(stopped, "Or")[2], "unless the visitor typed anew"
    shown = DemoUI.shown_history(answered, "And the border?")
    assert shown.index("What &lt;colour&gt;?") < shown.index('class="asking"') and "And the border?" in shown
    assert history_html((), asking="  ") == "" and "Why?" in history_html((), asking="Why?")


def test_a_think_harder_answer_through_a_remote_engine_says_its_rows_are_the_visitors() -> None:
    """A remote engine reports its batch, not a search view: the page says what it asked for, as locally."""
    from vlm_demo.request import SamplingParams
    from vlm_demo.results import GenerationResult
    from vlm_demo.web.page.render import render, searched_beams

    answer = "<SUMMARY>s</SUMMARY><CAPTION>c</CAPTION><REASONING>r</REASONING><CONCLUSION>red</CONCLUSION>"
    result = GenerationResult(answer, "stop", 2, 10, 61, 0.0, 0.1, 0.6)
    beams = searched_beams(SamplingParams(reasoning="stage-beam", beams=2).validated(2048))
    status = render(answer, final=True, result=result, beams=beams).status
    assert status.startswith("Done · Thought harder: 2 candidates per stage, written side by side · 61 tokens"), status
    assert searched_beams(SamplingParams(beams=2).validated(2048)) == 0
    assert render(answer, final=True, result=result).status.startswith("Done · batch of 2 · ")


def test_the_api_page_example_is_a_picture_shipped_with_the_demo(api) -> None:
    """Gradio's default example is a picture on the internet; ours is in the clone, so the snippets run offline."""
    image, question = api["/ask"]["parameters"][:2]
    assert image["example_input"]["url"] == "assets/tiny/red.png" and (ROOT / "assets/tiny/red.png").is_file()
    assert question["example_input"] == "What colour is this image?"
