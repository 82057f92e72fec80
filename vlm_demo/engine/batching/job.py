"""One request's state inside the engine: its inputs, sampling parameters and progress — plain data.

The engine thread writes into it (``push_text`` / ``finish`` / ``fail``); what a client sees travels
in the engine's :class:`~vlm_demo.engine.ipc.messages.Step` messages to the client's handle
(:mod:`~vlm_demo.engine.ipc.handles`), in this process or behind a pipe alike. A request a client asked
for has its ``rid`` (the handle's id) and reports into the engine's ``outbox`` whenever it has news; the
rows a Think-harder search runs for itself (candidates, judge calls) have neither. :class:`Search` is the
one description of such a search (:class:`~vlm_demo.engine.search.beam.StageBeam`) that the request, the plan and
the running batch share.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

from vlm_demo.errors import DemoError, RequestCancelledError
from vlm_demo.prompt import Turn
from vlm_demo.request import STAGE_BEAM, ValidParams, ValidRequest
from vlm_demo.results import BeamView, GenerationResult

_ids = itertools.count(1)

STOP_TEXT = "</CONCLUSION>"  # an answer's rows stop here even if the model writes on


class Search(Protocol):
    """A stage-beam search (:class:`~vlm_demo.engine.search.beam.StageBeam`) as every other part of the engine sees it:
    its request reads its view, the plan asks for its rows, and the running batch reports its candidates.
    The one description of it; here because every part that holds one imports this module (a ``row`` is a
    :class:`~vlm_demo.engine.batching.rows.Row`, a ``snapshot`` a :class:`~vlm_demo.engine.kv.page_table.Snapshot`:
    both modules import this one, so they are not named in the types)."""

    request: Request  # the visitor's: the winners' text streams into it

    @property
    def speculating(self) -> bool: ...

    def rows_wanted(self, spare: bool = True) -> int: ...

    def candidate_done(self, row: Any, snapshot: Any) -> None: ...

    def restart_stage(self, error: DemoError) -> None: ...

    def view(self) -> BeamView: ...


@dataclass
class Resume:
    """A row taken out of the running batch to give a waiting client its share: what it needs to continue
    exactly where it stopped (its streamer holds the text, the stage tracker and the decoder's state)."""

    streamer: Any  # its ``RowStreamer``
    draws: int  # the sampler's draws so far: the next token is draw ``draws``, as it would have been


class Preparer(Protocol):
    """What turns a picture, a question and its earlier turns into the model's inputs (:meth:`Worker.prepare`)."""

    def prepare(self, image: Any, question: str, history: Sequence[Turn] = ()) -> dict[str, Any]: ...


@dataclass(eq=False)
class Request:
    """A request moving through the engine (the engine thread's; ``cancel`` may come from any thread)."""

    stop_text: ClassVar[str | re.Pattern[str]] = STOP_TEXT  # where its row stops, besides end of turn and limits
    staged: ClassVar[bool] = True  # an answer in the four stages (the stage structure applies); False: free text
    visible: ClassVar[bool] = True  # a client's answer (False: a Think-harder search's own candidate or judge)

    image: Any  # PIL.Image.Image, RGB
    question: str
    params: ValidParams
    request_id: int = field(default_factory=lambda: next(_ids))
    inputs: dict[str, Any] = field(default_factory=dict)  # processor output for this one request
    arrival: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded so far, including text already sent
    sent_chars: int = 0  # how much of ``text`` the client has been sent (kept across retries)
    sent_tokens: int = 0  # how many of ``token_ids`` the client has been sent
    batch_size: int = 0
    started: float | None = None
    first_token: float | None = None
    beam: Search | None = None  # its stage-beam search once admitted in that mode
    client: str = ""  # who asked (fair share, the per-client cap)
    image_key: str = ""  # its picture's digest (the image-state cache)
    vision: Any = None  # its picture's projected states, encoded while it waited (held until its prefill)
    resume: Resume | None = None  # set while a preempted row waits to continue where it stopped
    cut_stage: str | None = None  # the stage the CONCLUSION's reserve cut short (stage structure)
    rid: int | None = None  # the client's handle (None: a search's own row)
    outbox: list[Request] | None = None  # where it reports news (the engine's; None: nobody listens)
    result: GenerationResult | None = None
    error: DemoError | None = None
    cancelled: bool = False
    reported: bool = False  # in the outbox now
    serial_beams: bool = False  # benchmarks only: its stage-beam search runs candidates and judges one at a time

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    @property
    def finish_reason(self) -> str | None:
        if self.result is not None:
            return self.result.finish_reason
        return self.error.code if self.error is not None else None

    @property
    def prompt_tokens(self) -> int:
        ids = self.inputs.get("input_ids")
        return int(ids.shape[-1]) if ids is not None else 0

    @property
    def input_tokens(self) -> int:
        """Tokens its prefill takes: the prompt, and for a preempted row the tokens it had already written
        (all but the last, which is its next input)."""
        return self.prompt_tokens + (max(0, len(self.token_ids) - 1) if self.resume is not None else 0)

    @property
    def tiles(self) -> int:
        """Tiles of its picture its answer sees (what its image states take), from the processor's mask."""
        cross = self.inputs.get("cross_attention_mask")
        if cross is None:
            return 0
        return int((cross[0, -1] > 0).sum()) or int(cross.shape[-1] * cross.shape[-2])

    def prefill_inputs(self) -> dict[str, Any]:
        """The processor's inputs for its prefill; a preempted row continues after what it wrote, every
        new position seeing the image as the prompt's last one does."""
        if self.resume is None or len(self.token_ids) < 2:
            return self.inputs
        import torch  # the engine's side only

        written = torch.tensor([self.token_ids[:-1]], dtype=self.inputs["input_ids"].dtype)
        cross = self.inputs["cross_attention_mask"]
        extra = cross[:, -1:].expand(1, written.shape[1], *cross.shape[2:])
        ids = torch.cat([self.inputs["input_ids"], written], dim=1)
        return {
            **self.inputs,
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "cross_attention_mask": torch.cat([cross, extra], dim=1),
        }

    @property
    def rows_needed(self) -> int:
        """Rows of the running batch it takes at once: one, or a stage-beam search's candidates."""
        p = self.params
        return 1 if p.reasoning != STAGE_BEAM or self.serial_beams else p.beams

    def beam_view(self) -> BeamView | None:
        """Where its stage-beam search stands (``None`` in the normal mode or before it starts)."""
        return self.beam.view() if self.beam is not None else None

    def cancel(self) -> None:
        """Stop now (from any thread); the engine drops the row at its next step."""
        self.cancelled = True
        self.fail(RequestCancelledError("Request cancelled."))

    # ---- engine side -------------------------------------------------------------------------
    def _report(self) -> None:
        if self.outbox is not None and not self.reported:
            self.reported = True
            self.outbox.append(self)

    def push_text(self, full_text: str) -> None:
        """Record the row's full decoded text (the client is sent what it has not seen, with the next Step)."""
        self.text = full_text
        if self.first_token is None:
            self.first_token = time.monotonic()
        self._report()

    def finish(self, reason: str) -> None:
        now = time.monotonic()
        result = GenerationResult(
            text=self.text,
            finish_reason=reason,
            batch_size=self.batch_size,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=len(self.token_ids),
            queue_s=(self.started or now) - self.arrival,
            ttft_s=(self.first_token or now) - self.arrival,
            total_s=now - self.arrival,
            beam=self.beam_view(),
            cut_stage=self.cut_stage,
        )
        with self._lock:
            if self.done:
                return
            self.result = result
        self._report()

    def fail(self, error: DemoError) -> bool:
        """End with an error (no-op if already ended); True if this call ended it."""
        with self._lock:
            if self.done:
                return False
            self.error = error
        self._report()
        return True

    def tokens(self) -> int | None:
        return len(self.token_ids)

    def reset_progress(self) -> None:
        """Forget generated tokens before a retry; ``sent_chars`` stays so the client sees no repeat."""
        self.token_ids = []
        self.text = ""


R = TypeVar("R", bound=Request)


def make_request(valid: ValidRequest, worker: Preparer, kind: type[R] = Request) -> R:  # type: ignore[assignment]
    """The engine's request for one that passed the door, its inputs prepared on the caller's thread
    (so a picture the processor cannot take fails alone, before it joins a batch)."""
    if not isinstance(valid, ValidRequest):
        raise TypeError(f"the engine takes a ValidRequest (vlm_demo.request.validate_request), not {type(valid)}")
    request = kind(image=valid.image, question=valid.question, params=valid.params)
    request.client, request.image_key, request.serial_beams = valid.client, valid.image_key, valid.serial_beams
    request.inputs = worker.prepare(valid.image, valid.question, valid.history)
    return request
