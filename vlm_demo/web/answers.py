"""One answer service under every door: the page, ``/v1`` and MCP are thin adapters over it.

As TGI feeds every route into one ``generate_stream`` and SGLang keeps one record per request, each door here
only translates its own wire format; what is common is written once:

- **Who asks** (:func:`client_id`): one rule for every door, for fair share and the per-client cap.
- **The cap** (``--max-per-client``): taken when an answer starts, given back when it ends, whatever the
  backend (the engine process, this process's engine, a remote Triton).
- **The live answers**: which door and which visitor's session each belongs to, so Stop cancels one
  visitor's answers and a door's pacing knows how many of its answers stream.
- **One loop that follows a stream** (:meth:`Answers.follow`), off no thread: it drains what arrived, notices
  a silent backend, a stage-beam search's progress and a caller that went away, and is woken at once when
  the answer ends. Each door paces it (:class:`Pacing`):

  * the page: on a timer, at most 20 updates a second per answer and about :data:`PAGE_UPDATES_PER_S` over all
    live page answers (a Gradio update costs the web process ~0.8 ms), so many visitors cost a bounded
    share of a core; and slower still while the event loop runs late (:class:`LoopLag`): when the web
    process cannot keep up (a busy machine, a burst of new visitors), page updates give way first, so
    ``/health``, new visitors and ``/v1`` are served in time;
  * ``/v1``: woken by each piece of new text, so each engine step's text goes out as soon as it is there
    (several pieces that arrive while the loop is busy go out together);
  * MCP: the tool returns the whole answer, so only the end (and a once-a-second check) wakes it.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import ipaddress
import logging
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

from vlm_demo.backends.base import Backend
from vlm_demo.config import Config
from vlm_demo.errors import BackendTimeoutError, DemoError, GenerationError, TooManyRequestsError
from vlm_demo.request import Limits, ValidRequest
from vlm_demo.results import BeamView, GenerationResult
from vlm_demo.stream import Stream
from vlm_demo.web.metrics import Metrics

log = logging.getLogger(__name__)

TOKEN_TIMEOUT_S = 300.0  # longest silence tolerated from the backend before giving up on an answer
PAGE_UPDATES_PER_S = 400.0  # page updates a second over all live page answers: about a third of a core
MIN_PAGE_INTERVAL_S = 0.05  # at most ~20 page updates a second per answer; humans see no faster
MAX_PAGE_INTERVAL_S = 1.0  # however many answers stream, each visitor sees its text move every second
LAG_TARGET_S = 0.05  # timers this late on the event loop double the page's update interval
LOOK_EVERY_S = 1.0  # a door woken by text or the end still looks this often (silence, a caller gone)
GONE_CHECK_S = 1.0  # how often a caller's connection is checked


@dataclass(frozen=True)
class Pacing:
    """How a door follows its answers: woken by new text, or on a timer that depends on how many of the
    door's answers are live and on how late the event loop runs (seconds)."""

    name: str
    on_text: bool
    interval: Callable[[int, float], float]


def page_interval(live: int, lag: float) -> float:
    """Seconds between one visitor's page updates: 50 ms, longer when many page answers stream at once, and
    longer again while the loop runs late; never more than a second."""
    budget = max(MIN_PAGE_INTERVAL_S, live / PAGE_UPDATES_PER_S)
    return min(MAX_PAGE_INTERVAL_S, budget * (1 + lag / LAG_TARGET_S))


PAGE = Pacing("page", on_text=False, interval=page_interval)
API = Pacing("api", on_text=True, interval=lambda live, lag: LOOK_EVERY_S)
MCP = Pacing("mcp", on_text=False, interval=lambda live, lag: LOOK_EVERY_S)


class ClientSlots:
    """Answers in progress per client, against ``--max-per-client``: one client (an address, an API user)
    cannot hold more, so one script cannot take a public demo from everyone. Anonymous callers are not
    counted. The cap's one owner: every door reaches a backend through :class:`Answers`, and nothing else
    names a client (the engine's own tools and benchmarks, a Triton-served engine), so the engine trusts
    it. Thread-safe."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.held: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, client: str) -> None:
        """Count one more for ``client``, or raise :class:`TooManyRequestsError` saying why not."""
        with self._lock:
            held = self.held.get(client, 0)
            if self.cap and client and held >= self.cap:
                raise TooManyRequestsError(
                    f"You already have {held} answer{'s' if held != 1 else ''} in progress; wait for one to finish "
                    f"(at most {self.cap} at a time per visitor), then ask again."
                )
            self.held[client] = held + 1

    def give_back(self, client: str) -> None:
        with self._lock:
            left = self.held.get(client, 1) - 1
            if left > 0:
                self.held[client] = left
            else:
                self.held.pop(client, None)


def client_id(address: str | None, session: str | None = None, user: str | None = None) -> str:
    """Who asks, for fair share and the per-client cap, by one rule for every door: an API caller's ``user``
    when it names one; else the caller's address as uvicorn reports it (the visitor's own when a trusted
    proxy said so in X-Forwarded-For); a loopback address is this machine (a share-link tunnel, a local
    proxy, the owner), not one visitor, so there each browser session counts on its own."""
    if user:
        return f"user:{user[:200]}"
    if address and not _loopback(address):
        return address
    return f"session:{session}" if session else address or ""


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # not an IP (a test client's name)
        return False


@dataclass(frozen=True)
class Moment:
    """What one look at a live answer found."""

    text: str  # new text since the last look
    view: BeamView | None  # where its stage-beam search stands (None in the normal mode)
    ended: bool  # it finished (its result is ready); a failure raises instead
    elapsed: float  # seconds since it started


class LoopLag:
    """How late the event loop runs its timers (a moving average over the followers' timers): the web
    process's own measure of how far behind it is. Read and written on the loop only."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def observe(self, late: float) -> None:
        self.seconds += 0.05 * (max(0.0, late) - self.seconds)


class _Waker:
    """Wakes one follower's loop from the producer's thread, at most once per look (text can arrive a token
    at a time from many rows: one wake-up covers all that arrived since the last look)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, lag: LoopLag) -> None:
        self.loop = loop
        self.lag = lag
        self.event = asyncio.Event()
        self.pending = False

    def __call__(self, *_: object) -> None:
        if self.pending:
            return
        self.pending = True
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # the loop has closed: nobody follows any more
            pass

    def rearm(self) -> None:
        self.event.clear()
        self.pending = False

    async def wait(self, timeout: float) -> None:
        """Until woken or ``timeout`` seconds pass (a timer, not a task: cheap at hundreds of answers); a
        timer that rings says how late the loop runs."""
        due = self.loop.time() + timeout
        timer = self.loop.call_later(timeout, self._ring, due)
        try:
            await self.event.wait()
        finally:
            timer.cancel()

    def _ring(self, due: float) -> None:
        self.lag.observe(self.loop.time() - due)
        self.event.set()


class Answers:
    """The service every door calls: start an answer, follow it, stop a visitor's answers."""

    def __init__(self, backend: Backend, config: Config, metrics: Metrics) -> None:
        self.backend = backend
        self.config = config
        self.limits = Limits.from_config(config)
        self.metrics = metrics
        self.clients = ClientSlots(config.max_per_client)
        self._lock = threading.Lock()
        self._sessions: dict[str, set[Stream]] = {}  # a page visitor's live answers (Stop cancels them)
        self._live: dict[str, int] = {}  # live answers per door
        self.lag = LoopLag()

    # ---- starting ----------------------------------------------------------------------------------
    async def start(self, admit: Callable[[], ValidRequest], client: str) -> Stream:
        """Run the door's ``admit`` (it decodes the image: up to ~0.1 s, so not on the event loop that serves
        everyone) and submit its request as ``client``; a refusal is counted and raised. The caller's context
        goes along (the Gradio request, whose visitor ZeroGPU bills)."""
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        try:
            return await loop.run_in_executor(None, context.run, self._start, admit, client)
        except DemoError as err:
            self.metrics.rejected(err.code)
            raise

    def _start(self, admit: Callable[[], ValidRequest], client: str) -> Stream:
        return self.submit(admit(), client)

    def submit(self, valid: ValidRequest, client: str) -> Stream:
        """Hand a request that passed the door to the backend as ``client``, within the client's cap."""
        self.clients.take(client)
        try:
            stream = self.backend.submit(dataclasses.replace(valid, client=client))
        except BaseException:
            self.clients.give_back(client)
            raise
        stream.add_done_callback(lambda _: self.clients.give_back(client))
        return stream

    def run_batch(self, items: list[ValidRequest], client: str) -> list[GenerationResult | DemoError]:
        """Answer many at once (Gradio's batch mode) as ``client``: each item within the client's cap (one past
        it gets its refusal in its slot), every item in its slot, never raised."""
        out: list[GenerationResult | DemoError | None] = [None] * len(items)
        taken: list[int] = []
        for i in range(len(items)):
            try:
                self.clients.take(client)
                taken.append(i)
            except DemoError as err:
                self.metrics.rejected(err.code)
                out[i] = err
        try:
            results: list[GenerationResult | DemoError] = list(
                self.backend.run_batch([dataclasses.replace(items[i], client=client) for i in taken])
            )
        except Exception as exc:  # the backend promises not to raise; guard the promise anyway
            log.exception("run_batch raised")
            results = [GenerationError(f"Generation failed: {type(exc).__name__}")] * len(taken)
        finally:
            for _ in taken:
                self.clients.give_back(client)
        missing = [GenerationError("The backend returned no result for this item.")] * len(taken)
        for i, result in zip(taken, (results + missing)[: len(taken)], strict=True):
            out[i] = result
        return [item for item in out if item is not None]

    # ---- following ---------------------------------------------------------------------------------
    async def follow(
        self,
        stream: Stream,
        pacing: Pacing,
        session: str | None = None,
        gone: Callable[[], Awaitable[bool]] | None = None,
    ) -> AsyncGenerator[Moment, None]:
        """Look at ``stream`` as ``pacing`` says until it ends: each look is a :class:`Moment` (its new text may be
        empty). It raises the stream's typed error (:class:`~vlm_demo.errors.RequestCancelledError` once
        cancelled), or :class:`~vlm_demo.errors.BackendTimeoutError` after :data:`TOKEN_TIMEOUT_S` of silence.
        The answer is cancelled when the follower stops early (a closed tab, a caller ``gone``), so its model
        row is freed; ``session`` makes it one of that visitor's answers for :meth:`cancel`."""
        waker = _Waker(asyncio.get_running_loop(), self.lag)
        stream.add_done_callback(waker)
        if pacing.on_text:
            stream.add_text_callback(waker)
        self._enter(stream, pacing, session)
        started = last = checked = time.monotonic()
        view = None
        try:
            while True:
                waker.rearm()
                text, ended = stream.drain()
                now = time.monotonic()
                before, view = view, stream.beam_view()
                if text or (view is not None and view != before):
                    last = now  # new text, or a stage-beam search writing or judging candidates
                yield Moment(text, view, ended, now - started)
                if ended:
                    return
                if now - last > TOKEN_TIMEOUT_S:
                    stream.cancel()
                    raise BackendTimeoutError(f"The model sent nothing for {TOKEN_TIMEOUT_S:.0f} s; please try again.")
                if gone is not None and now - checked >= GONE_CHECK_S:
                    checked = now
                    if await gone():
                        stream.cancel()  # the next drain raises RequestCancelledError
                        continue
                if not stream.done:
                    await waker.wait(pacing.interval(self.live(pacing), self.lag.seconds))
        finally:
            self._leave(stream, pacing, session)
            stream.cancel()  # no-op when finished

    def live(self, pacing: Pacing) -> int:
        """Answers a door follows now."""
        return self._live.get(pacing.name, 0)

    def cancel(self, session: str) -> int:
        """Stop one visitor's live answers; other visitors' go on. Returns how many were stopped."""
        with self._lock:
            streams = list(self._sessions.pop(session, ()))
        for stream in streams:
            stream.cancel()
        return len(streams)

    def _enter(self, stream: Stream, pacing: Pacing, session: str | None) -> None:
        with self._lock:
            self._live[pacing.name] = self._live.get(pacing.name, 0) + 1
            if session is not None:
                self._sessions.setdefault(session, set()).add(stream)

    def _leave(self, stream: Stream, pacing: Pacing, session: str | None) -> None:
        with self._lock:
            self._live[pacing.name] -= 1
            streams = self._sessions.get(session) if session is not None else None
            if streams is not None:
                streams.discard(stream)
                if not streams:
                    del self._sessions[session]  # type: ignore[arg-type]
