"""The web server: FastAPI with ``/health``, ``/metrics`` and the OpenAI-compatible ``/v1``, the Gradio page
mounted at ``/``, uvicorn.

One serving path for every mode: even with ``--share`` we run our own uvicorn app (so ``/health``
and ``/metrics`` always exist) and open Gradio's share tunnel to it ourselves; offline that fails
with a warning and the server keeps serving locally.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass

import gradio as gr
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from vlm_demo import ASSETS_DIR
from vlm_demo.backends import Backend, make_backend
from vlm_demo.backends.base import Health
from vlm_demo.config import Config
from vlm_demo.images import DEFAULT_MAX_BYTES
from vlm_demo.web.metrics import CacheCounts, Metrics
from vlm_demo.web.openai_api import OpenAIAPI
from vlm_demo.web.page import CSS, THEME, DemoUI
from vlm_demo.web.spaces import on_spaces

log = logging.getLogger(__name__)


REMOTE_BATCH_SIZE = 8  # Gradio batch size and concurrency when Triton (not we) sizes the batches


@dataclass
class DemoApp:
    """Everything :func:`create_app` built; tests and :func:`serve` use the parts they need."""

    app: FastAPI
    demo: gr.Blocks
    backend: Backend
    metrics: Metrics
    config: Config
    notice: str | None


def create_app(config: Config, backend: Backend | None = None) -> DemoApp:
    """Build the backend (unless given), the metrics, the page, and the FastAPI app around them."""
    if backend is None:
        backend = make_backend(config)
    notice = backend.notice
    batch = backend.health().max_batch_size  # sized by the engine (GPU memory); 0: Triton batches on its side
    batch = batch or config.max_batch_size or REMOTE_BATCH_SIZE
    if batch != config.max_batch_size:
        config = dataclasses.replace(config, max_batch_size=batch)
    metrics = Metrics(queue_depth=lambda: backend.health().queue_depth, caches=lambda: cache_counts(backend))
    backend.add_listener(metrics)
    ui = DemoUI(backend, config, metrics, notice)
    demo = ui.build()

    app = FastAPI(title="LLaVA-CoT demo", docs_url=None, redoc_url=None)
    served = config.triton_model if config.triton_url else backend.model  # Triton's name, not "name @ url"
    app.include_router(OpenAIAPI(ui.handlers, config, served).router())  # before the mount, which takes "/"

    @app.get("/health")
    def health() -> JSONResponse:
        """Liveness and readiness for load balancers: 200 when the model can take requests, else 503."""
        try:
            report = backend.health()
        except Exception as err:  # a remote backend that cannot be reached is simply not ready
            report = Health(False, error=str(err))
        body = {
            "status": "ok" if report.ready else "unavailable",
            "backend": backend.name,
            "model": backend.model,
            "ready": report.ready,
            "queue_depth": report.queue_depth,
            "tiny_notice": notice is not None,
            "details": report.details(),
        }
        return JSONResponse(body, status_code=200 if report.ready else 503)

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
        mcp_server=config.mcp_server,
    )
    return DemoApp(app, demo, backend, metrics, config, notice)


def cache_counts(backend: Backend) -> CacheCounts:
    """The caches' counts for ``/metrics``: the response cache's here, the image-state cache's from the engine."""
    health = backend.health()
    engine = health.engine
    return CacheCounts(
        response_hits=health.response_cache_hits,
        response_misses=health.response_cache_misses,
        image_hits=engine.image_cache_hits if engine is not None else 0,
        image_misses=engine.image_cache_misses if engine is not None else 0,
        vision_encodes=engine.vision_encodes if engine is not None else 0,
    )


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


def bind(host: str, port: int) -> socket.socket:
    """Take the port before the (possibly minutes-long) model build: a busy port fails at once, in one
    line, and port 0 gets its real number to log. Not listening yet: until the page is ready, clients
    are refused rather than left hanging."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as err:
        raise SystemExit(f"error: cannot serve on host {host!r}: {err.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does; a listening port still refuses
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise SystemExit(
                f"error: port {port} on {host} is already in use (another server?); "
                "choose another with --port, or --port 0 for any free one"
            ) from None
        raise SystemExit(f"error: cannot serve on {host}:{port}: {err.strerror}") from None
    return sock


def serve(config: Config) -> None:
    """Take the port, build everything, and serve until interrupted; the backend is closed on the way out."""
    with bind(config.host, config.port) as sock:
        port = sock.getsockname()[1]
        url = f"http://{f'[{config.host}]' if ':' in config.host else config.host}:{port}"
        log.info("the page will be at %s once the model is ready (building or loading it can take minutes)", url)
        demo_app = create_app(config)
        share = config.share
        if share and on_spaces():
            log.warning("--share is ignored on Hugging Face Spaces (the Space already has a public URL)")
            share = False
        if share and not config.auth:
            log.warning(
                "--share without --auth: anyone with the link can use this demo%s; consider --auth USER:PASS",
                "" if config.api_key else " and its API at /v1",
            )
        proxies = config.forwarded_allow_ips or ("*" if on_spaces() else None)  # a Space's proxy names the visitor
        server = uvicorn.Server(
            uvicorn.Config(
                demo_app.app,
                host=config.host,
                port=port,
                log_level="info",
                timeout_graceful_shutdown=3,
                forwarded_allow_ips=proxies,
            )
        )
        if share:
            threading.Thread(target=_share_when_up, args=(server, config.host, port), daemon=True).start()
        log.info("serving %s (%s) on %s", demo_app.backend.model, demo_app.backend.name, url)
        try:
            server.run(sockets=[sock])
        finally:
            demo_app.backend.close()
