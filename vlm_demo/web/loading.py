"""The server answers from its first second: while the model builds or loads (minutes for the real one),
``/health`` says 503 with what is happening and how far along, and the page is a notice that turns into
the demo when the model is ready.

:class:`Switch` is the ASGI app uvicorn serves: it hands every request to the loading app until
:meth:`Switch.activate` gets the real one (the FastAPI app with Gradio mounted), whose lifespan it then
runs (that starts Gradio's queue) inside uvicorn's own event loop, and to the real app from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from vlm_demo import logs
from vlm_demo.schema import LoadProgress
from vlm_demo.web.openai_wire import SERVER, error_body
from vlm_demo.web.operator import OperatorDoor

log = logging.getLogger(__name__)

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
LOG_EVERY_S = 10.0  # a terminal hears about a long phase this often
LOG_QUIETLY_EVERY_S = 60.0  # and a log file this often

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class LoadingState:
    """Where the start-up stands (thread-safe: the loader's threads update it, requests read it)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.started = time.monotonic()
        self.progress = LoadProgress("starting")
        self._lock = threading.Lock()
        self._logged: tuple[str, float] = ("", 0.0)

    def update(self, progress: LoadProgress) -> None:
        with self._lock:
            self.progress = progress
            phase, at = self._logged
            now = time.monotonic()
            watched = logs.interactive()  # a log file gets each phase once, then a line a minute, no percentages
            if progress.phase != phase or now - at >= (LOG_EVERY_S if watched else LOG_QUIETLY_EVERY_S):
                self._logged = (progress.phase, now)
                shown = progress if watched else LoadProgress(progress.phase)
                log.info("start-up: %s", describe(shown, now - self.started))

    def report(self) -> dict[str, Any]:
        with self._lock:
            progress = self.progress
        elapsed = time.monotonic() - self.started
        return {
            "phase": progress.phase,
            "elapsed_s": round(elapsed, 1),
            "fraction": None if progress.fraction is None else round(progress.fraction, 3),
            "eta_s": None if progress.eta_s is None else round(progress.eta_s, 1),
            "message": describe(progress, elapsed),
        }


def describe(progress: LoadProgress, elapsed: float) -> str:
    """One line for a person: the phase, how far along, about how long is left."""
    parts = [progress.phase]
    if progress.fraction is not None:
        parts.append(f"{100 * progress.fraction:.0f} %")
    parts.append(f"{elapsed:.0f} s so far")
    if progress.eta_s is not None:
        parts.append(f"about {progress.eta_s:.0f} s left" if progress.eta_s >= 1 else "almost done")
    return " · ".join(parts)


def loading_app(state: LoadingState, door: OperatorDoor) -> FastAPI:
    """What answers until the model is ready: ``/health`` (503, with the progress), a page that waits for
    it, and a clear 503 for everything else (the API, Gradio's routes)."""
    app = FastAPI(docs_url=None, redoc_url=None)
    with open(os.path.join(STATIC_DIR, "loading.html"), encoding="utf-8") as fh:
        template = fh.read()

    @app.get("/health")
    def health(request: Request) -> JSONResponse:
        body = {"status": "loading", "ready": False, "model": state.model, "loading": state.report()}
        return door.health(request, body, 503)

    @app.get("/")
    def page() -> HTMLResponse:
        report = state.report()
        text = template.replace("{{model}}", html.escape(state.model)).replace(
            "{{message}}", html.escape(report["message"])
        )
        return HTMLResponse(text, status_code=503, headers={"Retry-After": "5", "Cache-Control": "no-store"})

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    def not_yet(path: str, request: Request) -> Response:
        body = error_body(f"The model is still loading: {state.report()['message']}.", SERVER, None, "loading")
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})  # OpenAI's shape, for /v1 clients

    return app


# A new visitor's first call is the web process's heaviest request: Gradio builds the visitor's session (a
# config for every component of the page) in one go on the event loop, ~4 ms. A hundred visitors asking
# together would make one turn of the loop last half a second, and every stream already running, and every
# /health probe, would wait for it. A few at a time, the loop turns every ~20 ms: the same work, spread out,
# with everyone else served in between. Each call's body is read in full before it takes its turn, so a
# client sending slowly holds no turn (and a body past JOIN_MAX_BYTES is refused: a call names its files,
# it does not carry them).
ARRIVALS = ("/gradio_api/queue/join",)
ARRIVALS_AT_ONCE = 4
JOIN_MAX_BYTES = 4 * 1024 * 1024


class Switch:
    """The ASGI app uvicorn runs: the loading app, then (once activated) the real one, started in place.

    Once active, ``GET /health`` is answered here, ahead of the real app's dozen middleware layers and two
    routers, by the same function its route uses: a load balancer's probe costs little while hundreds of
    visitors stream. A check that asks another server (Triton) runs on a thread of its own, never on the loop."""

    def __init__(self, loading: FastAPI) -> None:
        self.loading = loading
        self.real: FastAPI | None = None
        self.health: Callable[[Request], Response] | None = None
        self.health_inline = False  # the check reads local state only: answer on the loop, no thread hop
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_start: Callable[[], None] | None = None  # called once uvicorn's loop runs (starts the load)
        self._stack = contextlib.AsyncExitStack()
        self._probes = ThreadPoolExecutor(1, thread_name_prefix="vlm-health")
        self._arrivals = asyncio.Semaphore(ARRIVALS_AT_ONCE)

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] == "http" and scope["path"] in ARRIVALS:
            await self._in_turn(scope, receive, send)
            return
        await self._serve(scope, receive, send)

    async def _in_turn(self, scope: Scope, receive: Callable, send: Callable) -> None:
        """Read the request's body, then serve it when one of the ``ARRIVALS_AT_ONCE`` turns is free."""
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before it finished sending
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > JOIN_MAX_BYTES:
                await JSONResponse({"detail": "Request body too large."}, status_code=413)(scope, receive, send)
                return
            more = message.get("more_body", False)
        body: dict[str, Any] | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> dict[str, Any]:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()  # then whatever the client does next (a disconnect)

        async with self._arrivals:
            await self._serve(scope, replay, send)

    async def _serve(self, scope: Scope, receive: Callable, send: Callable) -> None:
        health = self.health
        if health is not None and scope["type"] == "http" and scope["path"] == "/health" and scope["method"] == "GET":
            request = Request(scope, receive)
            if self.health_inline:
                response = health(request)
            else:
                response = await asyncio.get_running_loop().run_in_executor(self._probes, health, request)
            await response(scope, receive, send)
            return
        await (self.real or self.loading)(scope, receive, send)

    async def _lifespan(self, receive: Callable, send: Callable) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.loop = asyncio.get_running_loop()
                if self.on_start is not None:
                    self.on_start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._stack.aclose()  # the real app's shutdown (Gradio's queue)
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _start(self, app: FastAPI, health: Callable[[Request], Response] | None, inline: bool) -> None:
        await self._stack.enter_async_context(app.router.lifespan_context(app))
        self.real, self.health, self.health_inline = app, health, inline

    def activate(
        self,
        app: FastAPI,
        health: Callable[[Request], Response] | None = None,
        inline: bool = False,
        timeout: float = 60.0,
    ) -> None:
        """From another thread: start ``app`` (its lifespan, in uvicorn's loop), then send it every request
        (``GET /health`` to ``health``, when given: on the loop if ``inline``, else on a thread of its own)."""
        assert self.loop is not None, "uvicorn has not started"
        asyncio.run_coroutine_threadsafe(self._start(app, health, inline), self.loop).result(timeout)
