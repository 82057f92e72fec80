"""The web server: FastAPI with ``/health``, ``/metrics``, the OpenAI-compatible ``/v1`` and (``--mcp-server``)
the MCP tool, the Gradio page mounted at ``/``, all over one answer service; uvicorn.

One serving path for every mode: even with ``--share`` we run our own uvicorn app (so ``/health``
and ``/metrics`` always exist) and open Gradio's share tunnel to it ourselves; offline that fails
with a warning and the server keeps serving locally.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import logging
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import gradio as gr
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from vlm_demo import ASSETS_DIR
from vlm_demo.backends import make_backend, zerogpu
from vlm_demo.backends.base import Backend, Health
from vlm_demo.config import Config
from vlm_demo.images import DEFAULT_MAX_BYTES
from vlm_demo.models.choice import planned_model
from vlm_demo.results import LoadProgress
from vlm_demo.web.answers import Answers
from vlm_demo.web.api.openai_api import OpenAIAPI
from vlm_demo.web.api.responses_api import ResponsesAPI
from vlm_demo.web.asgi import Switch
from vlm_demo.web.loading import FAILED_LINGER_S, LoadingState, loading_app
from vlm_demo.web.metrics import CacheCounts, Metrics
from vlm_demo.web.operator import OperatorDoor
from vlm_demo.web.page.layout import CSS, THEME, DemoUI
from vlm_demo.web.spaces import expose_server, on_spaces, start_zerogpu

log = logging.getLogger(__name__)


REMOTE_BATCH_SIZE = 8  # Gradio batch size and concurrency when no engine here sizes the batches (Triton, ZeroGPU)


@dataclass
class DemoApp:
    """Everything :func:`create_app` built; tests and :func:`serve` use the parts they need."""

    app: FastAPI
    demo: gr.Blocks
    backend: Backend
    metrics: Metrics
    config: Config
    notice: str | None
    health: Callable[[Request], JSONResponse]  # what GET /health answers (the route, and the server's fast path)


def create_app(
    config: Config,
    backend: Backend | None = None,
    progress: Callable[[LoadProgress], None] | None = None,
    stopping: threading.Event | None = None,
) -> DemoApp:
    """Build the backend (unless given; ``progress`` hears how its loading goes, ``stopping`` ends it), the
    metrics, the page, and the FastAPI app around them."""
    if backend is None:
        backend = make_backend(config, progress, stopping)
    quiet_matplotlib()
    notice = backend.notice
    batch = backend.health().max_batch_size  # sized by the engine (GPU memory); 0: Triton batches on its side
    batch = batch or config.max_batch_size or REMOTE_BATCH_SIZE
    if batch != config.max_batch_size:
        config = dataclasses.replace(config, max_batch_size=batch)
    metrics = Metrics(
        queue_depth=lambda: backend.health().queue_depth,
        caches=lambda: cache_counts(backend),
        weights=lambda: backend.health().weights,
        decode_attention=lambda: backend.health().decode_attention,
    )
    backend.add_listener(metrics)
    answers = Answers(backend, config, metrics)  # every door's answers: the page's, /v1's and MCP's
    demo = DemoUI(answers, notice).build()

    mcp = None
    if config.mcp_server:
        from vlm_demo.web.api.mcp_tool import MCPDoor  # the mcp SDK loads only where it serves

        mcp = MCPDoor(answers, config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with mcp.running() if mcp is not None else contextlib.nullcontext():
            yield

    app = FastAPI(title="LLaVA-CoT demo", docs_url=None, redoc_url=None, lifespan=lifespan)
    served = config.triton_model if config.triton_url else backend.model  # Triton's name, not "name @ url"
    api = OpenAIAPI(answers, config, served)
    app.include_router(api.router(ResponsesAPI(api)))  # before the mount, which takes "/"
    if mcp is not None:
        for path in mcp.paths:
            app.router.add_route(path, mcp, include_in_schema=False)  # type: ignore[arg-type]  # Starlette runs a non-function endpoint as an ASGI app

    door = OperatorDoor(config)

    def health(request: Request) -> JSONResponse:
        """Liveness and readiness for load balancers: 200 when the model can take requests, else 503
        (the details only for the operator once the server is guarded)."""
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
        return door.health(request, body, 200 if report.ready else 503)

    app.get("/health")(health)

    @app.get("/metrics")
    def prometheus(request: Request) -> Response:
        if not door.allows(request):
            return door.refusal()
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
        mcp_server=False,  # ours (web/api/mcp_tool.py): one described tool, not the page's endpoints
    )
    return DemoApp(app, demo, backend, metrics, config, notice, health)


def quiet_matplotlib() -> None:
    """Choose matplotlib's Agg backend once, if matplotlib is installed (the benchmark's plots use it).

    Gradio wraps every call of an event, each streamed page update included, in a switch to Agg and back.
    With matplotlib's default backend still undecided, the first such call resolves it by importing pyplot
    (~0.5 s on the event loop, with hundreds of visitors waiting) and later calls check it again; chosen here,
    each switch is a dictionary lookup."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("agg")


def settle_heap() -> None:
    """Take everything built before serving (Gradio, FastAPI, the page's components) out of the garbage
    collector's reach. A full collection walks every object it tracks, and the event loop, so every stream and
    every ``/health`` probe, waits until it is done: with the demo's heap that took 0.2-1.4 s while 128 visitors
    streamed on a busy 2-core box (docs/benchmarks-history.md). What was built to serve lives as long as the process,
    so nothing is lost by never looking at it again; the answers' own short-lived objects are collected as
    before, and quickly."""
    gc.collect()
    gc.freeze()
    log.debug("%d objects built before serving are no longer walked by the garbage collector", gc.get_freeze_count())


def cache_counts(backend: Backend) -> CacheCounts:
    """The caches' counts for ``/metrics``: the response cache's here, the image-state cache's from the engine."""
    health = backend.health()
    engine = health.engine
    return CacheCounts(
        response_hits=health.response_cache_hits,
        response_misses=health.response_cache_misses,
        response_entries=health.response_cache_entries,
        image_hits=engine.image_cache_hits if engine is not None else 0,
        image_misses=engine.image_cache_misses if engine is not None else 0,
        vision_encodes=engine.vision_encodes if engine is not None else 0,
        vision_tiles=engine.vision_tiles if engine is not None else 0,
        kv_copied_bytes=engine.kv_copied_bytes if engine is not None else 0,
        kv_written_bytes=engine.kv_written_bytes if engine is not None else 0,
        attention_read_bytes=engine.attention_read_bytes if engine is not None else 0,
        attention_live_bytes=engine.attention_live_bytes if engine is not None else 0,
        picture_states_bytes=engine.picture_states_bytes if engine is not None else 0,
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
    """Take the port before anything loads: a busy port fails at once, in one line, and port 0 gets its
    real number to log."""
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
    """Take the port, answer at once with the loading page, build everything in the background, then serve
    the demo until interrupted; the backend is closed on the way out.

    A model that cannot load ends the server with its one-line reason (``SystemExit``).

    On a ZeroGPU Space the weights load first, on this thread (``spaces`` emulates CUDA for the thread that
    imported it), then ``spaces``' start-up packs them (:func:`~vlm_demo.web.spaces.start_zerogpu`); the port
    answers after that (the Space shows that it is starting meanwhile)."""
    share = config.share
    if share and on_spaces():
        log.warning("--share is ignored on Hugging Face Spaces (the Space already has a public URL)")
        share = False
    if share and not config.auth:
        log.warning(
            "--share without --auth: anyone with the link can use this demo%s; consider --auth USER:PASS",
            "" if config.api_key else " and its API at /v1",
        )
    with bind(config.host, config.port) as sock:
        port = sock.getsockname()[1]
        url = f"http://{f'[{config.host}]' if ':' in config.host else config.host}:{port}"
        backend = None
        if not config.triton_url and zerogpu.enabled():
            log.info("ZeroGPU: loading the weights before serving (the GPU calls fork this process)")
            backend = make_backend(config)
            start_zerogpu()
        planned = backend.model if backend is not None else planned_model(config)  # ZeroGPU's is loaded already
        state = LoadingState(config.triton_url or planned)
        switch = Switch(loading_app(state, OperatorDoor(config)))
        proxies = config.forwarded_allow_ips or ("*" if on_spaces() else None)  # a Space's proxy names the visitor
        server = _Server(
            uvicorn.Config(
                switch,
                host=config.host,
                port=port,
                log_level="info",
                timeout_graceful_shutdown=3,
                forwarded_allow_ips=proxies,
            )
        )
        build = _Build(config, state, switch, server, url, backend)
        switch.on_start = build.start
        if share:
            threading.Thread(target=_share_when_up, args=(server, config.host, port), daemon=True).start()
        log.info("serving on %s: a loading page until the model is ready (loading it can take minutes)", url)
        try:
            server.run(sockets=[sock])
        finally:
            build.close()
        if build.failure is not None:
            raise SystemExit(build.failure)


class _Server(uvicorn.Server):
    """uvicorn re-raises the stop signal (SIGTERM, Ctrl+C's SIGINT) the moment it has stopped serving: SIGTERM then
    ended this process there and then, before :func:`serve` could stop the engine process, and SIGINT raised a
    KeyboardInterrupt with its traceback. The stop was asked for and is carried out in order here, so once it is
    done the process ends as any program does (exit status 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # what uvicorn re-raises when this block ends


class _Build:
    """Builds the demo in a thread while the loading page answers, then switches the server over to it."""

    def __init__(
        self,
        config: Config,
        state: LoadingState,
        switch: Switch,
        server: uvicorn.Server,
        url: str,
        backend: Backend | None = None,
    ) -> None:
        self.config, self.state, self.switch, self.server, self.url = config, state, switch, server, url
        self.backend = backend  # built already (ZeroGPU); else built here, with the loading page showing its progress
        self.demo_app: DemoApp | None = None
        self.failure: str | None = None
        self._thread = threading.Thread(target=self._run, name="vlm-build", daemon=True)
        self._lock = threading.Lock()
        self._closed = False
        self.stopping = threading.Event()  # the server stops: a model still loading stops loading

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            demo_app = create_app(self.config, self.backend, progress=self.state.update, stopping=self.stopping)
            if self.backend is not None:  # built before serving: ZeroGPU's, whose GPU workers fork this process
                expose_server(demo_app.demo, self.server)
        except SystemExit as err:
            if not self.stopping.is_set():  # else the load was ended by the stop: nothing failed
                self._fail(str(err.code))
            return
        except Exception as err:  # a bug, not a bad model: still one clear line and an ended server
            log.exception("building the demo failed")
            self._fail(f"Cannot start the demo: {type(err).__name__}: {err}")
            return
        with self._lock:
            if self._closed:  # interrupted while loading: nobody will serve it
                demo_app.backend.close()
                return
            self.demo_app = demo_app
        settle_heap()  # before the first visitor: the loading page waits for the one full collection
        try:
            self.switch.activate(demo_app.app, demo_app.health, inline=not demo_app.backend.remote)
        except Exception as err:
            log.exception("starting the page failed")
            self._fail(f"Cannot start the page: {type(err).__name__}: {err}")
            return
        log.info("ready: serving %s (%s) on %s", demo_app.backend.model, demo_app.backend.name, self.url)

    def _fail(self, message: str) -> None:
        self.failure = message  # said once, as the process's last line, when the server has stopped
        self.state.fail(message)  # and meanwhile on the loading page and /health, for the visitors waiting there
        timer = threading.Timer(FAILED_LINGER_S, lambda: setattr(self.server, "should_exit", True))
        timer.daemon = True
        timer.start()

    def close(self) -> None:
        """The server has stopped: stop the backend, or the load still in progress (its engine process must not
        outlive this one)."""
        self.stopping.set()
        with self._lock:
            self._closed = True
            demo_app = self.demo_app
        if demo_app is not None:
            demo_app.backend.close()
        elif self._thread.is_alive():
            self._thread.join(30)
