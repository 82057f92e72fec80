"""The server answers from its first second: while the model builds or loads (minutes for the real one),
``/health`` says 503 with what is happening and how far along, and the page is a notice that turns into
the demo when the model is ready (the front door, :mod:`~vlm_demo.web.asgi`, then switches to the demo).
A start that fails says so there too (``"status": "failed"`` with the server's own message, for
``FAILED_LINGER_S`` before the server ends); a page that finds the server gone says that instead of waiting.
"""

from __future__ import annotations

import html
import logging
import os
import threading
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from vlm_demo import logs
from vlm_demo.errors import SERVER
from vlm_demo.results import LoadProgress
from vlm_demo.web.api.openai_wire import error_body
from vlm_demo.web.operator import OperatorDoor

log = logging.getLogger(__name__)

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
LOG_EVERY_S = 10.0  # a terminal hears about a long phase this often
LOG_QUIETLY_EVERY_S = 60.0  # and a log file this often
FAILED_LINGER_S = 5.0  # a failed start is shown this long (the page asks every 1.5 s) before the server ends


class LoadingState:
    """Where the start-up stands (thread-safe: the loader's threads update it, requests read it)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.started = time.monotonic()
        self.progress = LoadProgress("starting")
        self._lock = threading.Lock()
        self._logged: tuple[str, float] = ("", 0.0)
        self.failure: str | None = None  # why the start failed (the server ends soon after saying so)

    def fail(self, message: str) -> None:
        """The start failed: ``/health`` and the loading page say ``message`` until the server ends."""
        self.failure = message

    def update(self, progress: LoadProgress) -> None:
        with self._lock:
            self.progress = progress
            if progress.model is not None:
                self.model = progress.model
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
        if state.failure is not None:
            body.update(status="failed", error=state.failure)
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
