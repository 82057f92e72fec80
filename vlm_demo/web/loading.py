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
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from vlm_demo.schema import LoadProgress
from vlm_demo.web.operator import OperatorDoor

log = logging.getLogger(__name__)

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
LOG_EVERY_S = 10.0  # the console hears about a long phase this often

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
            if progress.phase != phase or now - at >= LOG_EVERY_S:
                self._logged = (progress.phase, now)
                log.info("start-up: %s", describe(progress, now - self.started))

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
        body = {"error": {"message": f"The model is still loading: {state.report()['message']}.", "code": "loading"}}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})

    return app


class Switch:
    """The ASGI app uvicorn runs: the loading app, then (once activated) the real one, started in place."""

    def __init__(self, loading: FastAPI) -> None:
        self.loading = loading
        self.real: FastAPI | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_start: Callable[[], None] | None = None  # called once uvicorn's loop runs (starts the load)
        self._stack = contextlib.AsyncExitStack()

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
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

    async def _start(self, app: FastAPI) -> None:
        await self._stack.enter_async_context(app.router.lifespan_context(app))
        self.real = app

    def activate(self, app: FastAPI, timeout: float = 60.0) -> None:
        """From another thread: start ``app`` (its lifespan, in uvicorn's loop), then send it every request."""
        assert self.loop is not None, "uvicorn has not started"
        asyncio.run_coroutine_threadsafe(self._start(app), self.loop).result(timeout)
