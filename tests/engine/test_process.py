"""The engine in its own process: the thin client, per-step messages, cancellation, death and restart.

A real spawned engine process on the tiny model, compared with the same engine run in this process.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest
from support import ROOT, door, wait_until

from vlm_demo.backends import make_backend
from vlm_demo.backends.engine_client import EngineProcessBackend
from vlm_demo.config import Config
from vlm_demo.engine.batching.dynamic import DynamicEngine
from vlm_demo.engine.ipc.messages import Ended, Step, StepBuffer
from vlm_demo.errors import EngineStoppedError, RequestCancelledError
from vlm_demo.models.tiny import solid_image
from vlm_demo.request import SamplingParams

GREEDY = SamplingParams(max_new_tokens=200, temperature=0.0)
CASES = [("red", 64, 64), ("green", 300, 40), ("blue", 33, 200), ("yellow", 120, 120), ("white", 90, 60)]


@pytest.fixture(scope="module")
def backend(tiny_dir: str):
    backend = EngineProcessBackend(Config(model=tiny_dir, model_explicit=True, max_batch_size=4))
    yield backend
    backend.close()


def test_importing_the_page_and_the_triton_client_does_not_import_torch() -> None:
    code = (
        "import sys; import vlm_demo.web.page.layout, vlm_demo.web.page.handlers, vlm_demo.web.server, vlm_demo.request, "
        "vlm_demo.backends.triton.backend, vlm_demo.backends.engine_client; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_held_steps_merge_into_one_message_in_order() -> None:
    """One place merges Steps (``Step.merge``, held by ``StepBuffer``): each request's text in one piece, in
    order; everything else kept in order; the latest stats and queue win."""
    early, late = object(), object()  # two engine reports (only which one wins matters)
    held = StepBuffer()
    assert not held and held.take() is None
    held.add(Step(text=[(1, "a"), (2, "x")], tokens=[(1, 1, [5])], stats=early, waiting=[3, 4]))
    held.add(Step())
    assert held  # an empty Step is still handed on (an idle engine's last one)
    held.add(Step(text=[(1, "b")], tokens=[(1, 2, [6])], ended=[Ended(2, None)], batch_sizes=[2]))
    held.add(Step(text=[(3, "c")], stats=late, waiting=[4]))
    step = held.take()
    assert step is not None and not held
    assert step.text == [(1, "ab"), (2, "x"), (3, "c")] and step.tokens == [(1, 1, [5]), (1, 2, [6])]
    assert [e.rid for e in step.ended] == [2] and step.batch_sizes == [2]
    assert step.stats is late and step.waiting == [4]


def test_every_config_field_has_a_reader() -> None:
    """A flag nobody reads is a lie in --help (``--kv-token-budget`` once never reached the engine)."""
    read: set[str] = set()
    for path in (ROOT / "vlm_demo").rglob("*.py"):
        if path.name == "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                read.add(node.attr)
    unread = [f.name for f in dataclasses.fields(Config) if f.name not in read]
    assert not unread, f"Config fields no module reads: {unread}"


def test_rows_streamed_from_the_engine_process_equal_the_in_process_engine(backend, worker) -> None:
    local = DynamicEngine(worker, Config(max_batch_size=1, batch_window_ms=0.0)).start()
    try:
        expected = [local.generate(door(solid_image(c, w, h), "What colour is it?", GREEDY)).text for c, w, h in CASES]
    finally:
        local.shutdown()
    received_before = backend.messages_received
    streams = [backend.submit(door(solid_image(c, w, h), "What colour is it?", GREEDY)) for c, w, h in CASES]
    texts = ["".join(s.stream(timeout=60)) for s in streams]
    results = [s.result(timeout=60) for s in streams]
    assert texts == expected
    assert [r.text for r in results] == expected
    assert max(r.batch_size for r in results) >= 2  # they shared steps in the engine process
    # One message per engine step carries every row's text: far fewer messages than streamed tokens.
    tokens = sum(r.completion_tokens for r in results)
    messages = backend.messages_received - received_before
    assert messages < tokens / 2, (messages, tokens)


def test_cancel_crosses_the_boundary_and_frees_the_row(backend) -> None:
    long = SamplingParams(max_new_tokens=5000, temperature=0.0, ignore_eos=True)
    victim = backend.submit(door(solid_image("black", 64, 64), "q", long))
    neighbour = backend.submit(door(solid_image("red", 64, 64), "What colour is it?", GREEDY))
    next(victim.stream(timeout=60))  # it is running
    victim.cancel()
    with pytest.raises(RequestCancelledError):
        victim.result(timeout=1)
    assert "red" in neighbour.result(timeout=60).text.split("<CONCLUSION>")[-1]
    wait_until(lambda: backend.health().engine.running == 0, 10, what="the engine to drop the cancelled row")
    assert backend.health().in_flight == 0


def test_queue_position_is_reported_while_waiting(backend) -> None:
    long = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    running = [backend.submit(door(solid_image("red", 40, 40), "q", long)) for _ in range(4)]
    waiting = [backend.submit(door(solid_image("blue", 40, 40), "q", long)) for _ in range(2)]
    try:
        wait_until(lambda: waiting[1].ahead() == 1, 10, what="the second waiting request to see one ahead of it")
        assert waiting[0].ahead() == 0
    finally:
        for stream in running + waiting:
            stream.cancel()


def test_engine_death_fails_requests_at_once_and_the_engine_comes_back(backend) -> None:
    long = SamplingParams(max_new_tokens=5000, temperature=0.0, ignore_eos=True)
    streams = [backend.submit(door(solid_image(c, 64, 64), "q", long)) for c in ("red", "green")]
    next(streams[0].stream(timeout=60))
    pid, restarts = backend.pid, backend.restarts
    os.kill(pid, signal.SIGKILL)  # as the out-of-memory killer would
    killed = time.monotonic()
    for stream in streams:
        with pytest.raises(EngineStoppedError, match="stopped unexpectedly .*SIGKILL"):
            stream.result(timeout=10)
    assert time.monotonic() - killed < 10  # errors, not hangs
    wait_until(lambda: backend.health().ready, 60, what="the restarted engine")
    assert backend.restarts == restarts + 1 and backend.pid != pid
    answer = backend.submit(door(solid_image("yellow", 50, 50), "What colour is it?", GREEDY)).result(timeout=60)
    assert "yellow" in answer.text.split("<CONCLUSION>")[-1]


def test_a_model_that_cannot_load_stops_start_up_with_one_line() -> None:
    with pytest.raises(SystemExit) as exit_info:
        make_backend(Config(model="/nonexistent/llava-cot", model_explicit=True, device="cpu"))
    message = str(exit_info.value)
    assert message.startswith("Cannot start the model:") and "\n" not in message
    assert "/nonexistent/llava-cot" in message


def test_a_program_that_exits_without_closing_its_engine_stops_it_and_ends(tmp_path) -> None:
    """The engine process ignores SIGTERM (a stop of the whole group is the web process's to carry out), so
    multiprocessing's exit hook, which sends SIGTERM and waits, waited for ever on an engine nobody had closed (a
    failed build, a tool): the backend's own exit hook closes it first."""
    from support import descendants, outliving

    script = tmp_path / "forgets_to_close.py"
    script.write_text(
        "import logging\n"
        "from vlm_demo.backends.engine_client import EngineProcessBackend\n"
        "from vlm_demo.config import Config\n"
        "if __name__ == '__main__':\n"
        "    logging.basicConfig(level=logging.INFO)\n"
        "    EngineProcessBackend(Config(model='tiny', model_explicit=True))\n"
        "    print('exiting without close', flush=True)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    engines: set[int] = set()
    wait_until(lambda: engines.update(descendants(proc.pid)) or proc.poll() is not None, 240, every=0.2)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and "exiting without close" in out, out[-3000:]
    assert "engine process" in out and "stopped (exit code 0)" in out, out[-3000:]
    assert not outliving(engines, 10), out[-3000:]
