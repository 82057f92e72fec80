"""What ``/v1/responses`` sends back: the response object and its stream of events, as OpenAI defines them.

Pure data and one state machine (:class:`Events`), no I/O. The answer's four stages become two output items:
a ``reasoning`` item whose content (``reasoning_text`` parts) and summary (``summary_text`` parts) hold the
first three stages' text, one part per stage in the order written (SUMMARY, CAPTION, REASONING; tags
removed), and a ``message`` item whose ``output_text`` is the CONCLUSION. Text the model wrote outside the
four stages is not sent (``/v1/chat/completions`` and ``/ask`` show it).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from vlm_demo.cot.stages import parse_stages, split_thinking
from vlm_demo.results import GenerationResult
from vlm_demo.web.api.openai_wire import grown

THINKING = ("summary", "caption", "reasoning")  # the stages the reasoning item holds


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def thinking_and_answer(text: str, final: bool = False) -> tuple[list[str], str]:
    """The first three stages' texts, in the order the model opened them, and the CONCLUSION's text."""
    stages = parse_stages(text, final)
    return [stages.text(s) for s in stages.seen if s in THINKING], stages.conclusion


def status_of(result: GenerationResult) -> tuple[str, dict[str, str] | None]:
    """``completed``, or ``incomplete`` with OpenAI's reason when the token limit cut the answer."""
    if result.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def thinking_tokens(result: GenerationResult) -> int:
    """How many of the answer's tokens are its first three stages (``reasoning_tokens``), estimated: the engine
    counts an answer's tokens, not its stages' (and the web process holds no tokenizer), so the completion tokens
    are shared out by the characters of the thinking and of the CONCLUSION."""
    thinking, answer = split_thinking(result.text, final=True)
    if not answer:
        return result.completion_tokens
    return round(result.completion_tokens * len(thinking) / (len(thinking) + len(answer)))


def usage(result: GenerationResult) -> dict[str, Any]:
    return {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": thinking_tokens(result)},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def reasoning_item(item_id: str, texts: list[str], status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": t} for t in texts],
        "content": [{"type": "reasoning_text", "text": t} for t in texts],
        "encrypted_content": None,
        "status": status,
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """The answer's message; ``text`` None: just added, no content part yet."""
    content = [] if text is None else [output_text(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


@dataclass(frozen=True)
class Reply:
    """One response's identity and the request's settings it echoes, shared by its object and every event."""

    model: str
    settings: dict[str, Any]  # instructions, max_output_tokens, temperature, … as OpenAI's object lists them
    id: str = field(default_factory=lambda: new_id("resp"))
    reasoning_id: str = field(default_factory=lambda: new_id("rs"))
    message_id: str = field(default_factory=lambda: new_id("msg"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict[str, Any]], **end: Any) -> dict[str, Any]:
        """The response object; ``end`` sets ``error``, ``incomplete_details`` and ``usage`` once known."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": False,
            "tool_choice": "none",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "usage": None,
            **self.settings,
            **end,
        }

    def finished(self, result: GenerationResult) -> dict[str, Any]:
        """The whole response for a finished answer."""
        texts, answer = thinking_and_answer(result.text, final=True)
        status, incomplete = status_of(result)
        output = [reasoning_item(self.reasoning_id, texts, "completed"), message_item(self.message_id, answer, status)]
        return self.body(status, output, incomplete_details=incomplete, usage=usage(result))

    def failed(self, code: str, message: str) -> dict[str, Any]:
        return self.body("failed", [], error={"code": code, "message": message})


def sse(event: dict[str, Any]) -> bytes:
    """One server-sent event named by its type, as OpenAI streams a response."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class Events:
    """The stream of one response: each call returns the events the answer so far adds, numbered in order.

    The reasoning item opens at once; a part opens for each thinking stage as the model starts it, its text
    goes out as ``response.reasoning_summary_text.delta`` and ``response.reasoning_text.delta`` (the same text,
    for clients that read either), and all parts close when the CONCLUSION starts; then the message item opens
    and the CONCLUSION goes out as ``response.output_text.delta``. :func:`~vlm_demo.cot.stages.parse_stages` holds back
    half a tag, so no tag is ever sent; text is only ever added, never sent twice.
    """

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.number = 0
        self.stages: list[str] = []  # the thinking stages opened, in order
        self.parts: list[str] = []  # their text sent
        self.answering = False
        self.answer = ""

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return out

    def start(self) -> list[dict[str, Any]]:
        begun = self.reply.body("in_progress", [])
        return [
            self.event("response.created", response=begun),
            self.event("response.in_progress", response=begun),
            self.event("response.output_item.added", output_index=0, item=self._reasoning("in_progress")),
        ]

    def advance(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """The events for the answer's text so far."""
        stages = parse_stages(text, final)
        out: list[dict[str, Any]] = []
        if not self.answering:
            for stage in (s for s in stages.seen if s in THINKING):
                if stage not in self.stages:
                    out += self._open_part(len(self.stages))
                    self.stages.append(stage)
                    self.parts.append("")
            for index, stage in enumerate(self.stages):
                new, self.parts[index] = grown(self.parts[index], stages.text(stage))
                if new:
                    out += self._part_delta(index, new)
            if "conclusion" in stages.seen or final:
                out += self._close_reasoning()
        if self.answering:
            new, self.answer = grown(self.answer, stages.conclusion)
            if new:
                at = self._at(1, 0)
                out.append(self.event("response.output_text.delta", **at, delta=new, logprobs=[]))
        return out

    def finish(self, result: GenerationResult) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The last events (the rest of the text, the ``.done`` events, ``response.completed`` or
        ``response.incomplete``) and the finished response object."""
        out = self.advance(result.text, final=True)
        at = self._at(1, 0)
        status, _ = status_of(result)
        message = message_item(self.reply.message_id, self.answer, status)
        out += [
            self.event("response.output_text.done", **at, text=self.answer, logprobs=[]),
            self.event("response.content_part.done", **at, part=output_text(self.answer)),
            self.event("response.output_item.done", output_index=1, item=message),
        ]
        body = self.reply.finished(result)
        out.append(self.event("response.completed" if status == "completed" else "response.incomplete", response=body))
        return out, body

    def fail(self, code: str, message: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """``response.failed`` for an answer that failed after its stream began, and the failed response."""
        body = self.reply.failed(code, message)
        return self.event("response.failed", response=body), body

    # ---- the items' parts --------------------------------------------------------------------------------
    def _reasoning(self, status: str) -> dict[str, Any]:
        return reasoning_item(self.reply.reasoning_id, self.parts if status == "completed" else [], status)

    def _at(self, output_index: int, index: int, name: str = "content_index") -> dict[str, Any]:
        item = self.reply.reasoning_id if output_index == 0 else self.reply.message_id
        return {"item_id": item, "output_index": output_index, name: index}

    def _open_part(self, index: int) -> list[dict[str, Any]]:
        return [
            self.event(
                "response.reasoning_summary_part.added",
                **self._at(0, index, "summary_index"),
                part={"type": "summary_text", "text": ""},
            ),
            self.event(
                "response.content_part.added", **self._at(0, index), part={"type": "reasoning_text", "text": ""}
            ),
        ]

    def _part_delta(self, index: int, new: str) -> list[dict[str, Any]]:
        return [
            self.event("response.reasoning_summary_text.delta", **self._at(0, index, "summary_index"), delta=new),
            self.event("response.reasoning_text.delta", **self._at(0, index), delta=new),
        ]

    def _close_reasoning(self) -> list[dict[str, Any]]:
        out = []
        for index, text in enumerate(self.parts):
            summary = self._at(0, index, "summary_index")
            out += [
                self.event("response.reasoning_summary_text.done", **summary, text=text),
                self.event(
                    "response.reasoning_summary_part.done", **summary, part={"type": "summary_text", "text": text}
                ),
                self.event("response.reasoning_text.done", **self._at(0, index), text=text),
                self.event(
                    "response.content_part.done", **self._at(0, index), part={"type": "reasoning_text", "text": text}
                ),
            ]
        self.answering = True
        return [
            *out,
            self.event("response.output_item.done", output_index=0, item=self._reasoning("completed")),
            self.event(
                "response.output_item.added",
                output_index=1,
                item=message_item(self.reply.message_id, None, "in_progress"),
            ),
            self.event("response.content_part.added", **self._at(1, 0), part=output_text("")),
        ]
