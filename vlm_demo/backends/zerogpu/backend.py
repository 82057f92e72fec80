"""The web process's side of ZeroGPU: each answer is a call to a ``spaces.GPU``-decorated generator
(:meth:`~vlm_demo.backends.zerogpu.calls.GpuSide.answer`), whose Steps feed this process's handles through the same
:class:`~vlm_demo.engine.ipc.handles.StreamTable` the engine process's pipe feeds.

- ``submit`` (the page's ``/ask``): one answer, one GPU call, on a thread of its own that carries the caller's
  context: the Gradio request, by which ZeroGPU bills the visitor who asked (their ``X-IP-Token``).
- ``run_batch`` (``/ask_batch``, Gradio's batch): the whole batch in one GPU call, on the caller's thread; the
  engine batches it there, Think harder's candidates as rows of the same batch.
- Stop: a cancelled answer's handle ends at once; once every answer of its call has ended the call is closed,
  which ``spaces`` passes to the worker: its rows are stopped, the call returns and the GPU is released.
- ZeroGPU's own refusals (quota spent, a duration past the tier's cap, no GPU free, a worker that died) arrive as
  ``gr.Error``; the call's answers end with them as :class:`~vlm_demo.errors.ZeroGPUError`, in ZeroGPU's words.
- A call with no Gradio request (``/v1``, MCP) has no visitor to bill: refused at once, saying so.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable, Generator

import gradio as gr
import spaces
from gradio.context import LocalContext

from vlm_demo.backends.base import Features, Health
from vlm_demo.backends.zerogpu.calls import GpuSide
from vlm_demo.backends.zerogpu.duration import call_seconds
from vlm_demo.config import Config
from vlm_demo.engine.ipc.handles import EngineStream, StreamTable
from vlm_demo.engine.ipc.messages import Step, Submit
from vlm_demo.errors import DemoError, EngineStoppedError, GenerationError, UnsupportedError, ZeroGPUError
from vlm_demo.request import ValidRequest
from vlm_demo.results import GenerationResult, LoadProgress
from vlm_demo.stream import Listener

log = logging.getLogger(__name__)

NO_VISITOR = (
    "This demo runs on Hugging Face ZeroGPU, which lends a GPU to each answer and bills it to the visitor who asks "
    "on the page; this call comes with no visitor to bill (the OpenAI-compatible /v1 and MCP have none). Ask on "
    "the page, or through its Gradio API (/ask, /ask_batch)."
)


class ZeroGPUBackend:
    """Answers through ZeroGPU calls; the weights are loaded here, the engine only ever in a GPU worker."""

    name = "zerogpu"
    remote = False

    def __init__(self, config: Config, side: GpuSide, notice: str | None = None) -> None:
        self.config = config
        self.model = config.model
        self.notice = notice
        self.features = Features(stage_beam=config.batching == "continuous", gpu_per_call=True)
        self.side = side  # here only to be forked into the GPU workers
        self.table = StreamTable(lambda rid: None)  # a cancelled answer's call notices at its next Step
        self.gpu: Callable[[list[Submit]], Generator[Step, None, None]] = spaces.GPU(side.answer, duration=self.seconds)
        self._closing = False

    @classmethod
    def from_config(cls, config: Config, progress: Callable[[LoadProgress], None] | None = None) -> ZeroGPUBackend:
        """Load the weights as ZeroGPU expects, at start-up in this process (``spaces`` registers them on "cuda"
        and packs them in its start-up hook); raises :class:`~vlm_demo.errors.ModelLoadError`."""
        from vlm_demo.engine.weights.loader import load_worker
        from vlm_demo.models.choice import choose_model

        config, notice = choose_model(config)
        worker = load_worker(config, progress)
        if config.structured_stages:
            _ = worker.grammar  # every token's text (CPU only), built once here rather than in every GPU worker
        return cls(config, GpuSide(config, worker), notice)

    def seconds(self, batch: list[Submit]) -> int:
        """The duration a call asks ZeroGPU for (``spaces.GPU`` calls this with the call's own arguments)."""
        answers = [item.request.params for item in batch]
        return call_seconds(answers, self.config.zerogpu_tokens_per_s, self.config.zerogpu_start_s)

    # ---- Backend interface ----
    def submit(self, request: ValidRequest) -> EngineStream:
        self._admissible()
        stream = self.table.open()
        context = contextvars.copy_context()  # the Gradio request: whom ZeroGPU bills
        thread = threading.Thread(
            target=context.run, args=(self._call, [stream], [request]), name="vlm-gpu-call", daemon=True
        )
        thread.start()
        return stream

    def run_batch(self, items: list[ValidRequest]) -> list[GenerationResult | DemoError]:
        if not items:
            return []
        try:
            self._admissible()
        except DemoError as err:
            return [err] * len(items)
        streams = [self.table.open() for _ in items]
        self._call(streams, items)
        outcomes: list[GenerationResult | DemoError] = []
        for stream in streams:
            try:
                outcomes.append(stream.result(0))
            except DemoError as err:
                outcomes.append(err)
        return outcomes

    def health(self) -> Health:
        """Ready once the weights are loaded; the engine's figures are those the last GPU call reported."""
        return Health(not self._closing, in_flight=len(self.table), engine=self.table.stats)

    def add_listener(self, listener: Listener) -> None:
        self.table.listeners.append(listener)

    def pids(self) -> dict[str, int]:
        return {}  # the GPU workers come and go with ZeroGPU's calls

    def close(self) -> None:
        self._closing = True
        self.table.fail_all(EngineStoppedError("The server shut down before this request finished."))

    # ---- the calls ----
    def _admissible(self) -> None:
        if self._closing:
            raise EngineStoppedError("The server is shutting down; please try again shortly.")
        if LocalContext.request.get(None) is None:
            raise UnsupportedError(NO_VISITOR)

    def _call(self, streams: list[EngineStream], items: list[ValidRequest]) -> None:
        """One GPU call for ``items``: its Steps applied to ``streams`` until each has ended or was cancelled, then
        the call closed (the worker stops what still runs and the GPU is released). Every stream has ended after."""
        steps = self.gpu([Submit(stream.rid, item) for stream, item in zip(streams, items, strict=True)])
        failure: DemoError = GenerationError("The GPU call ended before this answer did; please try again.")
        try:
            for step in steps:
                self.table.apply(step)
                if all(stream.done for stream in streams):
                    break
        except gr.Error as err:  # ZeroGPU's refusals and its workers' failures, in its own words
            log.warning("ZeroGPU: %s: %s", err.title, err.message)
            failure = ZeroGPUError(str(err.message), str(err.title or ""))
        except Exception as err:
            log.exception("a ZeroGPU call failed")
            failure = GenerationError(f"The GPU call failed: {type(err).__name__}: {err}")
        finally:
            steps.close()
        for stream in streams:
            if stream.fail(failure):
                self.table.forget(stream.rid)
