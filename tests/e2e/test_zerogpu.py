"""ZeroGPU mode across the real process boundary.

ZeroGPU's scheduler and CUDA cannot run here, so the app runs under a stand-in (``tests/zerogpu_standin.py``):
the ``spaces`` package's own code forks each GPU call into a worker process, pickles its arguments and every
Step it yields, reuses a warm worker, and talks HTTP to a fake scheduler in this process; only the scheduler and
CUDA are faked. The app is the real ``app.py`` with the tiny model (``SPACES_ZERO_GPU=true``), its decode steps
slowed to 50 ms (``VLM_FAULTS``) so a Stop lands mid-answer, and the first prefill of each engine failing on
purpose, so an error made in the worker must reach the visitor.

The GPU side's own rules (a call closed early leaves the engine empty; a step that raises ends the call) and the
durations run in this process on the shared tiny worker.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from gradio_client import Client, handle_file
from support import ROOT, door, free_port, metric, server_env, start_app, stop_app, wait_ready, wait_until
from zerogpu_standin import FakeScheduler, read_events

from vlm_demo.backends.zerogpu.calls import GpuSide, close_server_sockets
from vlm_demo.backends.zerogpu.duration import call_seconds
from vlm_demo.config import Config
from vlm_demo.engine.batching.faults import FailPoints
from vlm_demo.engine.ipc.messages import Step, Submit
from vlm_demo.errors import EngineStoppedError
from vlm_demo.models.tiny import solid_image
from vlm_demo.request import STAGE_BEAM, SamplingParams

ASSETS = ROOT / "assets" / "tiny"
QUESTION = "What colour is this image?"
TOKENS_PER_S, START_S = 25.0, 30.0  # the app's defaults (--zerogpu-tokens-per-s, --zerogpu-start-s)


def visitor_token(name: str) -> str:
    """An ``X-IP-Token`` as the Space's proxy sends it (a JWT; ``spaces`` reads its payload, the scheduler checks it)."""
    parts = ({"alg": "none"}, {"user": name})
    return ".".join(base64.urlsafe_b64encode(json.dumps(p).encode()).decode().rstrip("=") for p in parts) + ".sig"


def colour_of(text: str) -> str | None:
    words = [c for c in ("red", "green", "blue", "yellow", "white", "black") if c in text.lower()]
    return words[0] if len(words) == 1 else None


@dataclasses.dataclass
class ZeroGPUApp:
    url: str
    pid: int  # the web process
    scheduler: FakeScheduler
    events_file: Path
    client: Client  # a visitor with an X-IP-Token
    token: str
    first_error: str  # what the visitor read when the first answer failed in the worker (an injected prefill fault)

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.events_file)

    def workers(self) -> list[int]:
        """The GPU workers' process ids, in the order they started (each says so to the scheduler once)."""
        return [int(allowed["pid"]) for allowed in self.scheduler.allowed]


@pytest.fixture(scope="module")
def zerogpu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZeroGPUApp]:
    scheduler = FakeScheduler().start()
    events = tmp_path_factory.mktemp("zerogpu") / "events.jsonl"
    env = server_env(
        SPACES_ZERO_GPU="true",
        SPACES_ZERO_DEVICE_API_URL=scheduler.url,
        ZEROGPU_STANDIN_EVENTS=str(events),
        VLM_FAULTS="forward:slow@1+,prefill:error@1",
        TOKENIZERS_PARALLELISM="false",
    )
    port = free_port()
    proc = start_app(
        port, "--response-cache-mb", "0", "--max-per-client", "0", env=env, script="tests/zerogpu_standin.py"
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        token = visitor_token("visitor-1")
        client = Client(url, verbose=False, headers={"X-IP-Token": token})
        with pytest.raises(Exception) as first:  # the worker's first prefill fails on purpose
            client.predict(handle_file(str(ASSETS / "red.png")), QUESTION, 200, 0.0, 1.0, api_name="/ask")
        yield ZeroGPUApp(url, proc.pid, scheduler, events, client, token, str(first.value))
    finally:
        serving_log = stop_app(proc).split("Shutting down")[0]
        scheduler.stop()
        injected = "PageError: 'Generation failed: RuntimeError: fault injected at prefill (VLM_FAULTS)'"
        assert serving_log.count("Traceback") == serving_log.count(injected) == 1, serving_log[-4000:]


def ask(app: ZeroGPUApp, colour: str, *extra: Any, api: str = "/ask") -> tuple:
    return app.client.predict(handle_file(str(ASSETS / f"{colour}.png")), QUESTION, *extra, api_name=api)


def sockets_on_port(pid: int, port: int) -> list[str]:
    """The file descriptors of ``pid`` that are sockets of the local ``port`` (listening or connected)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    held = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            held.append(fd.name)
    return held


def wider_batches(url: str) -> float:
    """Model batches of more than one row so far (``vlm_batch_size``, fed by the Steps the workers send)."""
    return metric(url, "vlm_batch_size_count") - metric(url, 'vlm_batch_size_bucket{le="1.0"}')


# ---- across the process boundary --------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_error_in_the_worker_reaches_the_visitor_and_the_warm_worker_answers_next(zerogpu: ZeroGPUApp) -> None:
    """The first answer failed inside the GPU worker (its engine's first prefill, on purpose): the typed error
    crossed back, the call ended well, and the same warm worker answers the next call, billed to the visitor,
    for the seconds the duration callable gives."""
    assert "fault injected at prefill" in zerogpu.first_error, zerogpu.first_error
    before = len(zerogpu.scheduler.schedules)
    summary, caption, reasoning, conclusion, *_ = ask(zerogpu, "blue", 200, 0.0, 1.0)
    assert colour_of(conclusion) == "blue" and summary and caption and reasoning
    call = zerogpu.scheduler.schedules[before]
    assert call["token"] == zerogpu.token, "the Gradio request reached spaces: ZeroGPU bills the visitor who asked"
    assert int(call["durationSeconds"]) == call_seconds(
        [SamplingParams(max_new_tokens=200).validated(2048)], TOKENS_PER_S, START_S
    )
    assert zerogpu.scheduler.lent[before]["idle"], "the scheduler lent the warm worker's GPU"
    assert len(zerogpu.workers()) == 1, "both calls ran in one worker"


@pytest.mark.slow
def test_the_web_process_loads_the_weights_once_and_never_builds_an_engine_nor_touches_cuda(
    zerogpu: ZeroGPUApp,
) -> None:
    """Start-up as ZeroGPU expects it: spaces' patch at import, the weights loaded, then packed by the start-up hook
    (reported to the scheduler once). Each GPU worker is another process: ZeroGPU moves the weights there once, and
    it builds one engine, on its first call; later calls load and build nothing."""
    ask(zerogpu, "yellow", 200, 0.0, 1.0)
    events = zerogpu.events()
    in_web = [e["event"] for e in events if e["pid"] == zerogpu.pid]
    assert in_web == ["patch", "load_weights", "pack"], in_web  # and no build_engine, no cuda_init
    assert zerogpu.scheduler.startup_reports == 1
    assert requests.get(zerogpu.url + "/health", timeout=10).json()["backend"] == "zerogpu"
    for worker in zerogpu.workers():
        assert worker != zerogpu.pid
        done = [e["event"] for e in events if e["pid"] == worker]
        assert done[:3] == ["unpatch", "init", "move"] and done.count("move") == 1, done
        assert done.count("build_engine") == 1 and "load_weights" not in done, done
    assert len(zerogpu.scheduler.schedules) >= 3  # the worker served several calls with that one engine


@pytest.mark.slow
def test_a_gpu_worker_keeps_none_of_the_servers_sockets(zerogpu: ZeroGPUApp) -> None:
    """spaces closes the server's sockets in a worker it forks, found by the port Gradio's launch would have set; ours
    names it (a connection the server closes must close for the browser too)."""
    port = int(zerogpu.url.rsplit(":", 1)[1])
    assert sockets_on_port(zerogpu.pid, port), "the web process listens on the port: the check sees its sockets"
    for worker in zerogpu.workers():
        assert sockets_on_port(worker, port) == []


def test_a_worker_closes_the_server_sockets_that_slipped_past_spaces() -> None:
    """A connection accepted between spaces' list of sockets and its fork: the worker's own sweep closes it (and
    the listening socket), so the visitor's side sees the end; sockets on other ports stay open."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    visitor = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    other = socket.create_server(("127.0.0.1", 0))
    try:
        assert close_server_sockets(port) == 2  # the listening socket and the accepted connection
        visitor.settimeout(10)
        assert visitor.recv(1) == b""  # closed on the server's side
        assert close_server_sockets(port) == 0 and other.getsockname()[1] != port
        assert close_server_sockets(0) == 0  # no port known: nothing closed
    finally:
        server.detach(), accepted.detach()  # their descriptors are closed already
        visitor.close(), other.close()


@pytest.mark.slow
def test_stop_ends_the_call_in_the_worker_frees_the_gpu_and_the_worker_answers_next(zerogpu: ZeroGPUApp) -> None:
    before = len(zerogpu.scheduler.lent)
    job = zerogpu.client.submit(
        handle_file(str(ASSETS / "red.png")), "Describe this picture in detail.", 1000, 0.0, 1.0, api_name="/ask"
    )
    wait_until(lambda: any(update[4] for update in job.outputs()), 60, what="the answer's first words")
    job.cancel()  # what Stop and a closed tab do: the handler's answer is cancelled
    token = zerogpu.scheduler.lent[before]["allowToken"]
    wait_until(lambda: zerogpu.scheduler.released_well(token), 30, what="the stopped call's GPU given back")
    stopped = [e for e in zerogpu.events() if e["event"] == "stopped"]
    assert stopped and stopped[-1]["answers"] == 1 and stopped[-1]["pid"] in zerogpu.workers()
    assert colour_of(ask(zerogpu, "red", 200, 0.0, 1.0)[3]) == "red"
    assert len(zerogpu.workers()) == 1, "the stopped call left its worker warm and its engine empty"


@pytest.mark.slow
def test_think_harders_candidates_are_rows_of_their_calls_batch(zerogpu: ZeroGPUApp) -> None:
    before, wide = len(zerogpu.scheduler.schedules), wider_batches(zerogpu.url)
    conclusion = ask(zerogpu, "blue", 200, 0.6, 0.9, STAGE_BEAM, 2)[3]
    assert colour_of(conclusion) == "blue"
    calls = zerogpu.scheduler.schedules[before:]
    think = SamplingParams(max_new_tokens=200, reasoning=STAGE_BEAM, beams=2)
    assert [int(c["durationSeconds"]) for c in calls] == [call_seconds([think], TOKENS_PER_S, START_S)]
    assert wider_batches(zerogpu.url) > wide, "the two candidates decoded as rows of one batch"


@pytest.mark.slow
def test_ask_batch_answers_a_gradio_batch_in_one_gpu_call(zerogpu: ZeroGPUApp) -> None:
    """One /ask_batch batch at a time: requests that arrive while it runs gather into the next, one GPU call."""
    before = len(zerogpu.scheduler.schedules)
    colours = ("red", "blue", "yellow")
    jobs = [
        zerogpu.client.submit(handle_file(str(ASSETS / f"{c}.png")), QUESTION, 200, 0.0, 1.0, api_name="/ask_batch")
        for c in colours
    ]
    answers = [job.result(timeout=120) for job in jobs]
    assert [colour_of(a[3]) for a in answers] == list(colours)
    assert len(zerogpu.scheduler.schedules) - before < len(colours), "no batch of more than one answer"


@pytest.mark.slow
def test_a_visitor_out_of_quota_reads_zerogpus_own_words(zerogpu: ZeroGPUApp) -> None:
    zerogpu.scheduler.refusals.append({"left": 5, "wait": 60})
    with pytest.raises(Exception, match=r"exceeded your ZeroGPU quota \(38s requested vs\. 5s left\)"):
        ask(zerogpu, "red", 200, 0.0, 1.0)
    assert not zerogpu.scheduler.refusals


@pytest.mark.slow
def test_v1_has_no_visitor_to_bill_and_is_refused_at_once_on_both_its_apis(zerogpu: ZeroGPUApp) -> None:
    before = len(zerogpu.scheduler.schedules)
    image = base64.b64encode((ASSETS / "red.png").read_bytes()).decode()
    reply = requests.post(
        zerogpu.url + "/v1/chat/completions", json={"image_base64": image, "question": QUESTION}, timeout=30
    )
    assert reply.status_code == 400 and "ZeroGPU" in reply.json()["error"]["message"], reply.text
    picture = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": QUESTION},
                {"type": "input_image", "image_url": "data:image/png;base64," + image},
            ],
        }
    ]
    responses = requests.post(zerogpu.url + "/v1/responses", json={"input": picture}, timeout=30)
    assert responses.status_code == 400 and responses.json() == reply.json(), responses.text  # refused alike
    assert len(zerogpu.scheduler.schedules) == before
    assert requests.get(zerogpu.url + "/metrics", timeout=10).status_code == 200


# ---- the GPU side's own rules, in this process ------------------------------------------------------------------


def answer_of(colour: str, tokens: int) -> Any:
    forced = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    return door(solid_image(colour, 40, 40), "Describe this picture in detail.", forced)


@pytest.fixture
def side(worker: Any) -> Iterator[GpuSide]:
    """The GPU side over the shared tiny worker, as a GPU worker has it (its engine built on the first call)."""
    made = GpuSide(Config(batching="continuous", max_batch_size=2, batch_window_ms=0.0, stream_every_ms=0.0), worker)
    yield made
    if made.engine is not None:
        made.engine.shutdown()


def test_a_call_closed_early_leaves_the_engine_empty_for_the_workers_next_call(side: GpuSide) -> None:
    call = side.answer([Submit(1, answer_of("red", 40))])
    written = next(step for step in call if step.text)
    assert written.text[0][0] == 1
    engine = side.engine
    assert engine is not None and engine.running_rows() == 1
    call.close()  # spaces' stop event: the web process ended the call (Stop)
    assert not engine.live and engine.running_rows() == 0
    steps = list(side.answer([Submit(2, answer_of("blue", 12))]))
    assert side.engine is engine, "the next call reuses the worker's engine"
    ends = [end for step in steps for end in step.ended]
    assert [(e.rid, e.error) for e in ends] == [(2, None)] and ends[0].result.completion_tokens == 12


def test_a_step_that_raises_ends_the_calls_answers_and_the_engine(side: GpuSide) -> None:
    """A sticky CUDA error repeats in every later step: the call's answers end saying so, the engine is dropped and
    the call raises (spaces then starts a fresh worker for the next call)."""
    list(side.answer([Submit(1, answer_of("red", 4))]))  # the engine is built
    assert side.engine is not None
    side.engine.failpoint = FailPoints.parse("forward:device@2").hit
    steps: list[Step] = []
    with pytest.raises(torch.AcceleratorError):
        for step in side.answer([Submit(7, answer_of("green", 40)), Submit(8, answer_of("blue", 40))]):
            steps.append(step)
    ends = {end.rid: end.error for end in steps[-1].ended}
    assert set(ends) == {7, 8} and all(isinstance(error, EngineStoppedError) for error in ends.values())
    assert "illegal memory access" in str(ends[7])
    assert side.engine is None


def test_a_calls_duration_counts_its_tokens_think_harders_candidates_and_its_batch() -> None:
    normal = SamplingParams(max_new_tokens=1000).validated(2048)
    assert call_seconds([normal], 25.0, 30.0) == 70  # 30 s to start, 1000 tokens at 25 a second
    assert (
        call_seconds([SamplingParams(max_new_tokens=1000, reasoning=STAGE_BEAM, beams=2).validated(2048)], 25.0, 30.0)
        == 80
    )
    assert (
        call_seconds([SamplingParams(max_new_tokens=1000, reasoning=STAGE_BEAM, beams=4).validated(2048)], 25.0, 30.0)
        == 100
    )
    assert call_seconds([normal] * 33, 25.0, 30.0) == 110  # 33 rows: each step about twice one row's
    assert (
        call_seconds([SamplingParams(max_new_tokens=100).validated(2048), normal], 25.0, 0.0) == 42
    )  # the longest, batched
