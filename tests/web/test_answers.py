"""The answer service every door stands on (``web/answers.py``), with a scripted backend: who counts as a
client, the per-client cap, Stop by session, and one loop that follows an answer as each door paces it.

The doors themselves are tested end to end elsewhere (``test_ui``, ``test_openai_api``, ``test_app``)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from support import ROOT, door

from vlm_demo.backends.base import Features
from vlm_demo.config import Config
from vlm_demo.errors import BackendTimeoutError, RequestCancelledError, TooManyRequestsError
from vlm_demo.results import GenerationResult
from vlm_demo.stream import OutputStream
from vlm_demo.web import answers
from vlm_demo.web.answers import API, MCP, PAGE, Answers, client_id, page_interval
from vlm_demo.web.metrics import Metrics

RED = str(ROOT / "assets" / "tiny" / "red.png")


class Scripted(OutputStream):
    """A backend stream the test writes into."""

    def write(self, text: str) -> None:
        self._send(text)

    def finish(self, text: str) -> None:
        self._end(GenerationResult(text, "stop", 1, 10, 20, 0.0, 0.1, 0.5), None)


class Backend:
    name, remote, model, notice, features = "scripted", False, "scripted", None, Features()

    def __init__(self) -> None:
        self.streams: list[Scripted] = []
        self.clients: list[str] = []

    def submit(self, request: Any) -> Scripted:
        self.streams.append(Scripted())
        self.clients.append(request.client)
        return self.streams[-1]

    def run_batch(self, items: list[Any]) -> list[GenerationResult]:
        return [GenerationResult("ok", "stop", len(items), 1, 1, 0.0, 0.0, 0.0) for _ in items]


def service(cap: int = 8) -> tuple[Answers, Backend]:
    backend = Backend()
    return Answers(backend, Config(max_per_client=cap), Metrics()), backend  # type: ignore[arg-type]


def test_one_rule_names_the_client_for_every_door() -> None:
    assert client_id("203.0.113.7", session="abc") == "203.0.113.7"  # a visitor's own address
    assert client_id("127.0.0.1", session="abc") == "session:abc"  # behind a local proxy: each browser session
    assert client_id("::1") == "::1" and client_id("") == ""
    assert client_id("203.0.113.7", user="ann") == "user:ann"  # an API caller that names its user


def test_the_cap_counts_answers_in_progress_per_client_and_gives_them_back() -> None:
    svc, backend = service(cap=2)
    valid = door(RED, "What colour?")
    first, second = svc.submit(valid, "ann"), svc.submit(valid, "ann")
    with pytest.raises(TooManyRequestsError, match="You already have 2 answers in progress"):
        svc.submit(valid, "ann")
    assert svc.submit(valid, "bob") and backend.clients == ["ann", "ann", "bob"]
    first.finish("done")
    svc.submit(valid, "ann")  # one came back
    second.cancel()
    results = svc.run_batch([valid, valid, valid], "ann")  # one slot left: the rest refused in their slots
    assert [type(r).__name__ for r in results] == ["GenerationResult", "TooManyRequestsError", "TooManyRequestsError"]


def test_stop_cancels_one_visitors_answers_only() -> None:
    svc, backend = service()

    async def run() -> tuple[list, list]:
        streams = [svc.submit(door(RED, "What colour?"), f"v{i}") for i in range(3)]
        sessions = ["ann", "ann", "bob"]
        followers = [asyncio.create_task(_drain(svc.follow(s, PAGE, n))) for s, n in zip(streams, sessions)]
        await asyncio.sleep(0.1)
        assert svc.cancel("ann") == 2
        streams[2].finish("<CONCLUSION>red</CONCLUSION>")
        return await asyncio.gather(*followers, return_exceptions=True), streams

    outcomes, streams = asyncio.run(run())
    assert [type(o).__name__ for o in outcomes] == ["RequestCancelledError", "RequestCancelledError", "list"]
    assert svc.live(PAGE) == 0 and svc.cancel("bob") == 0


async def _drain(moments: Any) -> list:
    return [m async for m in moments]


def test_the_api_is_woken_by_each_piece_of_text_and_mcp_only_by_the_end(monkeypatch) -> None:
    """With the once-a-second look stretched to 30 s, only the text and the end can wake a follower: /v1 sees
    each piece on its own, MCP the whole answer at once."""
    monkeypatch.setattr(answers, "LOOK_EVERY_S", 30.0)
    svc, _ = service()

    async def follow(pacing: answers.Pacing) -> tuple[list[str], float]:
        stream = svc.submit(door(RED, "What colour?"), "")
        loop = asyncio.get_running_loop()
        start = loop.time()

        def produce() -> None:
            for piece in ("<SUMMARY>", " a", "</SUMMARY>"):
                time.sleep(0.15)
                stream.write(piece)
            time.sleep(0.15)
            stream.finish("<SUMMARY> a</SUMMARY>")

        threading.Thread(target=produce).start()
        seen = [m.text async for m in svc.follow(stream, pacing) if m.text or m.ended]
        return seen, loop.time() - start

    api, took = asyncio.run(follow(API))
    assert api == ["<SUMMARY>", " a", "</SUMMARY>", ""] and took < 10, (api, took)  # one look per piece, then the end
    mcp, took = asyncio.run(follow(MCP))
    assert mcp == ["<SUMMARY> a</SUMMARY>"] and took < 10, (mcp, took)


def test_the_pages_interval_grows_with_live_answers_and_with_the_loops_lag() -> None:
    assert page_interval(1, 0.0) == answers.MIN_PAGE_INTERVAL_S
    assert page_interval(128, 0.0) == pytest.approx(128 / answers.PAGE_UPDATES_PER_S)
    assert page_interval(128, answers.LAG_TARGET_S) == pytest.approx(2 * 128 / answers.PAGE_UPDATES_PER_S)
    assert page_interval(10_000, 0.0) == page_interval(128, 5.0) == answers.MAX_PAGE_INTERVAL_S


def test_a_silent_backend_ends_the_answer_with_a_timeout_and_frees_its_row(monkeypatch) -> None:
    monkeypatch.setattr(answers, "TOKEN_TIMEOUT_S", 0.3)
    monkeypatch.setattr(answers, "LOOK_EVERY_S", 0.05)
    svc, _ = service()
    stream = svc.submit(door(RED, "What colour?"), "")
    with pytest.raises(BackendTimeoutError, match="sent nothing for 0 s"):
        asyncio.run(_drain(svc.follow(stream, API)))
    with pytest.raises(RequestCancelledError):
        stream.result(0)


def test_a_caller_that_went_away_cancels_its_answer(monkeypatch) -> None:
    monkeypatch.setattr(answers, "GONE_CHECK_S", 0.0)
    monkeypatch.setattr(answers, "LOOK_EVERY_S", 0.05)
    svc, _ = service()
    stream = svc.submit(door(RED, "What colour?"), "")

    async def gone() -> bool:
        return True

    with pytest.raises(RequestCancelledError):
        asyncio.run(_drain(svc.follow(stream, API, gone=gone)))
    assert stream.done and svc.live(API) == 0
