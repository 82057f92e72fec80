"""How our servers stop when the stop reaches the whole process group, as it does from ``timeout``, systemd and
container runtimes (SIGTERM) and from a terminal's Ctrl+C (SIGINT): real processes in a group of their own,
real signals (``os.killpg``), loopback only.

An orderly stop: the server ends by itself (exit status 0), nothing it started is left in its group, and its log
has no traceback, no engine restart and (Triton) no skipped unload and no leaked shared memory.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import requests
from support import (
    descendants,
    free_port,
    group_members,
    outliving,
    processes,
    server_env,
    server_output,
    start_app,
    start_triton,
    wait_ready,
    wait_until,
)

from vlm_demo.config import DEFAULT_MODEL, TINY, Config
from vlm_demo.models.choice import no_gpu_here, planned_model
from vlm_demo.triton.contract import ENSEMBLE_MODEL, GENERATE_MODEL

NOT_IN_AN_ORDERLY_STOP = ("Traceback", "restarting", "died", "KeyboardInterrupt", "Cannot start")


def stop_group(proc: subprocess.Popen, signum: int, read_log: Callable[[], str], wait_s: float = 60) -> str:
    """``signum`` to the server's whole process group; once it has ended, its log (it must end by itself, and
    leave nothing behind: nothing in its group, none of the processes it had started, in any group)."""
    started = descendants(proc.pid)
    os.killpg(proc.pid, signum)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        pytest.fail(f"{signal.Signals(signum).name} did not stop the server:\n{read_log()[-3000:]}")

    remaining = outliving(started | {int(line.split()[0]) for line in group_members(proc.pid)}, 20)
    log = read_log()
    assert not remaining, f"left running after the server stopped: {remaining}\n{log[-3000:]}"
    return log


def stop_app_group(proc: subprocess.Popen, signum: int) -> str:
    try:
        return stop_group(proc, signum, lambda: server_output(proc))
    finally:
        proc.log.close()  # type: ignore[attr-defined]


def assert_orderly(proc: subprocess.Popen, log: str) -> None:
    assert proc.returncode == 0, (proc.returncode, log[-3000:])
    for words in NOT_IN_AN_ORDERLY_STOP:
        assert words not in log, f"{words!r} in the log of an ordinary stop:\n{log[-3000:]}"


# ---- app.py ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_of_the_apps_whole_group_stops_the_server_and_then_its_engine(signum: int) -> None:
    """The engine process gets the group's signal too: it leaves the stop to the web process, which stops serving,
    then its engine (no "engine process died … restarting", no new engine outliving the server)."""
    port = free_port()
    proc = start_app(port, "--response-cache-mb", "0", model=None, new_group=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        engine = requests.get(url + "/health", timeout=10).json()["details"]["engine_pid"]
    finally:
        log = stop_app_group(proc, signum)
    assert_orderly(proc, log)
    assert f"engine process {engine} stopped (exit code 0)" in log, log[-3000:]


@pytest.mark.slow
def test_a_stop_of_the_apps_whole_group_while_the_model_loads_ends_the_load() -> None:
    port = free_port()
    proc = start_app(port, model=None, new_group=True)
    url = f"http://127.0.0.1:{port}"

    def engine_started() -> bool:
        if proc.poll() is not None:
            return True
        return "engine process" in server_output(proc) and "started" in server_output(proc)

    try:
        wait_until(engine_started, 120, every=0.1, what="the engine process to start")
        status = requests.get(url + "/health", timeout=10)
    finally:
        log = stop_app_group(proc, signal.SIGTERM)
    assert status.json()["status"] == "loading", status.text  # the signal came while the model loaded
    assert_orderly(proc, log)
    assert "the server stopped while the model loaded: engine process" in log, log[-3000:]


# ---- which model /health names while the model loads -------------------------------------------------------


def test_the_model_planned_without_a_gpu_is_the_tiny_one_unless_one_was_asked_for(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # every GPU hidden: no GPU, told without torch
    assert no_gpu_here()
    assert planned_model(Config()) == TINY
    assert planned_model(Config(model="some/model", model_explicit=True)) == "some/model"
    assert planned_model(Config(device="cuda")) == DEFAULT_MODEL  # asked for a GPU: the loader says none is there
    assert planned_model(Config(triton_url="http://127.0.0.1:8000")) == DEFAULT_MODEL  # Triton's, not ours


@pytest.mark.slow
@pytest.mark.skipif(not no_gpu_here(), reason="this machine may have a GPU: the real model would load")
def test_health_and_the_loading_page_name_the_tiny_model_throughout_a_start_without_a_gpu() -> None:
    """As a newcomer starts it (no --model) on a machine without a GPU: from its first answer to the moment it is
    ready, ``/health`` and the loading page name the model that loads, never the 11B one."""
    port = free_port()
    proc = start_app(port, model=None, new_group=True)
    url = f"http://127.0.0.1:{port}"
    named: list[str] = []
    pages: list[str] = []

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + server_output(proc))
        try:
            body = requests.get(url + "/health", timeout=5).json()
            if body.get("status") == "loading":
                page = requests.get(url + "/", timeout=5).text
                if 'id="loading"' in page:  # not the demo itself: the load may have ended since /health answered
                    pages.append(page)
        except (requests.RequestException, ValueError):
            return False
        named.append(body["model"])
        return bool(body.get("ready"))

    try:
        wait_until(ready, 240, every=0.1, what="the server to be ready")
    finally:
        stop_app_group(proc, signal.SIGTERM)
    assert pages, "the server was ready before the first /health answered: nothing seen while it loaded"
    assert set(named) == {TINY}, named
    assert all(f"Loading <code>{TINY}</code>" in page and DEFAULT_MODEL not in page for page in pages), pages[0]


# ---- the Triton server --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_of_the_triton_servers_whole_group_unloads_the_models_then_stops_tritonserver(
    signum: int, tmp_path: Path
) -> None:
    """tritonserver and its model processes do not hear the group's signal: the command unloads the models (no
    "could not unload … Connection refused"), then stops tritonserver; no model process dies mid-way (no "leaked
    shared_memory objects")."""
    log_path = tmp_path / "triton.log"
    proc, _, _ = start_triton(["--model", "tiny"], [ENSEMBLE_MODEL, GENERATE_MODEL], log_path, new_group=True)
    started, table = descendants(proc.pid), processes()
    assert any(table[pid][2] == "tritonserver" for pid in started if pid in table), "no tritonserver among its children"
    log = stop_group(proc, signum, log_path.read_text, wait_s=200)
    assert_orderly(proc, log)
    stopping = log.split("stopping: unloading the models", 1)
    assert len(stopping) == 2, f"the stop did not start the orderly unload:\n{log[-3000:]}"
    for words in ("could not unload", "Connection refused", "ConnectionRefusedError", "leaked", "still unloading"):
        assert words not in stopping[1], f"{words!r} in the log of an ordinary stop:\n{stopping[1][-3000:]}"
    assert "successfully unloaded" in stopping[1], stopping[1][-3000:]


# ---- what a killed web process leaves ----------------------------------------------------------------------


@pytest.mark.slow
def test_a_zerogpu_worker_ends_when_the_web_process_that_forked_it_is_killed() -> None:
    """ZeroGPU's GPU worker (forked by ``spaces``, waiting for its next call on a queue whose writing end it holds
    itself) never learns that the web process is gone: killed (SIGKILL, or a test's stop that timed out), the
    web process left it running, orphaned, with the model's memory. It follows the web process now."""
    from gradio_client import Client, handle_file
    from zerogpu_standin import FakeScheduler

    from vlm_demo import ASSETS_DIR

    scheduler = FakeScheduler().start()
    env = server_env(SPACES_ZERO_GPU="true", SPACES_ZERO_DEVICE_API_URL=scheduler.url, TOKENIZERS_PARALLELISM="false")
    port = free_port()
    proc = start_app(port, "--response-cache-mb", "0", env=env, script="tests/zerogpu_standin.py")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        client = Client(url, verbose=False, headers={"X-IP-Token": "visitor"})
        answer = client.predict(
            handle_file(f"{ASSETS_DIR}/tiny/red.png"), "What colour is it?", 60, 0.0, 1.0, api_name="/ask"
        )
        assert "red" in answer[3].lower(), answer
        workers = {int(allowed["pid"]) for allowed in scheduler.allowed}
        assert workers and workers <= descendants(proc.pid), (workers, descendants(proc.pid))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        left = outliving(workers, 15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log = server_output(proc)
        proc.log.close()  # type: ignore[attr-defined]
        scheduler.stop()
    assert not left, f"GPU workers still running after the web process was killed: {left}\n{log[-3000:]}"
