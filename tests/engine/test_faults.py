"""The engine never dies silently: a fault at any point of a step (injected with ``engine/batching/faults.py``'s
failpoints, since a CPU box cannot produce CUDA's faults) ends in a clear error or a recovery, never a hang.

- a transient failure with several rows running requeues them: they finish with the answer they would
  have given, and the client never sees text twice;
- a row that fails on its own gets a specific error at once;
- a sticky device error (what an illegal memory access raises) stops the engine: everything it held
  fails at once with a clear error, it says it is not ready, and the engine process exits so its
  supervisor starts a fresh one that serves the next request.
"""

from __future__ import annotations

import threading
import time

import pytest
from support import door, wait_until

from vlm_demo.backends.engine_client import EngineProcessBackend
from vlm_demo.config import Config
from vlm_demo.engine.batching.base import Engine, is_fatal_device_error
from vlm_demo.engine.batching.continuous import ContinuousEngine
from vlm_demo.engine.batching.dynamic import DynamicEngine
from vlm_demo.engine.batching.faults import FailPoints, injected
from vlm_demo.errors import EngineStoppedError, GenerationError
from vlm_demo.models.tiny import solid_image
from vlm_demo.request import SamplingParams

GREEDY = SamplingParams(max_new_tokens=160, temperature=0.0)
STEP_POINTS = ("forward", "advance", "host_read", "evict")
CASES = [(solid_image("red", 40, 40), "What colour is this image?"), (solid_image("blue", 64, 30), "Colour?")]


@pytest.fixture(scope="module")
def answers(worker) -> list[str]:
    """Each case's greedy answer from an engine that never fails."""
    engine = ContinuousEngine(worker, Config(batching="continuous", max_batch_size=4, batch_window_ms=0.0)).start()
    try:
        return [engine.submit(door(image, q, GREEDY)).result(timeout=60).text for image, q in CASES]
    finally:
        engine.shutdown()


def submit_together(engine: Engine) -> list:
    with engine.scheduler._cond:  # both arrive at the same step boundary: they run side by side
        return [engine.submit(door(image, q, GREEDY)) for image, q in CASES]


def streamed(request) -> str:
    return "".join(request.stream(timeout=60))


@pytest.mark.parametrize("point", STEP_POINTS)
def test_a_failed_step_requeues_its_rows_and_they_finish_as_if_nothing_happened(engines, answers, point) -> None:
    engine = engines(faults=f"{point}:error@4")  # the fourth time: both rows are well into their answers
    requests = submit_together(engine)
    assert [streamed(r) for r in requests] == answers, "a requeued row repeated or lost text"
    assert [r.result(1).text for r in requests] == answers
    assert engine.recoveries == 1 and engine.stats().ready
    assert engine.submit(door(*CASES[0], GREEDY)).result(timeout=60).text == answers[0]


@pytest.mark.parametrize("point", ("prefill", *STEP_POINTS))
def test_a_row_that_fails_on_its_own_gets_a_clear_error_at_once_and_the_next_is_served(engines, answers, point):
    engine = engines(faults=f"{point}:error")
    started = time.monotonic()
    with pytest.raises(GenerationError, match=f"Generation failed: RuntimeError: fault injected at {point}"):
        engine.submit(door(*CASES[0], GREEDY)).result(timeout=60)
    assert time.monotonic() - started < 30, "the error must not wait for a token timeout"
    assert engine.submit(door(*CASES[1], GREEDY)).result(timeout=60).text == answers[1]


@pytest.mark.parametrize("point", ("prefill", *STEP_POINTS))
def test_a_sticky_device_error_stops_the_engine_and_fails_everything_it_held(engines, point) -> None:
    fatal: list[BaseException] = []
    armed = threading.Event()

    def failpoint(where: str) -> None:  # a sticky CUDA error at ``point`` once armed, and at every call after
        if where == point and armed.is_set():
            raise injected("device", where)

    engine = engines()
    engine.failpoint, engine.on_fatal = failpoint, fatal.append
    running = engine.submit(door(*CASES[0], SamplingParams(5000, 0.0, ignore_eos=True)))
    next(running.stream(timeout=60))
    with engine.scheduler._cond:  # queued (not admitted while we hold the queue), then the fault is armed
        waiting = [engine.submit(door(*CASES[1], GREEDY)) for _ in range(2)]
        armed.set()
    for request in [running, *waiting]:
        with pytest.raises(EngineStoppedError, match="GPU error the process cannot recover from"):
            request.result(timeout=30)
    wait_until(lambda: fatal, 10, every=0.01, fail=False)  # the engine thread reports the ends, then calls on_fatal
    assert len(fatal) == 1 and is_fatal_device_error(fatal[0])
    assert not engine.stats().ready
    with pytest.raises(EngineStoppedError, match="illegal memory access"):
        engine.submit(door(*CASES[0], GREEDY))


def test_dynamic_batches_retry_a_transient_failure_and_stop_on_a_sticky_one(engines, answers) -> None:
    engine = engines(DynamicEngine, faults="generate:error")
    requests = submit_together(engine)
    assert [r.result(timeout=60).text for r in requests] == answers  # split in halves and retried
    engine = engines(DynamicEngine, faults="generate:device")
    for request in submit_together(engine):
        with pytest.raises(EngineStoppedError, match="GPU error"):
            request.result(timeout=30)
    assert not engine.stats().ready


def test_failpoints_read_their_plan_and_refuse_a_bad_one() -> None:
    points = FailPoints.parse("forward:oom@2, host_read:device@1+")
    points.hit("forward")
    with pytest.raises(Exception, match="out of memory"):
        points.hit("forward")
    points.hit("forward")  # fired once
    for _ in range(3):
        with pytest.raises(Exception, match="illegal memory access"):
            points.hit("host_read")
    assert points.fired == ["forward:oom", "host_read:device", "host_read:device", "host_read:device"]
    for bad in ("nowhere:error", "forward:melt", "forward:error@x"):
        with pytest.raises(ValueError):
            FailPoints.parse(bad)
    assert is_fatal_device_error(injected("device", "forward"))
    assert not is_fatal_device_error(injected("oom", "forward")) and not is_fatal_device_error(RuntimeError("x"))


@pytest.mark.slow
def test_the_engine_process_exits_after_a_sticky_error_and_a_fresh_one_serves(tiny_dir, monkeypatch) -> None:
    """In its own process (the server's default) a dead engine thread would leave a process that looks
    alive and never answers: it exits instead, its requests fail at once, and the supervisor restarts it."""
    monkeypatch.setenv("VLM_FAULTS", "forward:device@20")
    backend = EngineProcessBackend(Config(model=tiny_dir, model_explicit=True, max_batch_size=4))
    try:
        monkeypatch.delenv("VLM_FAULTS")  # only the first engine process has the fault planned
        pid = backend.pid
        long = SamplingParams(max_new_tokens=5000, temperature=0.0, ignore_eos=True)
        streams = [backend.submit(door(image, q, long)) for image, q in CASES]
        started = time.monotonic()
        for stream in streams:
            with pytest.raises(EngineStoppedError, match="GPU error the process cannot recover from"):
                stream.result(timeout=60)
        assert time.monotonic() - started < 30, "errors, not token timeouts"
        wait_until(lambda: backend.restarts == 1 and backend.health().ready, 90, every=0.1, fail=False)
        assert backend.health().ready and backend.pid != pid
        answer = backend.submit(door(*CASES[0], GREEDY)).result(timeout=60)
        assert "red" in answer.text.split("<CONCLUSION>")[-1]
    finally:
        backend.close()
