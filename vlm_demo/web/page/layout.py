"""The Gradio page: upload, question, four live chain-of-thought panels, and the two API endpoints.

This module builds components and wires events to :mod:`vlm_demo.web.page.handlers` (which validate at the
door and talk to a :class:`~vlm_demo.backends.base.Backend`); it holds no model logic.

- ``/ask`` streams the four stages into their panels (raw tags never reach a renderer). Gradio
  cannot batch generators, so batching happens in *our* engine: the handler's ``concurrency_limit``
  lets several visitors' requests reach the engine at once.
- ``/ask_batch`` is Gradio's own batch mode (``batch=True``) for API clients that want final answers.

Both take :data:`~vlm_demo.web.page.contract.INPUTS` and return :class:`~vlm_demo.web.page.contract.Outputs`; the
components are built and listed by those names, and every output component is labelled with its name
(where that name would clash with Gradio's own translations, :data:`BROWSER_LABELS`, only in the browser), so
the "Use via API" page and clients say it too. Styles and scripts are files in ``static/``.

The page's own Ask (button and Enter) runs ``handlers.ask_page``, not ``/ask``: the same stream, but a
request error is shown once instead of a toast plus an error mark on every output: in the status line, or for an
input the door refused (the picture, the question), on the error line right under that input.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import gradio as gr

from vlm_demo import ASSETS_DIR
from vlm_demo.cot.stages import parse_stages
from vlm_demo.request import DEFAULTS, KNOBS, STAGE_BEAM, has_image
from vlm_demo.web.answers import Answers
from vlm_demo.web.page import contract
from vlm_demo.web.page.contract import INPUTS, OPTIONAL_INPUTS, OUTPUTS, PANEL_ELEM_IDS, PANELS
from vlm_demo.web.page.conversation import Conversation
from vlm_demo.web.page.handlers import Handlers
from vlm_demo.web.page.render import cleared, history_html, tracker_html

log = logging.getLogger(__name__)

CONCURRENCY_ID = "engine"  # /ask and /ask_batch share one limit: they share one model
GPU_BATCH_ID = "gpu_batch"  # on ZeroGPU /ask_batch has a limit of its own (each batch is one GPU call)
PANEL_LINES = {"summary": 2, "caption": 3, "reasoning": 6, "conclusion": 2}
QUEUE_POLL_S = 0.05  # how often Gradio's idle queue looks for new events (its own default on Windows)

EXAMPLES = [
    ("astronaut.jpg", "What is the person holding, and what does the background tell you about her job?"),
    ("chelsea.jpg", "What animal is this, and what is it doing?"),
    ("coffee.jpg", "What drink is in the cup, and what is the cup standing on?"),
    ("coins.jpg", "How many coins are in the image?"),
    ("rocket.jpg", "What is happening in this photo, and what time of day is it?"),
]
TINY_EXAMPLES = [
    ("tiny/red.png", "What colour is this image?"),
    ("tiny/blue.png", "Describe this picture in detail."),  # "detail" makes the tiny model answer at length
    ("tiny/yellow.png", "What do you see?"),
]
PHOTOS_WITH_TINY = "Real photos: for the real model (the tiny test model only names a colour)"
QUESTION_INFO = "Enter asks · Shift+Enter starts a new line"
FOLLOW_UP_INFO = "Ask a follow-up about this image: the model reads the answers so far · Enter asks"

# Gradio's page looks every label up in its translations (svelte-i18n), where "status" is a group of messages, not a
# message: a component labelled "status" logged an i18n warning on every page load. The status line is labelled
# otherwise on the page, and Page.get_api_info gives its output the contract's name again.
BROWSER_LABELS = {"status": "status line"}

STATIC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "static")


def _static(name: str) -> str:
    """A file of ``static/`` (CSS, or a JS function with ``//`` comment lines above it, which are dropped)."""
    with open(os.path.join(STATIC_DIR, name), encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    return "\n".join(line for line in lines if not line.startswith("//"))


CSS = _static("page.css")
SHOW_ANSWER_JS = _static("show_answer.js")
OPEN_API_JS = _static("open_api.js")
THEME = gr.themes.Soft(primary_hue="indigo")
# The example the "Use via API" page's snippets send: a picture shipped with the demo, by its path in the clone
# (where the README's snippets run too), and a question the tiny model answers; Gradio's own default is a
# picture on the internet, which an offline machine cannot fetch.
API_EXAMPLE_IMAGE = "assets/tiny/red.png"
API_EXAMPLE_QUESTION = "What colour is this image?"


def with_api_example(component: Any, example: Any) -> Any:
    """``component`` with ``example`` as what the API page's snippets send for it. Set on the instance: a
    subclass of a Gradio component would make Gradio write a ``.pyi`` stub next to this module on import."""
    component.example_payload = lambda: example
    component.example_value = lambda: example.get("path") if isinstance(example, dict) else example
    return component


class Page(gr.Blocks):
    """``gr.Blocks`` that accepts calls leaving out an endpoint's optional trailing inputs.

    gradio_client fills them in from the API description, but a raw HTTP or JavaScript client that
    sends the original five values would be refused by Gradio's own count check; here the missing
    ones arrive as ``None`` and the handlers read that as the defaults.
    """

    def validate_inputs(self, block_fn: Any, inputs: list[Any]) -> None:
        missing = len(block_fn.inputs) - len(inputs)
        if 0 < missing <= len(OPTIONAL_INPUTS) and block_fn.api_name in (contract.ASK, contract.ASK_BATCH):
            inputs.extend([None] * missing)
        super().validate_inputs(block_fn, inputs)

    def get_api_info(self, all_endpoints: bool = False, page: str | None = None) -> Any:
        """Gradio's API description (the API page, clients, MCP), with every output named as in the contract:
        the components labelled otherwise for the browser (:data:`BROWSER_LABELS`) get their names back."""
        info = super().get_api_info(all_endpoints, page)
        names = {shown: name for name, shown in BROWSER_LABELS.items()}
        for endpoints in (info["named_endpoints"], info["unnamed_endpoints"]):
            for endpoint in endpoints.values():
                for output in endpoint["returns"]:
                    output["label"] = names.get(output["label"], output["label"])
        return info


def control(name: str, cap: int, **layout: Any) -> gr.Slider | gr.Radio:
    """The page control of a sampling field, from its knob (:mod:`vlm_demo.request`): its range (the server's
    ``--max-new-tokens`` where the knob says so), default, step and label; ``layout`` places it."""
    knob = KNOBS[name]
    if knob.choices:
        return gr.Radio(list(knob.choices), value=DEFAULTS[name], label=knob.label, elem_id=name, **layout)
    low, high = knob.bounds(cap)  # type: ignore[misc]  # every slider's knob has a range
    low = knob.page_low if knob.page_low is not None else low
    default = min(DEFAULTS[name], high)
    precision: dict[str, Any] = {"precision": 0} if knob.whole else {}  # the API page then types it as an integer
    return gr.Slider(low, high, default, step=knob.step, label=knob.label, elem_id=name, **precision, **layout)


class DemoUI:
    """The page and its handlers, over the answer service."""

    def __init__(self, answers: Answers, notice: str | None = None) -> None:
        self.backend = answers.backend
        self.config = answers.config
        self.notice = notice
        self.handlers = Handlers(answers)

    def upload_checked(self, image: Any) -> tuple[Any, ...]:
        """A new image (or none): the previous answer cleared, and a new conversation (the earlier turns were
        about the old picture). A file that is no picture is taken out again (no broken preview; Ask then
        asks for an image) and its problem shown next to it, once. Taking it out fires this again with no
        image, which leaves the message up; a good image or Clear takes it away."""
        message = self.handlers.check_upload(image)
        if message:
            upload_error = gr.update(value=f"⚠ {message}", visible=True)
        else:
            upload_error = gr.update(value="", visible=False) if has_image(image) else gr.update()
        return (None if message else gr.update(), upload_error, *self._new_conversation(), *cleared())

    def cleared_page(self, request: gr.Request = None) -> tuple[Any, ...]:  # type: ignore[assignment]
        """The Clear button: this visitor's answer stopped (its model row freed at once), then no image,
        no question, no message, no conversation, empty panels."""
        self.handlers.stop(request)
        return (None, gr.update(value="", visible=False), *self._new_conversation(question=""), *cleared())

    def new_conversation(self, request: gr.Request = None) -> tuple[Any, ...]:  # type: ignore[assignment]
        """The New conversation button: like Clear, but the image stays, and so does what the question box holds (Ask
        emptied it: a question typed since)."""
        self.handlers.stop(request)
        return (*self._new_conversation(), *cleared())

    @staticmethod
    def _new_conversation(question: str | None = None) -> tuple[Any, ...]:
        """Updates for (conversation, history, retry, new conversation, question, the image's and the question's
        error lines): no earlier turns, no earlier Ask's input error (and the question box emptied when
        ``question`` is "")."""
        hidden = gr.update(visible=False)
        box = gr.update(info=QUESTION_INFO) if question is None else gr.update(info=QUESTION_INFO, value=question)
        return (None, "", hidden, hidden, box, "", "")

    @staticmethod
    def shown_history(conversation: Any, question: Any) -> str:
        """As a new question starts: the earlier turns above the live panels (those the model reads), then
        the question itself."""
        talk = Conversation.of(conversation)
        return history_html(talk.history(), talk.dropped, question if isinstance(question, str) else "")

    @staticmethod
    def after_answer(conversation: Any, box: Any) -> tuple[Any, ...]:
        """Once an answer ended: Retry for the question just asked (not after an input error: the answer
        handler then leaves no question to retry), New conversation, and a hint that the next question
        follows on. The question left the box as its answer started (it stays above the panels, and Enter
        does not ask it again as a follow-up); one that was stopped or failed comes back, to be asked again or
        mended, but only into an empty ``box``: what the visitor typed meanwhile is never overwritten."""
        talk = Conversation.of(conversation)
        hint = FOLLOW_UP_INFO if talk.turns else QUESTION_INFO
        back = talk.asked and not talk.answered and not (box if isinstance(box, str) else "")
        update = gr.update(info=hint, value=talk.asked) if back else gr.update(info=hint)
        return gr.update(visible=bool(talk.asked)), gr.update(visible=bool(talk.turns)), update

    def retry(self, conversation: Any) -> tuple[Any, ...]:
        """Retry: the last question back in the box, its answer forgotten, ready to be asked again."""
        talk = Conversation.of(conversation).retry()
        return talk.asked, talk, history_html(talk.history(), talk.dropped, talk.asked)

    # ---- the page -----------------------------------------------------------------------------------
    def build(self) -> gr.Blocks:
        weights = self.backend.health().weights  # "int8" etc.: said next to the model's name
        with Page(title="LLaVA-CoT demo") as demo:
            gr.Markdown(
                "# LLaVA-CoT · Llama-3.2V-11B-cot\n"
                "Upload an image and ask about it. The model thinks in four stages, shown live as it writes: "
                "**SUMMARY** (its plan) → **CAPTION** (what it sees) → **REASONING** → **CONCLUSION** (the answer).  \n"
                f"Model: `{self.backend.model}` · backend: `{self.backend.name}`"
                + (f" · {weights} weights" if weights else ""),
                elem_id="header",
            )
            gr.Markdown(self.notice or "", elem_id="banner", visible=bool(self.notice))
            conversation = gr.State(None)  # this tab's Conversation: the earlier turns about the image
            # Inputs, then the answer: on a phone the columns stack in this order, so the panels come right
            # after the Ask button and the examples come last (below the row).
            with gr.Row(equal_height=False):
                with gr.Column(scale=2, min_width=320):
                    given, controls = self._inputs()
                with gr.Column(scale=3, min_width=360):
                    controls["history"] = gr.HTML("", elem_id="history")  # earlier turns, collapsed
                    shown: dict[str, Any] = {}
                    shown["stages_html"] = gr.HTML(
                        tracker_html(parse_stages(""), None), label="stages_html", elem_id="stages"
                    )
                    shown["status"] = gr.Markdown("", label=BROWSER_LABELS["status"], elem_id="status")
                    for stage, elem_id in zip(PANELS, PANEL_ELEM_IDS, strict=True):
                        shown[stage] = gr.Textbox(
                            label=stage,  # the API's output name; CSS shows it in capitals as the heading
                            elem_id=elem_id,
                            elem_classes=["stage"],
                            lines=PANEL_LINES[stage],
                            max_lines=40,
                            interactive=False,
                            autoscroll=True,
                            buttons=["copy"],
                        )
                    shown["extra"] = gr.Textbox(label="extra", visible=False, elem_id="p_extra")  # the strip shows it
                    shown["beams_html"] = gr.HTML("", label="beams_html", elem_id="beams_view")
                    with gr.Accordion("Raw model output", open=False, elem_id="raw_box"):
                        shown["raw"] = gr.Textbox(
                            label="raw", show_label=False, elem_id="raw", lines=8, interactive=False, buttons=["copy"]
                        )
            self._examples(given["image"], given["question"])
            self._wire(demo, given, [shown[name] for name in OUTPUTS], controls, conversation)
        limit = self._concurrency_limit()
        # Gradio runs at most ``max_threads`` events at once over the whole app (40 by default), whatever the
        # events' own limits: every answer the engine can hold needs its handler running.
        demo.max_threads = limit
        demo.queue(max_size=self.config.max_queue, default_concurrency_limit=limit)
        # Gradio's queue looks for new events every millisecond and for progress bars every 10 ms, even when
        # idle: ~5% of a core for nothing. New events every 50 ms (at most 50 ms more before an answer starts,
        # whose model work takes seconds) and progress every second (the page shows no gr.Progress bars) cost a
        # tenth of that.
        demo._queue.sleep_when_free = QUEUE_POLL_S
        demo._queue.progress_update_sleep_when_free = 1.0
        return demo

    def _inputs(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The input components by their contract name, and the other controls by role (the upload's error
        line, the buttons)."""
        given: dict[str, Any] = {}
        controls: dict[str, Any] = {}
        given["image"] = with_api_example(
            gr.Image(type="filepath", label="Image", elem_id="img", sources=["upload", "clipboard"], height=300),
            {
                "path": API_EXAMPLE_IMAGE,
                "url": API_EXAMPLE_IMAGE,  # the snippets name a file by its url
                "orig_name": os.path.basename(API_EXAMPLE_IMAGE),
                "meta": {"_type": "gradio.FileData"},
            },
        )
        # The upload's own problem (shown as the file is chosen), then Ask's refusal of the picture (handlers.ask_page
        # writes it and the question's; CSS hides an empty one): in the error colour, right under what to fix.
        controls["upload_error"] = gr.Markdown("", elem_id="upload_error", elem_classes=["input-error"], visible=False)
        controls["image_error"] = gr.Markdown("", elem_id="image_error", elem_classes=["input-error"])
        given["question"] = with_api_example(
            gr.Textbox(
                label="Question",
                info=QUESTION_INFO,
                elem_id="q",
                lines=1,  # one line: Enter submits (Gradio's multi-line boxes submit only on Shift+Enter)
                max_lines=6,
                max_length=self.config.max_question_chars,
                placeholder="Ask something about the image…",
            ),
            API_EXAMPLE_QUESTION,
        )
        controls["question_error"] = gr.Markdown("", elem_id="question_error", elem_classes=["input-error"])
        think = self.backend.features.stage_beam  # not offered where the server cannot run it
        cap = self.config.max_new_tokens
        with gr.Row(equal_height=True, elem_id="think", visible=think):
            given["reasoning"] = control("reasoning", cap, info=KNOBS["reasoning"].help, scale=3)
            # Normal is the default: the count only matters with Think harder
            given["beams"] = control(
                "beams", cap, info="With Think harder", interactive=False, scale=2, elem_classes=["ends"]
            )
        with gr.Row():
            # min_width: Ask, Stop and Clear share one line on a 390-px phone (Gradio's default 160 px wrapped Clear)
            controls["ask"] = gr.Button("Ask", variant="primary", elem_id="ask", scale=2, min_width=100)
            controls["stop"] = gr.Button("Stop", variant="stop", elem_id="stop", min_width=80)
            controls["clear"] = gr.Button("Clear", variant="secondary", elem_id="clear", min_width=80)
        with gr.Row(elem_id="turn_buttons"):
            controls["retry"] = gr.Button("↻ Retry", size="sm", elem_id="retry", visible=False)
            controls["new_chat"] = gr.Button("New conversation", size="sm", elem_id="new_chat", visible=False)
        with gr.Accordion("Advanced", open=False, elem_id="advanced"):
            for name in ("max_new_tokens", "temperature", "top_p"):
                given[name] = control(name, cap, elem_classes=["ends"])  # end labels kept on phones
        return given, controls

    def _examples(self, image: gr.Image, question: gr.Textbox) -> None:
        with gr.Row(equal_height=False):
            if self.notice:
                gr.Examples(
                    [[os.path.join(ASSETS_DIR, f), q] for f, q in TINY_EXAMPLES],
                    inputs=[image, question],
                    label="Examples for the tiny test model (solid colours)",
                    elem_id="examples_tiny",
                )
            gr.Examples(
                [[os.path.join(ASSETS_DIR, f), q] for f, q in EXAMPLES],
                inputs=[image, question],
                label=PHOTOS_WITH_TINY if self.notice else "Examples",
                elem_id="examples",
            )

    def _concurrency_limit(self) -> int:
        """A handler for every answer the engine can hold, running or waiting. Gradio's own queue serves
        first come, first served; the engine's queue serves clients in turn (fair share) and refuses a
        client's excess at once, so requests must reach it rather than wait in Gradio's. Handlers are
        cheap (async; the /ask_batch ones wait in a thread)."""
        return self.config.max_batch_size + self.config.max_queue

    def _batch_lanes(self) -> dict[str, Any]:
        """How many /ask_batch batches run at once: as many as the engine holds answers, or, where each call borrows
        a GPU of its own (ZeroGPU), one, so that the requests arriving while it runs gather into the next batch."""
        if self.backend.features.gpu_per_call:
            return {"concurrency_id": GPU_BATCH_ID, "concurrency_limit": 1}
        return {"concurrency_id": CONCURRENCY_ID, "concurrency_limit": self._concurrency_limit()}

    def _wire(
        self, demo: gr.Blocks, given: dict[str, Any], outputs: list[Any], controls: dict[str, Any], conversation: Any
    ) -> None:
        for handler in (self.handlers.ask, self.handlers.ask_page, self.handlers.ask_batch):
            contract.check_signature(handler)  # Gradio names the API's parameters after the handler's
        inputs = [given[name] for name in INPUTS]
        image, question = given["image"], given["question"]
        history, retry, new_chat = controls["history"], controls["retry"], controls["new_chat"]
        streaming: dict[str, Any] = dict(
            preprocess=False,  # our own caps and messages for the image, not PIL's (see images.py)
            postprocess=False,  # plain strings; Gradio's per-output postprocessing doubled the web CPU per answer
            concurrency_id=CONCURRENCY_ID,
            concurrency_limit=self._concurrency_limit(),
            show_progress="minimal",
        )
        # The public /ask (raises gr.Error for API clients) sits on a hidden button; the page's Ask, Enter and
        # Retry run ask_page, which shows an error once, in the status line, and carries the conversation.
        gr.Button(visible=False, elem_id="ask_api").click(
            self.handlers.ask, inputs=inputs, outputs=outputs, api_name=contract.ASK, **streaming
        )
        lines = [controls["image_error"], controls["question_error"]]  # in handlers.FIELDS' order
        page_answer: dict[str, Any] = dict(
            inputs=[*inputs, conversation],
            outputs=[*outputs, *lines, question, conversation],
            api_visibility="private",
            **streaming,
        )
        turn_buttons: dict[str, Any] = dict(
            inputs=[conversation, question], outputs=[retry, new_chat, question], queue=False, show_progress="hidden"
        )
        quiet: dict[str, Any] = dict(queue=False, show_progress="hidden", api_visibility="private")
        running = []
        for trigger, name in ((controls["ask"].click, contract.ASK_PAGE), (question.submit, None)):
            # In order: the page runs a trigger's events one after another and waits for a streaming one to
            # end, so the scroll to the answer comes first.
            trigger(None, js=SHOW_ANSWER_JS)
            trigger(self.shown_history, inputs=[conversation, question], outputs=[history], **quiet)
            answer = trigger(self.handlers.ask_page, api_name=name, **page_answer)
            answer.then(self.after_answer, api_visibility="private", **turn_buttons)
            running.append(answer)
        retry.click(None, js=SHOW_ANSWER_JS)
        retried = retry.click(self.retry, inputs=[conversation], outputs=[question, conversation, history], **quiet)
        answer = retried.then(self.handlers.ask_page, **page_answer)
        answer.then(self.after_answer, api_visibility="private", **turn_buttons)
        running.append(answer)
        # Not Gradio's ``cancels=``: it kills the handler before its last update, and an update
        # already in flight could then overwrite the "Stopped" status. Cancelling our stream
        # instead ends the handler normally, and it writes the final state itself.
        controls["stop"].click(self.handlers.stop, queue=False, api_visibility="undocumented")
        # Clear and New conversation stop this visitor's answer like Stop does, and also drop the handler
        # (``cancels=``): its last update must not bring the old answer back.
        fresh = [conversation, history, retry, new_chat, question, *lines]
        controls["clear"].click(
            self.cleared_page,
            outputs=[image, controls["upload_error"], *fresh, *outputs],
            cancels=running,
            **quiet,
        )
        new_chat.click(self.new_conversation, outputs=[*fresh, *outputs], cancels=running, **quiet)
        image.change(
            self.upload_checked,
            inputs=[image],
            outputs=[image, controls["upload_error"], *fresh, *outputs],
            preprocess=False,
            **quiet,  # a quick check: no spinner over every output
        )
        given["reasoning"].change(
            lambda mode: gr.update(interactive=mode == STAGE_BEAM),
            inputs=[given["reasoning"]],
            outputs=[given["beams"]],
            **quiet,
        )
        gr.Button(visible=False).click(
            self.handlers.ask_batch,
            inputs=inputs,
            outputs=outputs,
            api_name=contract.ASK_BATCH,
            batch=True,
            max_batch_size=self.config.max_batch_size,
            preprocess=False,
            **self._batch_lanes(),
        )
        demo.load(None, js=OPEN_API_JS)
        demo.unload(self.handlers.forget_session)
