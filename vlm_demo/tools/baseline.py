"""A benchmark baseline: the design documents' FastAPI static batcher, with their bugs fixed.

``POST /v1/answer`` with ``{"image": base64 PNG/JPEG, "question", "max_new_tokens", "temperature"}``
returns the whole answer (no streaming). A collector thread takes the first waiting request, waits up
to ``--window-ms`` (100) for up to ``--max-batch-size`` (4) more, and runs the group as one batched
``generate`` (our worker: left padding, per-row stop), resolving each caller's future on the event
loop. Unlike the documents' version it pads on the left, decodes only new tokens, completes futures
thread-safely and fails only the request that fails. What it keeps is the design: static batches
(a batch runs until its longest answer ends) and no streaming — that is what ``bench`` compares with.

    python -m vlm_demo.tools.baseline --model tiny --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import queue
import threading
import time
from typing import Any

from vlm_demo.errors import DemoError
from vlm_demo.request import Limits, SamplingParams, validate_request

log = logging.getLogger("vlm_demo.tools.baseline")


class StaticBatcher:
    """Collector + inference thread over one worker."""

    def __init__(self, worker: Any, max_batch_size: int = 4, window_s: float = 0.1) -> None:
        self.worker = worker
        self.max_batch_size = max_batch_size
        self.window_s = window_s
        self.waiting: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, name="static-batcher", daemon=True).start()

    async def answer(self, valid: Any) -> Any:
        """Queue one request; resolves to its :class:`~vlm_demo.results.GenerationResult`."""
        from vlm_demo.engine.batching.job import Request, make_request

        loop = asyncio.get_running_loop()
        future = loop.create_future()
        request: Request = await loop.run_in_executor(None, make_request, valid, self.worker)
        self.waiting.put((request, loop, future))
        return await future

    def _loop(self) -> None:
        while True:
            group = [self.waiting.get()]
            deadline = time.monotonic() + self.window_s
            while len(group) < self.max_batch_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    group.append(self.waiting.get(timeout=left))
                except queue.Empty:
                    break
            requests = [r for r, _, _ in group]
            try:
                self.worker.run(requests)
                outcomes: list[Any] = [r.result if r.result is not None else r.error for r in requests]
            except Exception as exc:  # noqa: BLE001 - reported to each caller
                outcomes = [exc] * len(requests)
            for (_, loop, future), outcome in zip(group, outcomes, strict=True):
                loop.call_soon_threadsafe(_settle, future, outcome)


def _settle(future: asyncio.Future, outcome: Any) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def create_app(worker: Any, max_batch_size: int = 4, window_ms: float = 100.0) -> Any:
    from fastapi import FastAPI, HTTPException

    batcher = StaticBatcher(worker, max_batch_size, window_ms / 1000.0)
    app = FastAPI(title="static batcher baseline")
    limits = Limits(max_new_tokens=100_000)

    @app.get("/health")
    def health() -> dict[str, bool]:
        return {"ready": True}

    @app.post("/v1/answer")
    async def answer(body: dict[str, Any]) -> dict[str, Any]:
        try:
            image = base64.b64decode(body.get("image", ""))
            params = SamplingParams(
                max_new_tokens=body.get("max_new_tokens", 512), temperature=body.get("temperature", 0.0)
            )
            valid = validate_request(image, body.get("question"), params, limits)
            result = await batcher.answer(valid)
        except DemoError as err:
            raise HTTPException(400, str(err)) from None
        return {
            "text": result.text,
            "completion_tokens": result.completion_tokens,
            "batch_size": result.batch_size,
            "total_s": result.total_s,
        }

    return app


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m vlm_demo.tools.baseline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--window-ms", type=float, default=100.0)
    parser.add_argument("--cpu-threads", type=int, default=1)
    args = parser.parse_args(argv)
    import uvicorn

    from vlm_demo.engine.weights.loader import load

    worker = load(args.model, cpu_threads=args.cpu_threads)
    uvicorn.run(create_app(worker, args.max_batch_size, args.window_ms), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
