"""OpenAI's Responses API on ``/v1/responses``: create (at once or streamed), retrieve, delete.

A door over ``/v1/chat/completions``' machinery (:class:`~vlm_demo.web.api.openai_api.OpenAIAPI`: its key, body limit,
image rules, validation and error shape) and so over the same answer service as the page and MCP. This module is
the translation of a Responses body into our terms and the keeping of responses for follow-ups; what goes back
on the wire is :mod:`~vlm_demo.web.api.responses_wire`'s, what is kept :mod:`~vlm_demo.web.api.response_store`'s.

- ``input`` is a string (the question) or message items (``role``, ``content`` as a string or ``input_text``
  and ``input_image`` parts, an ``http(s)`` URL only with ``--api-remote-images``); read as chat messages are:
  exactly one picture per conversation, earlier turns as chat-template turns, system and developer messages
  folded into the question. ``reasoning`` items a client sends back are accepted and not used.
- ``instructions`` are folded into the question, first (the model was not trained with a system turn), and,
  as OpenAI's are, not carried over to a follow-up.
- ``previous_response_id`` continues a stored response: its picture, its system messages and its turns (each
  answer's CONCLUSION), then the new input, which must then hold no picture. ``truncation: "auto"`` drops the
  oldest turns past the history caps (as the page does); ``"disabled"`` (the default) refuses them with a 400.
- ``reasoning.effort: "high"`` is Think harder (stage-beam search); other efforts are the normal mode;
  ``reasoning.summary`` is accepted (the summary is always the three stages).
- Every other option is refused with a 400 naming it unless it holds its "off" value, as on chat completions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from vlm_demo.cot.stages import split_thinking
from vlm_demo.errors import INVALID, DemoError, RequestCancelledError
from vlm_demo.prompt import Turn, recent_turns
from vlm_demo.request import STAGE_BEAM, ValidRequest
from vlm_demo.results import GenerationResult
from vlm_demo.stream import Stream
from vlm_demo.web.answers import client_id
from vlm_demo.web.api.openai_api import (
    INTERNAL,
    NEUTRAL,
    WHY_NOT,
    Conversation,
    Dialect,
    OpenAIAPI,
    fold,
    is_given,
    json_object,
)
from vlm_demo.web.api.openai_wire import APIError
from vlm_demo.web.api.response_store import TTL_S, ResponseStore, Stored, Thread
from vlm_demo.web.api.responses_wire import Events, Reply, sse

log = logging.getLogger(__name__)

RESPONSES = Dialect(
    "input",
    frozenset({"input_text", "output_text"}),
    "input_image",
    ".image_url",
    frozenset({"role", "content", "type", "id", "status"}),
    'Put it in a user message as {"type": "input_image", "image_url": "data:image/png;base64,…"}.',
    "The instructions and system messages are",
    skipped=frozenset({"reasoning"}),
)
FIELDS = {"max_output_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p", "seed": "seed"}
SUPPORTED = frozenset(
    (
        "model",
        "input",
        "instructions",
        "stream",
        "previous_response_id",
        "store",
        "metadata",
        "user",
        "reasoning",
        "truncation",
        *FIELDS,
    )
)
OFF: dict[str, Any] = {  # OpenAI's options at the values that mean "off" (or what this server does anyway)
    **NEUTRAL,
    "background": False,
    "parallel_tool_calls": False,
    "tool_choice": "none",
    "text": {"format": {"type": "text"}},
}
WHY = {**WHY_NOT, "text": WHY_NOT["response_format"], "background": ": answers stream or are awaited"}
EFFORTS = ("minimal", "low", "medium", "high")
SUMMARIES = ("auto", "concise", "detailed")


@dataclass(frozen=True)
class Ask:
    """One Responses request after translation: what to submit, how to answer, what to keep."""

    valid: ValidRequest
    reply: Reply
    stream: bool
    store: bool
    owner: str
    thread: Thread  # the conversation before this question (what a follow-up continues, with this turn added)
    question: str  # the last user message's own text: this turn's question
    user: str | None


class ResponsesAPI:
    """The ``/v1/responses`` routes, added to ``api``'s router (a :class:`~vlm_demo.web.api.openai_api.Door`)."""

    def __init__(self, api: OpenAIAPI, store: ResponseStore | None = None) -> None:
        self.api = api
        self.store = store or ResponseStore()

    def add_routes(self, router: APIRouter) -> None:
        router.add_api_route("/responses", self.create, methods=["POST"])
        router.add_api_route("/responses/{response_id}", self.retrieve, methods=["GET"])
        router.add_api_route("/responses/{response_id}", self.delete, methods=["DELETE"])

    # ---- the routes --------------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        owner = self.api.door.owner(request)
        submit = functools.partial(self._submit, owner=owner)
        return await self.api.serve(request, "/v1/responses", submit, self._answer, self._events)

    async def retrieve(self, response_id: str, request: Request) -> Response:
        try:
            self.api.authorize(request)
            return JSONResponse(self._stored(self.api.door.owner(request), response_id, "response_id").body)
        except APIError as err:
            return self.api.refuse(err)

    async def delete(self, response_id: str, request: Request) -> Response:
        try:
            self.api.authorize(request)
            if not self.store.delete(self.api.door.owner(request), response_id):
                raise self._not_found(response_id, "response_id")
        except APIError as err:
            return self.api.refuse(err)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    # ---- the request -------------------------------------------------------------------------------
    def _stored(self, owner: str, response_id: Any, param: str) -> Stored:
        """The stored response ``response_id`` of ``owner``; a 404 saying what may have become of it."""
        if not isinstance(response_id, str):
            raise APIError.invalid(f"{param} must be a string (a response's id, resp_…).", param)
        found = self.store.get(owner, response_id)
        if found is None:
            raise self._not_found(response_id, param)
        return found

    @staticmethod
    def _not_found(response_id: str, param: str) -> APIError:
        return APIError(
            404,
            f"No stored response {response_id[:100]!r}: it is unknown, was deleted or made with another API key, "
            f"was made with store: false, or has expired (responses are kept {TTL_S / 60:.0f} minutes, in memory).",
            INVALID,
            "response_not_found",
            param,
        )

    def _submit(self, body: bytes, address: str, *, owner: str) -> tuple[Ask, Stream]:
        ask = self._translate(json_object(body), owner)
        try:
            return ask, self.api.answers.submit(ask.valid, client_id(address, user=ask.user))
        except DemoError as err:
            raise APIError.of(err) from None

    def _translate(self, data: dict[str, Any], owner: str) -> Ask:
        for name, value in data.items():
            if name in SUPPORTED or not is_given(value) or OFF.get(name, object()) == value:
                continue
            raise APIError.invalid(f"{name} is not supported by this server{WHY.get(name, '')}.", name)
        if is_given(data.get("model")):
            self.api.check_model(data["model"], "model")
        stream, store = _flag(data, "stream", False), _flag(data, "store", True)
        user, instructions = _text(data, "user"), _text(data, "instructions")
        metadata = _metadata(data.get("metadata"))
        truncation = data.get("truncation") or "disabled"
        if truncation not in ("disabled", "auto"):
            raise APIError.invalid('truncation must be "disabled" or "auto".', "truncation")
        effort, summary = _reasoning(data.get("reasoning"))
        previous = data.get("previous_response_id")
        thread = self._stored(owner, previous, "previous_response_id").thread if is_given(previous) else None
        items = data.get("input")
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        earlier = (thread.system, thread.turns) if thread else ((), ())
        conversation = fold(items, RESPONSES, earlier, has_image=thread is not None)
        image = self.api.picture(conversation, thread.image if thread else None)
        asked = _with_instructions(conversation, instructions, truncation == "auto")
        given = {name: (api, data[api]) for api, name in FIELDS.items() if is_given(data.get(api))}
        if effort == "high":
            given["reasoning"] = ("reasoning", STAGE_BEAM)
        valid = self.api.validate(image, asked, given)
        settings = {
            "instructions": instructions,
            "max_output_tokens": valid.params.max_new_tokens,
            "temperature": valid.params.temperature,
            "top_p": valid.params.top_p,
            "previous_response_id": previous if is_given(previous) else None,
            "reasoning": {"effort": effort, "summary": summary},
            "store": store,
            "truncation": truncation,
            "metadata": metadata,
            "user": user,
        }
        reply = Reply(self.api.model, settings)
        kept = Thread(image, conversation.system, conversation.history)
        return Ask(valid, reply, stream, store, owner, kept, conversation.last, user)

    # ---- answering ---------------------------------------------------------------------------------
    def _keep(self, ask: Ask, result: GenerationResult, body: dict[str, Any]) -> None:
        """Store a finished response with its conversation, this turn added (its CONCLUSION as the answer)."""
        if not ask.store:
            return
        thinking, answer = split_thinking(result.text, final=True)
        turn = ((ask.question, answer or thinking),) if (answer or thinking) else ()
        self.store.put(ask.owner, body, dataclasses.replace(ask.thread, turns=ask.thread.turns + turn))

    async def _answer(self, ask: Ask, stream: Stream, request: Request) -> Response:
        result = await self.api.result(stream, request)
        if isinstance(result, Response):  # a caller gone, or an error the client raises: nothing kept
            return result
        body = ask.reply.finished(result)
        self._keep(ask, result, body)
        return JSONResponse(body)

    async def _events(self, ask: Ask, stream: Stream, request: Request) -> AsyncIterator[bytes]:
        """The response as OpenAI's stream events (:class:`~vlm_demo.web.api.responses_wire.Events`); a failure after
        the stream began ends it with ``response.failed``."""
        events = Events(ask.reply)
        for event in events.start():
            yield sse(event)
        raw = ""
        try:
            async with contextlib.aclosing(self.api.texts(stream, request)) as texts:
                async for text in texts:
                    raw += text
                    for event in events.advance(raw):
                        yield sse(event)
            result = stream.result(0)
        except RequestCancelledError:
            return
        except DemoError as err:
            yield sse(events.fail(err.code, str(err))[0])
            return
        except Exception:  # a bug of ours mid-stream: the client still gets an ending, not a cut connection
            log.exception("/v1/responses stream failed")
            yield sse(events.fail(INTERNAL.code, str(INTERNAL))[0])
            return
        last, body = events.finish(result)
        self._keep(ask, result, body)  # before the last event: a follow-up sent at once finds it
        for event in last:
            yield sse(event)


def _flag(data: dict[str, Any], name: str, default: bool) -> bool:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError.invalid(f"{name} must be true or false.", name)
    return value


def _text(data: dict[str, Any], name: str) -> str | None:
    value = data.get(name)
    if value is not None and not isinstance(value, str):
        raise APIError.invalid(f"{name} must be a string.", name)
    return value.strip() if value else None


def _metadata(value: Any) -> dict[str, str]:
    """OpenAI's metadata: at most 16 pairs of strings, keys up to 64 characters, values up to 512."""
    if value is None:
        return {}
    fits = isinstance(value, dict) and len(value) <= 16
    fits = fits and all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items()
    )
    if not fits:
        raise APIError.invalid(
            "metadata must be an object of at most 16 strings (keys up to 64 characters, values up to 512).", "metadata"
        )
    return dict(value)


def _reasoning(value: Any) -> tuple[str | None, str | None]:
    """``reasoning``'s ``effort`` and ``summary``, checked."""
    if value is None:
        return None, None
    if not isinstance(value, dict) or not set(value) <= {"effort", "summary", "generate_summary"}:
        raise APIError.invalid('reasoning must be an object with "effort" and "summary".', "reasoning")
    effort, summary = value.get("effort"), value.get("summary") or value.get("generate_summary")
    if effort is not None and effort not in EFFORTS:
        raise APIError.invalid(f"reasoning.effort must be one of {', '.join(EFFORTS)}.", "reasoning")
    if summary is not None and summary not in SUMMARIES:
        raise APIError.invalid(f"reasoning.summary must be one of {', '.join(SUMMARIES)}.", "reasoning")
    return effort, summary


def _with_instructions(conversation: Conversation, instructions: str | None, truncate: bool) -> Conversation:
    """The conversation as submitted: the instructions folded in first, and with ``truncate`` only the newest
    turns that fit the history caps."""
    question = "\n\n".join(text for text in (instructions, conversation.question) if text)
    history = conversation.history
    if truncate:
        history = tuple(tuple(turn) for turn in recent_turns([Turn(*turn) for turn in history]))  # type: ignore[misc]
    return dataclasses.replace(conversation, question=question, history=history)
