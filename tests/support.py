"""Helpers shared by the test modules (importable because pytest puts ``tests/`` on the path): the door with
test limits, free loopback ports, and the servers the end-to-end tests start (``app.py``, our Triton)."""

from __future__ import annotations

import base64
import importlib.util
import io
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests

from vlm_demo.request import Limits, SamplingParams, ValidParams, ValidRequest, validate_request

ROOT = Path(__file__).resolve().parents[1]
TEST_LIMITS = Limits(max_new_tokens=10_000)  # long forced answers in the engine tests


def door(image: Any, question: Any, params: SamplingParams | None = None, history: Any = None) -> ValidRequest:
    """The shared door with generous limits: what every backend's caller does before submitting."""
    return validate_request(image, question, params, TEST_LIMITS, history)


def checked(params: SamplingParams) -> ValidParams:
    """Parameters through the door's validation alone (for an engine ``Request`` a test builds itself)."""
    return params.validated(TEST_LIMITS.max_new_tokens)


def wait_until(
    condition: Callable[[], Any], timeout: float = 60, every: float = 0.05, what: str = "", fail: bool = True
) -> Any:
    """Poll a state until it holds (the tests' one polling wait, for states another process or thread
    reaches): the condition's value, or after ``timeout`` seconds a failure naming ``what`` (with ``fail``
    false: the last value)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline and not fail:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout} s for {what or getattr(condition, '__name__', 'a condition')}")
        time.sleep(every)


class Stepper:
    """An engine driven by hand: ``step()`` on the test's thread (its own thread never starts), each Step
    handed to the handles ``submit`` returned. Tests of policy count steps with it, not seconds."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.steps = 0

    def submit(self, valid: ValidRequest) -> Any:
        return self.engine.submit(valid)

    def step(self, count: int = 1) -> None:
        for _ in range(count):
            self.engine.table.apply(self.engine.step())
            self.steps += 1

    def until(self, condition: Callable[[], Any], limit: int = 5000) -> int:
        """Step until ``condition`` holds; the steps it took."""
        start = self.steps
        while not condition():
            assert self.steps - start < limit, f"not reached in {limit} steps"
            self.step()
        return self.steps - start


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (all held until each is known, then released)."""
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def free_port() -> int:
    return free_ports(1)[0]


def server_env(**extra: str) -> dict[str, str]:
    """The environment a test server runs in: offline, no analytics, unbuffered logs."""
    return dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **extra)


# ---- the web app ---------------------------------------------------------------------------------------


def start_app(
    port: int,
    *extra: str,
    env: dict[str, str] | None = None,
    model: str | None = "tiny",
    script: str = "app.py",
    new_group: bool = False,
) -> subprocess.Popen:
    """``python app.py --model tiny`` (``model=None``: no --model, as a newcomer runs it; ``script``: another
    launcher of ``app.main``) on a loopback port (``extra`` flags after the defaults win). Its output goes to a file
    (read by :func:`server_output`): a pipe nobody reads would stall a chatty server. ``new_group``: in a process
    group of its own (as ``setsid``), whose id is its pid, for a test that stops the whole group."""
    chosen = ["--model", model] if model else []
    cmd = [sys.executable, script, *chosen, "--host", "127.0.0.1", "--port", str(port), *extra]
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed by stop_app
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env or server_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=new_group,
    )
    proc.log = log  # type: ignore[attr-defined]
    return proc


def server_output(proc: subprocess.Popen) -> str:
    """Everything a server started by :func:`start_app` has printed so far."""
    proc.log.flush()  # type: ignore[attr-defined]
    proc.log.seek(0)  # type: ignore[attr-defined]
    return proc.log.read()  # type: ignore[attr-defined]


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 240) -> None:
    """Until ``/health`` says ready; the server's output if it exits first."""

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + server_output(proc))
        try:
            return bool(requests.get(url + "/health", timeout=2).json().get("ready"))
        except (requests.RequestException, ValueError):
            return False

    wait_until(ready, timeout, every=0.5, what=f"the server at {url} to be ready")


def stop_app(proc: subprocess.Popen) -> str:
    """SIGTERM, then its whole output; every process it had started (engine, GPU workers) must end with it."""
    started = descendants(proc.pid)
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    out = server_output(proc)
    proc.log.close()  # type: ignore[attr-defined]
    left = outliving(started)
    assert not left, f"still running after the server stopped (killed now): {left}\n{out[-3000:]}"
    return out


def outliving(pids: set[int], wait_s: float = 15) -> list[str]:
    """Those of ``pids`` still running after ``wait_s`` seconds ("PID COMMAND" each), killed now."""

    def alive() -> list[str]:
        return [f"{pid} {name}" for pid, (_, _, name) in processes().items() if pid in pids]

    wait_until(lambda: not alive(), wait_s, every=0.2, fail=False)
    left = alive()
    for line in left:
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def processes() -> dict[int, tuple[int, int, str]]:
    """Every live process (zombies left out): pid → (parent pid, process group, command name), from ``/proc``."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        name, rest = text.split("(", 1)[1].rsplit(")", 1)
        state, ppid, pgrp = rest.split()[:3]
        if state != "Z":
            found[int(stat.parent.name)] = (int(ppid), int(pgrp), name)
    return found


def group_members(pgid: int) -> list[str]:
    """The processes still in process group ``pgid``: "PID COMMAND" each."""
    return [f"{pid} {name}" for pid, (_, pgrp, name) in processes().items() if pgrp == pgid]


def descendants(pid: int) -> set[int]:
    """The live processes ``pid`` started, and theirs, whatever their process group."""
    table = processes()
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, (parent, _, _) in table.items() if parent in frontier} - found
        found |= frontier
    return found


@contextmanager
def running_app(*extra: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """A tiny-model ``app.py`` on a free loopback port; on exit, its log must hold no traceback."""
    port = free_port()
    proc = start_app(port, *extra, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        yield url
    finally:
        serving_log = stop_app(proc).split("Shutting down")[0]  # open SSE streams may be cut at exit
        assert "Traceback" not in serving_log, serving_log[-4000:]


def metric(url: str, name: str, auth: Any = None) -> float:
    """One sample of the app's ``/metrics`` (the first line for ``name``, labelled or not)."""
    for line in requests.get(url + "/metrics", timeout=10, auth=auth).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def ended(url: str, outcome: str) -> float:
    """Requests the app counted with this outcome so far (``vlm_requests_total``; 0 before the first)."""
    try:
        return metric(url, f'vlm_requests_total{{outcome="{outcome}"}}')
    except KeyError:
        return 0.0


# ---- our Triton server ---------------------------------------------------------------------------------


TRITON_PYTHON = "VLM_TRITON_PYTHON"


def triton_python() -> str:
    """The Python that runs our Triton server: ``$VLM_TRITON_PYTHON`` (CI's environment with PyTriton, which
    keeps numpy below 2, while these tests run under the runtime's numpy 2), else this Python when it has
    PyTriton and the numpy PyTriton requires; else the test is skipped, saying how to get one
    (``docs/development.md``)."""
    chosen = os.environ.get(TRITON_PYTHON)
    if chosen:
        chosen = str(ROOT / chosen)  # a relative path is the repository's (an absolute one stays as it is)
        if not os.access(chosen, os.X_OK):
            pytest.fail(f"{TRITON_PYTHON}={chosen} is not a Python that can run")
        return chosen
    if importlib.util.find_spec("pytriton") is not None and pytriton_requirements_met():
        return sys.executable
    pytest.skip(
        f"needs PyTriton: make its environment .venv-triton as the README's Tests section says, "
        f"and set {TRITON_PYTHON}=.venv-triton/bin/python"
    )


def pytriton_requirements_met() -> bool:
    """Whether this Python's numpy is one its PyTriton accepts (0.7: below 2; pip installs it next to numpy 2
    with only a warning)."""
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement

    wanted = [Requirement(r) for r in requires("nvidia-pytriton") or [] if r.startswith("numpy")]
    return all(r.specifier.contains(version("numpy"), prereleases=True) for r in wanted)


def start_triton(
    args: list[str],
    models: list[str],
    log_path: Path,
    wait_s: float = 300,
    ports: list[int] | None = None,
    new_group: bool = False,
) -> tuple[subprocess.Popen, int, int]:
    """``python -m vlm_demo.triton.serve ARGS`` (run by :func:`triton_python`) on loopback ``ports`` (HTTP,
    gRPC, metrics; default free ones); returns once every model is ready. ``new_group``: as :func:`start_app`'s."""
    python = triton_python()
    http, grpc, metrics = ports or free_ports(3)
    # No LD_LIBRARY_PATH: the command puts this Python's LIBDIR there itself (a user need not export it).
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"} | {"PYTHONPATH": str(ROOT)}
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    cmd = [python, "-m", "vlm_demo.triton.serve", *args,
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=new_group)
    pending = list(models)

    def all_ready() -> bool:
        if proc.poll() is not None:
            return True  # said below
        try:
            while (
                pending
                and requests.get(f"http://127.0.0.1:{http}/v2/models/{pending[0]}/ready", timeout=2).status_code == 200
            ):
                pending.pop(0)
        except requests.RequestException:
            pass
        return not pending

    wait_until(all_ready, wait_s, every=0.5, fail=False)
    if pending:
        stop_triton(proc)
        pytest.fail(f"Triton did not start ({pending} not ready):\n{log_path.read_text()[-3000:]}")
    return proc, http, grpc


def stop_triton(proc: subprocess.Popen, http_port: int | None = None) -> None:
    """SIGTERM (PyTriton ignores SIGINT in the background), then wait until tritonserver has let go of the port.

    The launcher can exit while its tritonserver child still drains in-flight requests (up to 30 s). The
    launcher itself first gives answers in flight 60 s to finish, then ends them and unloads (up to 120 s more),
    then gives clients 5 s to hang up: it gets that long before it is killed.
    """
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(150)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    if http_port is None:
        return

    def port_closed() -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", http_port)) != 0

    wait_until(port_closed, 60, every=0.5, fail=False)  # a port still held a minute on: the next start says so


def join_running(worker: Any, rows: Any, requests: list[Any]) -> Any:
    """Prefill ``requests`` and join them to ``rows`` in their order, as the continuous engine does: one prefill
    per run of pictures of one tile count (``Worker.tiles_run``: a prefill's pictures share it); returns the
    prefills' last logits, a row each."""
    from itertools import groupby

    import torch

    from vlm_demo.engine.batching.rows import Row
    from vlm_demo.engine.decoding.sampler import RowSampling

    logits = []
    for _, run in groupby(requests, key=lambda r: worker.tiles_run(r.inputs)):
        chunk = list(run)
        prefill = worker.prefill(chunk)
        sampling = RowSampling([r.params for r in chunk], prefill.logits.device)
        places = rows.place(prefill, list(range(len(chunk))))
        rows.join([Row(r, None) for r in chunk], places, sampling.sample(prefill.logits), sampling)
        logits.append(prefill.logits)
    return torch.cat(logits)


# ---- what the API tests send and read ------------------------------------------------------------------


def data_url(image: Any, fmt: str = "PNG") -> str:
    """A PIL image as a ``data:`` URL, as API clients send pictures."""
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def colour_of(text: str | None) -> str | None:
    words = [c for c in ("red", "green", "blue", "yellow", "white", "black") if c in (text or "").lower()]
    return words[0] if len(words) == 1 else None


def four_stages(text: str) -> bool:
    """Whether an answer is the four tagged stages, in order, each with text."""
    return bool(
        re.fullmatch(
            r"\s*<SUMMARY>.+?</SUMMARY>\s*<CAPTION>.+?</CAPTION>\s*<REASONING>.+?</REASONING>\s*<CONCLUSION>.+?</CONCLUSION>\s*",
            text,
            re.S,
        )
    )
