"""What the OpenAI-compatible API sends back: completions, stream chunks, errors.

Pure functions and one small state machine (:class:`ThinkingSplitter`), no I/O, so every shape the
``openai`` client reads is built in one place. The thinking stages are kept apart from the answer the way
vLLM's and SGLang's reasoning parsers do it: ``content`` is the CONCLUSION's text; SUMMARY, CAPTION and
REASONING, tags as written, go in ``reasoning_content`` (the older field name clients read) and in
``reasoning`` (the newer one), with the same text.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from vlm_demo.cot.stages import split_thinking
from vlm_demo.errors import RETRY_LATER, DemoError, InvalidRequestError
from vlm_demo.results import GenerationResult

DONE = b"data: [DONE]\n\n"


class APIError(Exception):
    """A refusal with its HTTP status and OpenAI error body (``param`` names the request field at fault)."""

    def __init__(self, status: int, message: str, kind: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param

    @classmethod
    def invalid(cls, message: str, param: str | None = None) -> APIError:
        return cls.of(InvalidRequestError(message), param)

    @classmethod
    def of(cls, error: DemoError, param: str | None = None) -> APIError:
        """The API's answer to one of our typed errors: the status and kind its class declares."""
        return cls(error.status, str(error), error.kind, error.code, param)

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.kind, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in RETRY_LATER else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(message: str, kind: str, param: str | None, code: str | None) -> dict[str, Any]:
    """OpenAI's error shape, which its clients turn into ``APIError`` subclasses with this message."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object, as OpenAI streams them (no event name)."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class ThinkingSplitter:
    """Turns the growing answer into reasoning and content deltas, each piece of text sent once.

    :func:`~vlm_demo.cot.stages.split_thinking` holds back a half-written tag and only ever grows both parts;
    this keeps what was sent and returns the rest. Should a part ever stop extending what was sent (it
    cannot with the engine's prefix-only text), nothing more of it is sent rather than text twice.
    """

    def __init__(self) -> None:
        self.reasoning = ""
        self.content = ""

    def advance(self, text: str, final: bool = False) -> tuple[str, str]:
        """The new reasoning and content text since the last call, for the whole answer so far."""
        reasoning, content = split_thinking(text, final)
        new_reasoning, self.reasoning = grown(self.reasoning, reasoning)
        new_content, self.content = grown(self.content, content)
        return new_reasoning, new_content


def grown(sent: str, now: str) -> tuple[str, str]:
    """``(new text, all text sent)`` when ``now`` extends what was sent; else nothing new."""
    if now.startswith(sent):
        return now[len(sent) :], now
    return "", sent


def usage(result: GenerationResult) -> dict[str, int]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def finish_reason(result: GenerationResult) -> str:
    """OpenAI's finish reasons: ``stop`` (the answer ended) or ``length`` (it hit max_tokens)."""
    return "length" if result.finish_reason == "length" else "stop"


@dataclass(frozen=True)
class Completion:
    """One answer's identity, shared by its response or by every chunk of its stream."""

    model: str
    id: str = field(default_factory=lambda: "chatcmpl-" + secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    def message(self, result: GenerationResult) -> dict[str, Any]:
        """The whole ``chat.completion`` for a finished answer."""
        reasoning, content = split_thinking(result.text, final=True)
        message = {"role": "assistant", "content": content, "reasoning_content": reasoning or None}
        message["reasoning"] = message["reasoning_content"]
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason(result)}],
            "usage": usage(result),
        }

    def chunk(self, delta: dict[str, Any], finish: str | None = None, with_usage: bool = False) -> dict[str, Any]:
        """One ``chat.completion.chunk``; with ``include_usage`` every chunk carries ``usage: null``."""
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if with_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, result: GenerationResult) -> dict[str, Any]:
        """The last chunk before ``[DONE]`` when the client asked for usage: no choices, the token counts."""
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage(result),
        }


def deltas(reasoning: str, content: str) -> list[dict[str, Any]]:
    """The stream deltas for new text: reasoning first (under both names), then content."""
    out: list[dict[str, Any]] = []
    if reasoning:
        out.append({"reasoning_content": reasoning, "reasoning": reasoning})
    if content:
        out.append({"content": content})
    return out


def model_card(model: str, created: int, weights: str = "") -> dict[str, Any]:
    """One entry of ``GET /v1/models``; ``weights`` (how they are stored: "fp8", "int8", "bf16"…) when known."""
    card = {"id": model, "object": "model", "created": created, "owned_by": "vlm-demo"}
    return {**card, "weights": weights} if weights else card
