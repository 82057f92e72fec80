"""The OpenAI-compatible API on the page's own server and port: ``/v1/chat/completions`` and ``/v1/models``.

A thin adapter over the answer service (:mod:`~vlm_demo.web.answers`), beside the page, not on it: requests go
to the backend with the same :class:`~vlm_demo.request.ValidRequest` the page builds, not through Gradio's
queue, so API clients and page visitors share the engine's batches; a stream is woken by each piece of new
text, so every engine step's text goes out as soon as it is there, however many visitors the page has.
This module is the router and the translation of OpenAI's request body into our terms; what goes back on
the wire is :mod:`~vlm_demo.web.api.openai_wire`'s. ``/v1/responses`` (:mod:`~vlm_demo.web.api.responses_api`) is a
:class:`Door` on the same router over the same machinery: :meth:`OpenAIAPI.serve`, :func:`fold` with its own
:class:`Dialect`, :meth:`OpenAIAPI.picture` and :meth:`OpenAIAPI.validate`.

- **One image per conversation.** The model reads one image, so a conversation must hold exactly one
  ``image_url`` part (a ``data:`` URL; an ``http(s)`` URL only with ``--api-remote-images``). Earlier
  turns go into the model's chat template as turns (as the page's follow-up questions do; the image in
  the first user turn; consecutive messages of one role are joined): an earlier assistant turn
  contributes its answer (``content``; its CONCLUSION if it holds stage tags), never its reasoning, as
  reasoning models' APIs ask. System messages are *folded into the question text*, before it (the model
  was not trained with a system turn). A question with no system message goes in verbatim, so a
  single-question API answer equals the page's for the same image and question (the page's follow-ups
  carry each earlier answer whole, the API its content). The question must fit
  ``--max-question-chars``, the earlier turns the history caps.
- **Nothing silently ignored**: every OpenAI option we do not implement is refused with a 400 naming it,
  unless it holds the value that means "off" (``n`` = 1, penalties 0, ``logprobs`` false, or ``null``).
- **Keys**: with ``--api-key`` every ``/v1`` call needs ``Authorization: Bearer KEY``; with ``--auth`` and
  no key, ``/v1`` is closed (the page's password must not leave a side door open).
- The design documents' body ``{"image_base64", "question"}`` on the same path answers
  ``{"response": <the tagged answer>}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vlm_demo.config import Config
from vlm_demo.cot.stages import split_thinking
from vlm_demo.errors import INVALID, SERVER, DemoError, InvalidRequestError, RequestCancelledError
from vlm_demo.request import KNOBS, STAGE_BEAM, ValidRequest, choice, sampling_from, validate_question, validate_request
from vlm_demo.results import GenerationResult
from vlm_demo.stream import Stream
from vlm_demo.web.answers import API, Answers, client_id
from vlm_demo.web.api.openai_wire import (
    DONE,
    APIError,
    Completion,
    ThinkingSplitter,
    deltas,
    finish_reason,
    model_card,
    sse,
)
from vlm_demo.web.api.remote_images import fetch_image
from vlm_demo.web.operator import KeyDoor

log = logging.getLogger(__name__)

# The sampling fields offered here, by their API names (from their knobs, vlm_demo.request), and back.
FIELDS: dict[str, str] = {knob.api: name for name, knob in KNOBS.items() if knob.api}
TOKENS = ("max_completion_tokens", "max_tokens")  # OpenAI's newer and older name for max_new_tokens
SUPPORTED = frozenset(("model", "messages", "stream", "stream_options", "user", *TOKENS, *FIELDS))
NEUTRAL: dict[str, Any] = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": False}
WHY_NOT = {  # why an option is refused, where a reason helps
    "n": ": it writes one answer per request (n must be 1)",
    "tools": ": the model does not call tools",
    "tool_choice": ": the model does not call tools",
    "parallel_tool_calls": ": the model does not call tools",
    "functions": ": the model does not call functions",
    "function_call": ": the model does not call functions",
    "response_format": ": the answer is the model's own four-stage text",
    "logprobs": " (logprobs must be false)",
    "top_logprobs": "",
    "stop": ": the answer ends at its CONCLUSION",
    "presence_penalty": " (only 0)",
    "frequency_penalty": " (only 0)",
    "logit_bias": "",
}
ROLES = {"system": "system", "developer": "system", "user": "User", "assistant": "Assistant"}
MESSAGE_KEYS = {"role", "content", "name"}  # ``name`` is accepted and not used
ASSISTANT_KEYS = {"reasoning_content", "reasoning"}  # accepted; earlier reasoning is not folded in
LEGACY_KEYS = {"image_base64", "question"}
BODY_SLACK = 1 << 20  # JSON around the image: the question, the other turns, the options
INTERNAL = APIError(500, "Internal error; the server's log has the details.", SERVER, "internal_error")


@dataclass(frozen=True)
class Call:
    """One API request after translation: what to submit and how to answer."""

    valid: ValidRequest
    stream: bool = False
    include_usage: bool = False
    legacy: bool = False  # the design documents' body: answer {"response": ...}
    user: str | None = None


def is_given(value: Any) -> bool:
    """``null`` (and an empty list or object) is how loose clients leave an option out."""
    return value is not None and value != [] and value != {}


@dataclass(frozen=True)
class Dialect:
    """How a door spells a conversation (``/v1/chat/completions``' messages, ``/v1/responses``' input items), so
    one :func:`fold` reads both and its errors name the door's own fields."""

    field: str  # the request field that holds the conversation
    texts: frozenset[str]  # content part types whose ``text`` is text
    image: str  # the content part type whose ``image_url`` holds a picture (a URL, or {"url": URL})
    url_at: str  # where the URL is in such a part, for error messages
    keys: frozenset[str]  # what a message may carry (an assistant's reasoning keys besides)
    example: str  # how to send the picture, for the error that finds none
    folded: str  # what is folded into the question besides the last user message, for the error that it is too long
    skipped: frozenset[str] = frozenset()  # item types accepted and not used (a replayed reasoning item)


CHAT = Dialect(
    "messages",
    frozenset({"text"}),
    "image_url",
    ".image_url.url",
    frozenset(MESSAGE_KEYS),
    'Put it in a user message as {"type": "image_url", "image_url": {"url": "data:image/png;base64,…"}}.',
    "The system messages are",
)


def _text_parts(content: Any, where: str, images: list[tuple[str, Any]], images_allowed: bool, dialect: Dialect) -> str:
    """A message's text (parts joined by newlines); its image parts are collected into ``images``."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError.invalid(f"{where}.content must be a string or a list of content parts.", where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        kind = kind if isinstance(kind, str) else repr(kind)  # a list, say: no type we read, and not hashable
        if kind in dialect.texts:
            if not isinstance(part.get("text"), str):
                raise APIError.invalid(f"{at}.text must be a string.", at)
            texts.append(part["text"])
        elif kind == dialect.image and images_allowed:
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image  # some clients send the URL itself
            if not isinstance(url, str):
                raise APIError.invalid(f"{at}{dialect.url_at} must be a string (a data: URL).", at)
            images.append((at, url))
        elif kind == dialect.image:
            raise APIError.invalid(f"{at}: only user messages may hold an image.", at)
        else:
            kinds = " and ".join(sorted(dialect.texts) + [dialect.image])
            raise APIError.invalid(f"{at}: content parts of type {kind!r} are not supported ({kinds}).", at)
    return "\n".join(texts)


@dataclass(frozen=True)
class Conversation:
    """The messages as the engine takes them: one question (with the system messages folded in, see the
    module's docstring), the earlier ``[question, answer]`` turns, one image."""

    question: str  # what is submitted
    last: str  # the last user message's own text
    image_url: str  # "" when the picture came earlier (a stored conversation's)
    image_at: str  # where the image was ("messages[0].content[1]"), for error messages
    history: tuple[tuple[str, str], ...] = ()
    system: tuple[str, ...] = ()  # the system messages' texts (folded into ``question``)
    dialect: Dialect = CHAT


def fold(
    messages: Any,
    dialect: Dialect = CHAT,
    earlier: tuple[tuple[str, ...], tuple[tuple[str, str], ...]] = ((), ()),
    has_image: bool = False,
) -> Conversation:
    """The conversation as one question and its one image; a 400 naming the message that does not fit.

    ``earlier`` is a conversation that came before these messages (its system texts and its turns) and
    ``has_image`` says it holds the picture already: then these messages must hold none."""
    field = dialect.field
    if not isinstance(messages, list) or not messages:
        raise APIError.invalid(f"{field} must be a non-empty list.", field)
    system: list[str] = list(earlier[0])
    turns: list[tuple[str, str]] = [
        (role, text) for turn in earlier[1] for role, text in zip(("User", "Assistant"), turn)
    ]
    images: list[tuple[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        kind = message.get("type") if isinstance(message, dict) else None
        if isinstance(kind, str) and kind in dialect.skipped:
            continue
        if "type" in dialect.keys and kind not in (None, "message"):
            raise APIError.invalid(f"{where}.type {kind!r} is not supported (message; no tools).", where)
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in ROLES:
            raise APIError.invalid(
                f"{where}.role {role!r} is not supported (system, developer, user, assistant; no tools).", where
            )
        allowed = dialect.keys | (ASSISTANT_KEYS if role == "assistant" else set())
        extra = sorted(k for k in message if k not in allowed and is_given(message[k]))
        if extra:
            raise APIError.invalid(f"{where}.{extra[0]} is not supported by this server.", where)
        text = _text_parts(message.get("content", ""), where, images, role == "user", dialect)
        if role == "assistant":
            thinking, answer = split_thinking(text, final=True)
            text = answer or thinking
        if ROLES[role] == "system":
            system.append(text.strip())
        else:
            turns.append((ROLES[role], text.strip()))
    if turns[-1:] == [] or turns[-1][0] != "User":
        raise APIError.invalid("The last message must be the user's question.", field)
    if len(images) != (0 if has_image else 1):
        found = "none" if not images else f"{len(images)} (at {', '.join(at for at, _ in images)})"
        if has_image:
            raise APIError.invalid(
                f"The conversation holds its picture already (the model reads one); found {found} more.", field
            )
        raise APIError.invalid(
            f"Send exactly one image per conversation (the model reads one); found {found}. {dialect.example}",
            field,
        )
    merged: list[tuple[str, str]] = []  # one entry per change of role
    for role, text in turns:
        if merged and merged[-1][0] == role:
            merged[-1] = (role, f"{merged[-1][1]}\n{text}")
        else:
            merged.append((role, text))
    if merged[0][0] == "Assistant":  # a greeting before the first question: context, like a system message
        system.append(merged.pop(0)[1])
    history = tuple((merged[i][1], merged[i + 1][1]) for i in range(0, len(merged) - 1, 2))
    (at, url), last = images[0] if images else ("", ""), merged[-1][1]
    system = [s for s in system if s]
    return Conversation("\n\n".join([*system, last]), last, url, at, history, tuple(system), dialect)


def json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object; a 400 saying what it is instead."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError.invalid(f"The request body is not valid JSON: {err}.") from None
    if not isinstance(data, dict):
        raise APIError.invalid("The request body must be a JSON object.")
    return data


class Asked(Protocol):
    """What a door's translated request says about how to answer it."""

    @property
    def stream(self) -> bool: ...
    @property
    def user(self) -> str | None: ...


A = TypeVar("A", bound=Asked)


class Door(Protocol):
    """Another OpenAI API on ``/v1`` over this one's machinery (its key, limits, body, image and validation)."""

    def add_routes(self, router: APIRouter) -> None: ...


class OpenAIAPI:
    """The ``/v1`` routes: a thin adapter over the answer service (its limits, metrics and pacing for ``/v1``)."""

    def __init__(self, answers: Answers, config: Config, model: str) -> None:
        self.answers = answers
        self.limits = answers.limits
        self.metrics = answers.metrics
        self.model = model
        self.door = KeyDoor(config)
        self.remote_images = config.api_remote_images
        self.created = int(time.time())
        self.max_body = self.limits.max_image_bytes * 4 // 3 + BODY_SLACK

    def router(self, *doors: Door) -> APIRouter:
        """The ``/v1`` routes, with those of the other ``doors`` on this API (``/v1/responses``), and a 404 for
        any other path."""
        router = APIRouter(prefix="/v1")
        router.add_api_route("/chat/completions", self.chat_completions, methods=["POST"])
        router.add_api_route("/models", self.models, methods=["GET"])
        router.add_api_route("/models/{model_id:path}", self.model_info, methods=["GET"])
        for door in doors:
            door.add_routes(router)
        router.add_api_route(
            "/{path:path}", self.unknown, methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False
        )
        return router

    # ---- the routes --------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        try:
            self.authorize(request)
        except APIError as err:
            return self.refuse(err)
        return JSONResponse({"object": "list", "data": [model_card(self.model, self.created, self._weights())]})

    async def model_info(self, model_id: str, request: Request) -> Response:
        try:
            self.authorize(request)
            self.check_model(model_id, "model")
        except APIError as err:
            return self.refuse(err)
        return JSONResponse(model_card(self.model, self.created, self._weights()))

    def _weights(self) -> str:
        """How the weights are stored, from the local engine's stats (a remote backend's health is a network call,
        not for the event loop, and does not say)."""
        backend = self.answers.backend
        return "" if backend.remote else backend.health().weights

    async def unknown(self, path: str, request: Request) -> Response:
        try:
            self.authorize(request)
        except APIError as err:
            return self.refuse(err)
        return self.refuse(APIError(404, f"No such endpoint: {request.method} /v1/{path}.", INVALID, "unknown_url"))

    async def chat_completions(self, request: Request) -> Response:
        """Translate, validate and submit, then answer at once or stream."""
        return await self.serve(request, "/v1/chat/completions", self._submit, self._answer, self._events)

    # ---- the door ----------------------------------------------------------------------------------
    async def serve(
        self,
        request: Request,
        route: str,
        submit: Callable[[bytes, str], tuple[A, Stream]],
        answer: Callable[[A, Stream, Request], Awaitable[Response]],
        events: Callable[[A, Stream, Request], AsyncIterator[bytes]],
    ) -> Response:
        """One call to a ``/v1`` route that answers: authorize, read the body and ``submit`` it as the caller at its
        address (off the event loop: decoding an image takes up to ~0.1 s), then ``answer`` at once or stream its
        ``events``; a refusal in OpenAI's shape."""
        loop = asyncio.get_running_loop()
        try:
            self.authorize(request)
            body = await self.read_body(request)
            address = request.client.host if request.client is not None else ""
            call, stream = await loop.run_in_executor(None, submit, body, address)
        except APIError as err:
            return self.refuse(err)
        except Exception:  # a bug of ours: still an answer in OpenAI's shape, and the traceback in the log
            log.exception("%s failed before reaching the backend", route)
            return INTERNAL.response()
        if call.user:
            log.info("%s for user %r", route, call.user[:100])
        if call.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(events(call, stream, request), media_type="text/event-stream", headers=headers)
        return await answer(call, stream, request)

    def authorize(self, request: Request) -> None:
        refused = self.door.refusal(request)
        if refused is not None:
            raise APIError(401, refused[1], INVALID, refused[0])

    async def read_body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length", "")
        too_big = APIError.invalid(f"The request body is larger than {self.max_body / 1e6:.0f} MB.")
        if declared.isdigit() and int(declared) > self.max_body:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(self, model: Any, param: str) -> None:
        if model != self.model:
            raise APIError(
                404,
                f"The model {str(model)[:100]!r} does not exist here; this server serves {self.model!r} "
                "(GET /v1/models).",
                INVALID,
                "model_not_found",
                param,
            )

    def _submit(self, body: bytes, address: str) -> tuple[Call, Stream]:
        """The request's body into a :class:`Call`, submitted as the caller at ``address`` (or as its ``user``,
        when the body names one); every refusal an :class:`APIError`."""
        data = json_object(body)
        call = self._legacy(data) if "messages" not in data and LEGACY_KEYS & data.keys() else self._chat(data)
        try:
            return call, self.answers.submit(call.valid, client_id(address, user=call.user))
        except DemoError as err:
            raise APIError.of(err) from None

    def _chat(self, data: dict[str, Any]) -> Call:
        for name, value in data.items():
            if name in SUPPORTED or not is_given(value) or NEUTRAL.get(name, object()) == value:
                continue
            raise APIError.invalid(f"{name} is not supported by this server{WHY_NOT.get(name, '')}.", name)
        if is_given(data.get("model")):
            self.check_model(data["model"], "model")
        stream = data.get("stream") or False
        if not isinstance(stream, bool):
            raise APIError.invalid("stream must be true or false.", "stream")
        options = data.get("stream_options") or {}
        if options and not stream:
            raise APIError.invalid("stream_options is only allowed when stream is true.", "stream_options")
        if not isinstance(options, dict) or not set(options) <= {"include_usage"}:
            raise APIError.invalid('stream_options supports only {"include_usage": true|false}.', "stream_options")
        include_usage = options.get("include_usage") or False
        if not isinstance(include_usage, bool):
            raise APIError.invalid("stream_options.include_usage must be true or false.", "stream_options")
        user = data.get("user")
        if user is not None and not isinstance(user, str):
            raise APIError.invalid("user must be a string.", "user")
        conversation = fold(data.get("messages"))
        image = self.picture(conversation)
        tokens = [n for n in TOKENS if is_given(data.get(n))]
        if len(tokens) == 2 and data["max_tokens"] != data["max_completion_tokens"]:
            raise APIError.invalid("Send max_completion_tokens or max_tokens, not both.", "max_tokens")
        given = {name: (api, data[api]) for api, name in FIELDS.items() if is_given(data.get(api))}
        if tokens:
            given["max_new_tokens"] = (tokens[0], data[tokens[0]])
        return Call(self.validate(image, conversation, given), stream, include_usage, user=user)

    def validate(self, image: Any, conversation: Conversation, given: dict[str, tuple[str, Any]]) -> ValidRequest:
        """The door, with the API's field names in its messages: ``given`` holds each sampling field the request
        set, by its knob's name, as ``(the API's name for it, value)``."""
        names = {name: api for name, (api, _) in given.items()}
        values = {name: value for name, (_, value) in given.items()}
        field = conversation.dialect.field
        try:
            if "beams" in values and choice("reasoning", values.get("reasoning")) != STAGE_BEAM:
                raise InvalidRequestError('beams applies only with "reasoning": "stage-beam".', "beams")
            params = sampling_from(values, self.limits)
            return validate_request(image, conversation.question, params, self.limits, conversation.history)
        except InvalidRequestError as err:
            if err.param in names and names[err.param] != err.param:
                raise APIError.invalid(str(err).replace(err.param, names[err.param]), names[err.param]) from None
            if err.param == "question" and conversation.question != conversation.last:
                message = f"{err} {conversation.dialect.folded} folded into the question and count."
                raise APIError.invalid(message, field) from None
            param = {None: conversation.image_at or field, "question": field, "history": field}.get(
                err.param, err.param
            )
            raise APIError.of(err, param) from None

    def picture(self, conversation: Conversation, held: Any = None) -> Any:
        """The conversation's picture as :func:`~vlm_demo.images.load_image` reads it (``held``: the one an earlier
        turn sent), once its last question passed on its own (not hidden by what is folded into it)."""
        try:
            validate_question(conversation.last, self.limits.max_question_chars)
            return held if conversation.image_url == "" else self.image(conversation.image_url)
        except InvalidRequestError as err:
            where = conversation.image_at if err.param is None else conversation.dialect.field
            raise APIError.of(err, where) from None

    def image(self, url: str) -> Any:
        """What :func:`~vlm_demo.images.load_image` reads for an image URL: the data URL itself, or fetched bytes."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return {"url": url}
        if scheme not in ("http", "https"):
            raise InvalidRequestError("An image URL must be a data: URL (data:image/png;base64,…).")
        if not self.remote_images:
            raise InvalidRequestError(
                "This server does not fetch image URLs: send the image inline as a data: URL "
                "(data:image/png;base64,…), or ask its operator to start it with --api-remote-images."
            )
        return fetch_image(url, self.limits.max_image_bytes)

    def _legacy(self, data: dict[str, Any]) -> Call:
        """The design documents' ``{"image_base64", "question"}`` (base64 of the file, or a data URL)."""
        extra = sorted(set(data) - LEGACY_KEYS)
        if extra:
            raise APIError.invalid(
                f"{extra[0]} is not part of the image_base64/question body; use messages for options.", extra[0]
            )
        image = data.get("image_base64")
        if not isinstance(image, str) or not image:
            raise APIError.invalid("image_base64 must be the image file in base64.", "image_base64")
        url = image if image.startswith("data:") else "data:image;base64," + image
        try:
            params = sampling_from({}, self.limits)  # the page's defaults
            valid = validate_request({"url": url}, data.get("question"), params, self.limits)
        except InvalidRequestError as err:
            raise APIError.of(err, "question" if err.param == "question" else "image_base64") from None
        return Call(valid, legacy=True)

    def refuse(self, err: APIError) -> JSONResponse:
        """A refusal before the backend took the request (the backend's listener counts the rest)."""
        self.metrics.rejected(err.code)
        return err.response()

    # ---- answering ---------------------------------------------------------------------------------
    async def texts(self, stream: Stream, request: Request) -> AsyncGenerator[str, None]:
        """The answer's text as each piece arrives (the answer service's loop, woken by new text); cancelled
        when the client goes away, so its model row is freed."""
        async with contextlib.aclosing(self.answers.follow(stream, API, gone=request.is_disconnected)) as moments:
            async for moment in moments:
                if moment.text:
                    yield moment.text

    async def result(self, stream: Stream, request: Request) -> GenerationResult | Response:
        """The finished answer, or what to answer instead: nothing for a caller gone, an error for a failure."""
        try:
            async with contextlib.aclosing(self.texts(stream, request)) as texts:
                async for _ in texts:
                    pass
            return stream.result(0)
        except RequestCancelledError:
            return Response(status_code=499)  # nobody is listening any more
        except DemoError as err:  # taken by the backend, then failed
            return APIError.of(err).response()

    async def _answer(self, call: Call, stream: Stream, request: Request) -> Response:
        result = await self.result(stream, request)
        if isinstance(result, Response):
            return result
        if call.legacy:
            return JSONResponse({"response": result.text})
        return JSONResponse(Completion(self.model).message(result))

    async def _events(self, call: Call, stream: Stream, request: Request) -> AsyncIterator[bytes]:
        """The answer as ``chat.completion.chunk`` events: reasoning deltas, content deltas, the finish, usage."""
        answer, splitter, usage = Completion(self.model), ThinkingSplitter(), call.include_usage
        yield sse(answer.chunk({"role": "assistant", "content": ""}, with_usage=usage))
        raw = ""
        try:
            async with contextlib.aclosing(self.texts(stream, request)) as texts:
                async for text in texts:
                    raw += text
                    for delta in deltas(*splitter.advance(raw)):
                        yield sse(answer.chunk(delta, with_usage=usage))
            result = stream.result(0)
        except RequestCancelledError:
            return
        except DemoError as err:  # failed after the stream began: an error event, then the end
            yield sse(APIError.of(err).body())
            yield DONE
            return
        except Exception:  # a bug of ours mid-stream: the client still gets an ending, not a cut connection
            log.exception("/v1/chat/completions stream failed")
            yield sse(INTERNAL.body())
            yield DONE
            return
        for delta in deltas(*splitter.advance(result.text, final=True)):
            yield sse(answer.chunk(delta, with_usage=usage))
        yield sse(answer.chunk({}, finish_reason(result), with_usage=usage))
        if usage:
            yield sse(answer.usage_chunk(result))
        yield DONE
