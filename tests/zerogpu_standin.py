"""A stand-in for Hugging Face ZeroGPU, for the tests: ZeroGPU's scheduler and CUDA cannot run here; the rest of
the ``spaces`` package (pinned in requirements.txt) runs as it does on a Space, with ``SPACES_ZERO_GPU=true``.

Real, ``spaces``' own code: ``spaces.GPU`` and its wrappers; each call in a worker process forked with
``multiprocessing``'s fork, its arguments and every yielded Step pickled through ``spaces``' queues; one call at a
time per worker, and an idle worker reused for the next call on its GPU; the stop event a closed generator sets;
the start-up hook; the client of the scheduler (``/schedule`` with the visitor's token and the call's duration,
``/allow``, ``/release``, ``/startup-report``) and the quota messages it writes.

Faked, and only these two:

- the scheduler (Hugging Face's device API at ``SPACES_ZERO_DEVICE_API_URL``): :class:`FakeScheduler`, an HTTP
  server on a loopback port in the test's process. It lends GPU indexes (an index whose last call ended well is
  "idle": ``spaces`` reuses its warm worker), refuses as a test tells it (quota), and records every request;
- CUDA (``spaces.zero.torch``, which patches a CUDA build of torch and cannot even load on this CPU-only one):
  :func:`cpu_torch`, the same functions with nothing to move (the weights stay in host memory, which the fork
  shares with the worker), each call recorded. Where ZeroGPU's emulation raises on a real CUDA initialisation in
  the web process, this one records it and raises too.

Run as a script it is the app under the stand-in (``python tests/zerogpu_standin.py APP_ARGS``, with
``SPACES_ZERO_GPU=true``): it puts :func:`cpu_torch` in place of ``spaces.zero.torch``, records in which process
the weights load, engines are built and a GPU call's answers are stopped early, and runs ``app.main``. What it
records goes to the JSON-lines file ``$ZEROGPU_STANDIN_EVENTS`` (:func:`read_events`), one line per event with
its process id.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import types
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

ROOT = Path(__file__).resolve().parents[1]
EVENTS = "ZEROGPU_STANDIN_EVENTS"


def record(event: str, **facts: Any) -> None:
    """One line in the events file: what happened, in which process."""
    path = os.environ.get(EVENTS)
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"event": event, "pid": os.getpid(), **facts}) + "\n")


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every event recorded so far, in order."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# ---- the scheduler, faked (in the test's process) ------------------------------------------------------------------


class FakeScheduler:
    """ZeroGPU's scheduler as ``spaces``' client speaks to it over HTTP (``spaces/zero/api.py``): ``/schedule``
    lends a GPU index or refuses with a quota answer the test queued, ``/allow`` names a new worker's process,
    ``/release`` gives the GPU back (an index released without failure is idle next time: its worker stays warm),
    ``/startup-report`` hears the app start. Each request's parameters are recorded, in order."""

    def __init__(self) -> None:
        self.schedules: list[dict[str, str]] = []  # durationSeconds, token (the visitor's X-IP-Token), taskId, ...
        self.allowed: list[dict[str, str]] = []  # allowToken, pid: a worker's first call
        self.released: list[dict[str, str]] = []  # allowToken, fail
        self.lent: list[dict[str, Any]] = []  # what each granted /schedule answered (allowToken, nvidiaIndex, idle)
        self.startup_reports = 0
        self.refusals: list[dict[str, int]] = []  # answers for the next /schedule calls: {"left": s, "wait": s}
        self._lock = threading.Lock()
        self._busy: dict[str, int] = {}  # allowToken -> GPU index, while its call runs
        self._idle: set[int] = set()  # GPUs whose last call ended well
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeScheduler:
        threading.Thread(target=self._server.serve_forever, name="fake-zerogpu-scheduler", daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def answer(self, path: str, query: dict[str, str]) -> tuple[int, dict[str, Any] | None]:
        with self._lock:
            if path == "/schedule":
                self.schedules.append(query)
                if self.refusals:
                    return 429, self.refusals.pop(0)
                busy = set(self._busy.values())
                index = next(i for i in itertools.count() if i not in busy)
                token = f"allow-{len(self.schedules)}"
                self._busy[token] = index
                lent = {"idle": index in self._idle, "nvidiaIndex": index, "allowToken": token}
                self._idle.discard(index)
                self.lent.append(lent)
                return 200, {**lent, "nvidiaUUID": f"GPU-standin-{index}"}
            if path == "/allow":
                self.allowed.append(query)
                return 200, None
            if path == "/release":
                self.released.append(query)
                index = self._busy.pop(query["allowToken"], None)
                if index is not None and query.get("fail") != "true":
                    self._idle.add(index)
                return 200, None
            if path == "/startup-report":
                self.startup_reports += 1
                return 200, None
        return 404, None

    def released_well(self, token: str) -> bool:
        with self._lock:
            return any(r["allowToken"] == token and r.get("fail") != "true" for r in self.released)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        scheduler = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                url = urlparse(self.path)
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, body = scheduler.answer(url.path, {k: v[-1] for k, v in parse_qs(url.query).items()})
                data = json.dumps(body).encode() if body is not None else b""
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


# ---- CUDA, faked (in the app's process and its GPU workers) ---------------------------------------------------------


def cpu_torch() -> types.ModuleType:
    """``spaces.zero.torch`` for a machine without CUDA: ``patch`` (at ``import spaces``: ZeroGPU's CUDA emulation)
    sets a trap on CUDA's initialisation instead, ``pack`` (the start-up hook), and in a worker's first call
    ``unpatch``, ``init`` (the GPU the scheduler lent) and ``move`` (the weights onto it) are recorded and move
    nothing; ``size`` is 0 (nothing to transfer)."""
    import torch

    module = types.ModuleType("spaces.zero.torch")
    lazy_init = torch.cuda._lazy_init

    def trap() -> None:
        record("cuda_init")
        raise RuntimeError("CUDA initialised in the ZeroGPU web process (the stand-in's trap)")

    def patch() -> None:
        record("patch")
        torch.cuda._lazy_init = trap

    def unpatch() -> None:
        record("unpatch")
        torch.cuda._lazy_init = lazy_init

    def pack() -> int:
        record("pack")
        return 0

    def init(nvidia_uuid: str) -> None:
        record("init", gpu=nvidia_uuid)

    def move(callback: Callable[[int], Any] | None = None) -> None:
        record("move")

    functions: dict[str, Callable[..., Any]] = {
        "patch": patch,
        "unpatch": unpatch,
        "pack": pack,
        "init": init,
        "move": move,
        "size": lambda: 0,
        "enter_mode": lambda: None,
        "is_in_bad_fork": torch.cuda._is_in_bad_fork,
    }
    module.__dict__.update(functions)
    return module


def watch_the_app() -> None:
    """Record in which process the weights load and engines are built, and when a GPU call that ended early (Stop,
    a closed tab) stops its answers in the worker."""
    import vlm_demo.engine
    import vlm_demo.engine.weights.loader as loader
    from vlm_demo.backends.zerogpu.calls import GpuSide

    load_worker, make_engine, settle = loader.load_worker, vlm_demo.engine.make_engine, GpuSide._settle

    def loading(*args: Any, **kwargs: Any) -> Any:
        record("load_weights")
        return load_worker(*args, **kwargs)

    def building(*args: Any, **kwargs: Any) -> Any:
        record("build_engine")
        return make_engine(*args, **kwargs)

    def settling(self: GpuSide, engine: Any, running: set[int]) -> None:
        if running:
            record("stopped", answers=len(running))
        settle(self, engine, running)

    loader.load_worker = loading
    vlm_demo.engine.make_engine = building
    GpuSide._settle = settling  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    sys.path.insert(0, str(ROOT))
    sys.modules["spaces.zero.torch"] = cpu_torch()  # before `import spaces` (app.main's first import)
    watch_the_app()
    import app

    app.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
