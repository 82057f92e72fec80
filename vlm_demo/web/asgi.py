"""The ASGI front door uvicorn serves: the loading app, then the demo, with ``/health`` and new visitors'
arrivals handled ahead of everything else.

:class:`Switch` hands every request to the loading app (:mod:`~vlm_demo.web.loading`) until
:meth:`Switch.activate` gets the real one (the FastAPI app with Gradio mounted), whose lifespan it then
runs (that starts Gradio's queue) inside uvicorn's own event loop, and to the real app from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

Scope = dict[str, Any]

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
