"""The web server: FastAPI with ``/health`` and ``/metrics``, the Gradio page mounted at ``/``, uvicorn.

One serving path for every mode: even with ``--share`` we run our own uvicorn app (so ``/health``
and ``/metrics`` always exist) and open Gradio's share tunnel to it ourselves; offline that fails
with a warning and the server keeps serving locally.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import gradio as gr
import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from vlm_demo.backends import Backend, make_backend
from vlm_demo.config import TINY, Config
from vlm_demo.images import DEFAULT_MAX_BYTES
from vlm_demo.metrics import Metrics
from vlm_demo.spaces_compat import on_spaces
from vlm_demo.ui import ASSETS_DIR, CSS, THEME, DemoUI

log = logging.getLogger(__name__)

REAL_MODEL_HINT = (
    "To run the real model, use a machine with a CUDA GPU (about 24 GB of memory for bf16) and start "
    "`python app.py --model Xkev/Llama-3.2V-11B-cot`."
)


@dataclass
class DemoApp:
    """Everything :func:`create_app` built; tests and :func:`serve` use the parts they need."""

    app: FastAPI
    demo: gr.Blocks
    backend: Backend
    metrics: Metrics
    config: Config
    notice: str | None


def choose_model(config: Config, cuda: bool | None = None) -> tuple[Config, str | None]:
    """Fall back to the tiny model when there is no GPU and nobody asked for a model; say so.

    Returns the config to build the backend from and the banner text for the page (``None`` when
    the real model runs). Loading 21 GB of weights on a CPU would take many minutes and then answer
    at seconds per token, so a working page with an honest banner is the better default.
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if config.triton_url:
        return config, None
    if not cuda and not config.model_explicit and config.model != TINY:
        log.warning("no CUDA GPU and no --model given: serving the tiny test model instead of %s", config.model)
        notice = (
            "**⚠ No GPU found, so this page runs the tiny offline test model**, not Llama-3.2V-11B-cot. "
            "It only knows solid-colour images (try the colour examples). " + REAL_MODEL_HINT
        )
        return dataclasses.replace(config, model=TINY), notice
    if config.model == TINY:
        return config, (
            "**⚠ This page runs the tiny offline test model** (`--model tiny`): it only knows solid-colour "
            "images. " + REAL_MODEL_HINT
        )
    return config, None


def create_app(config: Config, backend: Backend | None = None) -> DemoApp:
    """Build the backend (unless given), the metrics, the page, and the FastAPI app around them."""
    config, notice = choose_model(config)
    if backend is None:
        backend = make_backend(config)
    metrics = Metrics(queue_depth=lambda: int(backend.health().get("queue_depth", 0)))
    backend.add_listener(metrics)
    demo = DemoUI(backend, config, metrics, notice).build()

    app = FastAPI(title="LLaVA-CoT demo", docs_url=None, redoc_url=None)

    @app.get("/health")
    def health() -> JSONResponse:
        """Liveness and readiness for load balancers: 200 when the model can take requests, else 503."""
        try:
            details: dict[str, Any] = dict(backend.health())
        except Exception as err:  # a remote backend that cannot be reached is simply not ready
            details = {"ready": False, "queue_depth": 0, "error": str(err)}
        ready = bool(details.pop("ready", False))
        body = {
            "status": "ok" if ready else "unavailable",
            "backend": backend.name,
            "model": backend.model,
            "ready": ready,
            "queue_depth": int(details.pop("queue_depth", 0) or 0),
            "tiny_notice": notice is not None,
            "details": details,
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    auth = tuple(config.auth.split(":", 1)) if config.auth else None
    app = gr.mount_gradio_app(
        app,
        demo,
        path="/",
        theme=THEME,
        css=CSS,
        auth=auth,
        auth_message="This demo is password-protected." if auth else None,
        allowed_paths=[ASSETS_DIR],
        max_file_size=DEFAULT_MAX_BYTES,
        footer_links=["api", "gradio"],
        run_history=False,
        ssr_mode=False,
        show_error=True,
    )
    return DemoApp(app, demo, backend, metrics, config, notice)


def open_share_link(host: str, port: int) -> str | None:
    """Ask Gradio's share server for a public URL tunnelled to ``host:port``; ``None`` if it fails."""
    from gradio import networking

    local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    try:
        url = networking.setup_tunnel(local, port, secrets.token_urlsafe(32), None, None)
    except Exception as err:
        log.warning("could not create a share link (%s); still serving on http://%s:%d", err, local, port)
        return None
    url = "https://" + url.split("://", 1)[-1]
    log.warning("public share link: %s (anyone with it can use this demo and its GPU)", url)
    return url


def _share_when_up(server: uvicorn.Server, host: str, port: int) -> None:
    while not server.started and not server.should_exit:
        time.sleep(0.1)
    if server.started:
        open_share_link(host, port)


def serve(config: Config) -> None:
    """Build everything and serve until interrupted; the backend is closed on the way out."""
    demo_app = create_app(config)
    share = config.share
    if share and on_spaces():
        log.warning("--share is ignored on Hugging Face Spaces (the Space already has a public URL)")
        share = False
    if share and not config.auth:
        log.warning("--share without --auth: anyone with the link can use this demo; consider --auth USER:PASS")
    server = uvicorn.Server(
        uvicorn.Config(demo_app.app, host=config.host, port=config.port, log_level="info", timeout_graceful_shutdown=3)
    )
    if share:
        threading.Thread(target=_share_when_up, args=(server, config.host, config.port), daemon=True).start()
    log.info("serving %s (%s) on http://%s:%d", demo_app.backend.model, demo_app.backend.name, config.host, config.port)
    try:
        server.run()
    finally:
        demo_app.backend.close()
