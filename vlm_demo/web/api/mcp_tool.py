"""The MCP door (``--mcp-server``): one described tool, ``ask``, for agents, over streamable HTTP at ``/mcp``
(and at ``/gradio_api/mcp/``, where Gradio's MCP server used to answer).

A thin adapter over the answer service, written with the official ``mcp`` SDK rather than Gradio's MCP
server, which offered the page's own endpoints as tools (nine outputs of HTML and panel text, parameters
without descriptions, an error hidden in a status string). Here an agent sees what the model does, when to
think harder, and every parameter with its range and default (from the sampling fields' knobs,
:mod:`vlm_demo.request`); the answer comes back as text with the CONCLUSION first and each stage named
(and as structured content); a refusal or failure is an MCP error (``isError``) whose text says what to do.

The image is an ``http(s)`` URL (fetched by the server: public addresses only, with the byte limit and a
deadline) or a ``data:`` URL. With ``--api-key`` a call needs ``Authorization: Bearer KEY``, as ``/v1`` does.
Stateless: each call stands alone, so any web replica can answer it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import mcp.types as types
from fastapi.responses import JSONResponse
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from vlm_demo.config import Config
from vlm_demo.cot.stages import STAGES, parse_stages
from vlm_demo.errors import DemoError, InvalidRequestError
from vlm_demo.images import SUPPORTED
from vlm_demo.request import API_KNOBS, DEFAULTS, KNOBS, ValidRequest, sampling_from, validate_request
from vlm_demo.results import GenerationResult
from vlm_demo.web.answers import MCP, Answers, client_id
from vlm_demo.web.api.remote_images import fetch_image
from vlm_demo.web.operator import KeyDoor

log = logging.getLogger(__name__)

TOOL = "ask"
PATHS = ("/mcp", "/gradio_api/mcp", "/gradio_api/mcp/")
BODY_SLACK = 1 << 20  # JSON around the image


def _describe(name: str, cap: int) -> str:
    """A parameter's description: its knob's help, then its range and default."""
    knob = KNOBS[name]
    parts = [knob.help]
    bounds = knob.bounds(cap)
    if bounds is not None:
        parts.append(f"From {bounds[0]:g} to {bounds[1]:g}.")
    if knob.choices:
        parts.append("One of " + ", ".join(f'"{value}" ({label})' for label, value in knob.choices) + ".")
    default = DEFAULTS[name]
    if name == "max_new_tokens":
        default = min(default, cap)
    parts.append("Default: none." if default is None else f"Default: {default}.")
    return " ".join(parts)


def _schema(name: str, cap: int) -> dict[str, Any]:
    """One sampling field as a JSON-schema property."""
    knob = KNOBS[name]
    prop: dict[str, Any] = {"description": _describe(name, cap)}
    if knob.choices:
        prop.update(type="string", enum=list(knob.values))
    else:
        prop["type"] = "integer" if knob.whole else "number"
        bounds = knob.bounds(cap)
        if bounds is not None:
            prop.update(minimum=bounds[0], maximum=bounds[1])
    if DEFAULTS[name] is not None:
        prop["default"] = min(DEFAULTS[name], cap) if name == "max_new_tokens" else DEFAULTS[name]
    return prop


def tool(answers: Answers) -> types.Tool:
    """The ``ask`` tool as an agent sees it."""
    limits, think = answers.limits, answers.backend.features.stage_beam
    offered = [name for name in API_KNOBS if think or name not in ("reasoning", "beams")]
    properties: dict[str, Any] = {
        "image": {
            "type": "string",
            "description": "The picture, as an http(s) URL of an image file (on a public address: the server "
            f"fetches it) or as a data URL (data:image/png;base64,...): {SUPPORTED}, at most "
            f"{limits.max_image_bytes // 2**20} MB and {limits.max_image_pixels / 1e6:g} megapixels.",
        },
        "question": {
            "type": "string",
            "description": f"What to ask about the picture, in plain text (at most {limits.max_question_chars} "
            "characters).",
        },
        **{name: _schema(name, limits.max_new_tokens) for name in offered},
    }
    harder = (
        ' Set reasoning to "stage-beam" (Think harder) when the question needs careful, multi-step reasoning '
        "(counting, comparing, reading small details): for each stage the model writes several candidates and "
        "judges which is best; it takes several times longer."
        if think
        else ""
    )
    description = (
        f"Ask the vision-language model {answers.backend.model} (LLaVA-CoT, Llama-3.2-Vision 11B) a question "
        "about one picture. It thinks in four stages before answering: SUMMARY (its plan), CAPTION (what it "
        "sees), REASONING (step by step) and CONCLUSION (the answer). The result starts with the CONCLUSION, "
        "then gives each stage under its name. Use it to describe, read, count or reason about what an image "
        f"shows. Each call stands alone (it does not remember earlier calls).{harder} Greedy decoding "
        "(temperature 0) gives the same answer every time."
    )
    return types.Tool(
        name=TOOL,
        title="Ask about a picture (LLaVA-CoT)",
        description=description,
        inputSchema={
            "type": "object",
            "properties": properties,
            "required": ["image", "question"],
            "additionalProperties": False,
        },
        outputSchema={
            "type": "object",
            "properties": {
                **{stage: {"type": "string", "description": f"The {stage.upper()} stage's text."} for stage in STAGES},
                "finish_reason": {
                    "type": "string",
                    "description": '"stop" (the answer ended) or "length" (it reached max_new_tokens)',
                },
                "completion_tokens": {"type": "integer"},
            },
            "required": [*STAGES, "finish_reason"],
        },
        annotations=types.ToolAnnotations(readOnlyHint=True, openWorldHint=True),
    )


def answer_text(result: GenerationResult) -> tuple[str, dict[str, Any]]:
    """The answer for an agent: the CONCLUSION first, then each stage under its name; and the same as data."""
    stages = parse_stages(result.text, final=True)
    texts = dict(zip(STAGES, stages.as_tuple(), strict=True))
    lines = [f"CONCLUSION: {texts['conclusion'] or '(none: the answer ended before its conclusion)'}"]
    lines += [f"{stage.upper()}: {texts[stage]}" for stage in STAGES[:-1] if texts[stage]]
    if stages.extra:
        lines.append(f"TEXT OUTSIDE THE STAGES: {stages.extra}")
    if result.finish_reason == "length":
        lines.append("(The answer reached max_new_tokens and was cut short: ask again with a larger max_new_tokens.)")
    data = {**texts, "finish_reason": result.finish_reason, "completion_tokens": result.completion_tokens}
    return "\n\n".join(lines), data


def refusal(error: DemoError) -> types.CallToolResult:
    """A refusal or failure as an MCP error: the error's title, then what to do."""
    return types.CallToolResult(content=[types.TextContent(type="text", text=f"{error.title}: {error}")], isError=True)


class MCPDoor:
    """The MCP server (the SDK's low-level server and its streamable-HTTP session manager) bound to the
    answer service: an ASGI endpoint for each of :attr:`paths`, run by the app's lifespan (:meth:`running`)."""

    paths = PATHS

    def __init__(self, answers: Answers, config: Config) -> None:
        self.answers = answers
        self.door = KeyDoor(config)
        self.tool = tool(answers)
        self.server: Server = Server("llava-cot-demo")
        self.server.list_tools()(self._list_tools)
        self.server.call_tool(validate_input=False)(self._call_tool)  # our door's messages, not jsonschema's
        self.manager = StreamableHTTPSessionManager(
            self.server,
            stateless=True,
            max_request_body_size=answers.limits.max_image_bytes * 4 // 3 + BODY_SLACK,
        )

    async def _list_tools(self) -> list[types.Tool]:
        return [self.tool]

    async def _call_tool(self, name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        request = self.server.request_context.request
        address = request.client.host if isinstance(request, Request) and request.client is not None else ""
        try:
            if name != TOOL:
                raise InvalidRequestError(f"No tool named {name!r}; this server has one tool, {TOOL!r}.")
            extra = sorted(set(arguments) - set(self.tool.inputSchema["properties"]))
            if extra:
                known = ", ".join(self.tool.inputSchema["properties"])
                raise InvalidRequestError(f"Unknown parameter {extra[0]!r}; the {TOOL} tool takes: {known}.")
            stream = await self.answers.start(lambda: self._admit(arguments), client_id(address))
            async with contextlib.aclosing(self.answers.follow(stream, MCP)) as moments:
                async for _ in moments:
                    pass
            text, data = answer_text(stream.result(0))
        except DemoError as err:
            return refusal(err)
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)], structuredContent=data)

    def _admit(self, arguments: dict[str, Any]) -> ValidRequest:
        """The door, with the tool's parameters (on a worker thread: an http(s) image is fetched here)."""
        limits = self.answers.limits
        image = arguments.get("image")
        if not isinstance(image, str) or not image.strip():
            raise InvalidRequestError("image is required: an http(s) URL of an image file, or a data: URL.", "image")
        scheme = image.split(":", 1)[0].strip().lower() if ":" in image else ""
        if scheme == "data":
            picture: Any = {"url": image.strip()}
        elif scheme in ("http", "https"):
            picture = fetch_image(image.strip(), limits.max_image_bytes)
        else:
            raise InvalidRequestError(
                "image must be an http(s) URL of an image file or a data: URL (data:image/png;base64,...).", "image"
            )
        values = {name: arguments[name] for name in API_KNOBS if name in arguments}
        return validate_request(picture, arguments.get("question"), sampling_from(values, limits), limits)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The HTTP endpoint: the key check, then the SDK's transport."""
        refused = self.door.refusal(Request(scope)) if scope["type"] == "http" else None
        if refused is not None:
            body = {"error": {"code": refused[0], "message": refused[1]}}
            await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.manager.handle_request(scope, receive, send)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The session manager's task group, for the app's lifespan."""
        async with self.manager.run():
            yield
