"""Stage-level beam search (LLaVA-CoT's inference-time scaling), run inside the continuous engine.

For each stage in turn (SUMMARY → CAPTION → REASONING → CONCLUSION):

1. *fork*: the stage's starting row is copied into K candidate rows of the running batch. The first
   stage starts from the prompt right after its prefill (prompt and image are prefilled once per
   answer); every later stage starts from the previous winner's own cache, so nothing is recomputed.
2. *write*: the K candidates decode together, alongside everyone else's rows, each with its own seed,
   and each stops at the stage's closing tag.
3. *judge*: the same model compares candidates in pairs with a per-stage rubric
   (:mod:`vlm_demo.cot.judge`), knockout style; the judge calls of one round run as one batch. The winner's
   tokens and cache are where the next stage starts.

While a stage is judged, rows would sit idle and the visitor would wait on the judge alone, so the next
stage is written ahead from one contender (*speculation*, only when no other request waits for rows):
the one most of the K candidates agree on (the first on a tie), as self-consistency would pick. If it
wins, those candidates simply carry on; once it loses a round, they are dropped and the stage forks
from the winner. Seeds are per (answer, stage, candidate), so the
answer is the same either way; only the wait changes.

A candidate that misses its closing tag (end of turn, out of tokens) is dropped when another one has
it; when none has it, the winner ends the answer there, as a normal answer would end. Likewise a
candidate the stage structure had to steer to its closing tag (it tried to leave the stage the wrong
way) is dropped when another closed the stage on its own: such candidates are mostly garbled, and
judging them cost more judge calls and more wrong winners. Identical
candidates are judged once. A straggler is cut: once half the candidates have closed the stage, one
still writing past twice their length (plus some slack) ends there without its tag, so one rambling
or looping candidate does not hold the whole answer (and the visitor) for up to ``max_new_tokens``.
A judge call ends at its choice. The engine owns the rows (:mod:`vlm_demo.engine.batching.continuous`); this
class owns the decisions. ``serial_beams`` (benchmarks only) runs the same search one candidate and one
judge call at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from vlm_demo.cot.judge import CHOICE, judge_question, parse_choice
from vlm_demo.cot.stages import STAGES, _without_tags, parse_stages
from vlm_demo.engine.batching.job import STOP_TEXT, Request
from vlm_demo.engine.batching.rows import Row
from vlm_demo.engine.decoding.detokenizer import RowStreamer
from vlm_demo.engine.decoding.structure import GAP, conclusion_reserve
from vlm_demo.engine.executor.worker import Worker
from vlm_demo.engine.kv.page_table import Snapshot
from vlm_demo.errors import DemoError
from vlm_demo.request import SamplingParams, ValidParams
from vlm_demo.results import BeamView, StageChoice

PAPER_TEMPERATURE, PAPER_TOP_P = 0.6, 0.9  # candidates of a greedy request sample as the paper's do
JUDGE_MAX_NEW_TOKENS = 96  # "Since [reason], I choose response [1/2]." with room for a reason
JUDGE_PARAMS = SamplingParams(JUDGE_MAX_NEW_TOKENS, 0.0, 1.0, seed=0).validated(JUDGE_MAX_NEW_TOKENS)  # greedy
MAX_STAGE_RETRIES = 2  # an out-of-memory step restarts the running stage at most this often
STRAGGLER_FACTOR, STRAGGLER_SLACK = 2, 16  # a candidate's stage may take 2x the quorum's length + 16 tokens


class InternalRequest(Request):
    """A candidate row or a judge call of a search: the search reads its text, no client is sent it."""

    visible = False


class JudgeRequest(InternalRequest):
    """A judge call: its row stops once the choice is written ("I choose response 2"), not at end of turn."""

    stop_text = CHOICE
    staged = False  # the judge's words are free text: the stage structure must not force tags into them


def candidate_seed(seed: int, stage: int, candidate: int) -> int:
    """A distinct, reproducible seed per (answer, stage, candidate)."""
    return (seed ^ (0x9E3779B97F4A7C15 * (stage * 64 + candidate + 1))) % 2**63


@dataclass(eq=False)
class Candidate:
    request: InternalRequest
    streamer: RowStreamer
    snapshot: Snapshot | None = None  # its cache at the closing tag (only when it reached the tag)
    finished: bool = False
    cut_at: int | None = None  # a straggler: only its first ``cut_at`` tokens count, and it has no tag

    @property
    def ids(self) -> list[int]:
        return self.streamer.ids if self.cut_at is None else self.streamer.ids[: self.cut_at]

    @property
    def tagged(self) -> bool:
        return self.streamer.reached_stop_text and self.cut_at is None

    @property
    def closed_itself(self) -> bool:
        """It closed its stage without the stage structure's help: a candidate that tried to leave its stage
        the wrong way was closed by the grammar instead, and like one that never closed, it is judged only
        when no candidate closed on its own."""
        structure = self.streamer.structure
        return self.tagged and (structure is None or not structure.repaired)

    def misses(self, limit: int) -> bool:
        """It did not close the stage within ``limit`` tokens (a running row that reached it cannot)."""
        length = len(self.streamer.ids)
        return length > limit or (length == limit and not self.streamer.reached_stop_text)

    def inner(self, stage: str) -> str:
        """The stage's text without tags (what the judge and the page see)."""
        text = self.request.text
        if self.cut_at is not None:
            text = self.streamer.tokenizer.decode(self.ids, skip_special_tokens=True)
        return parse_stages(text, final=self.finished).text(stage) or _without_tags(text).strip()


@dataclass(eq=False)
class Judgement:
    request: InternalRequest
    first: Candidate
    second: Candidate

    def winner(self) -> Candidate:
        """The judged better one; the first when the judge failed or named neither."""
        if self.request.error is not None:
            return self.first
        choice = parse_choice(self.request.text)
        return self.second if choice == 1 else self.first


@dataclass(eq=False)
class StageBeam:
    """One answer's stage-level beam search; driven by the engine thread."""

    request: Request  # the visitor's: winners' text streams into it
    start: Snapshot  # the prompt after prefill: image states, and where the first stage forks from
    worker: Worker  # tokenizer, eos ids, device, ``prepare_with`` for judge prompts
    structured: bool = True  # candidates follow the stage grammar, their stage's opening forced
    stage_index: int = 0
    tokens: list[int] = field(default_factory=list)  # the winners' tokens so far
    text: str = ""
    candidates: list[Candidate] = field(default_factory=list)
    started: int = 0  # candidates forked in this stage
    contenders: list[Candidate] = field(default_factory=list)
    judgements: list[Judgement] = field(default_factory=list)  # this round's
    queued: list[Judgement] = field(default_factory=list)  # not yet handed to the engine (serial mode)
    spec_from: Candidate | None = None  # the likelier winner, whose next stage is written ahead
    spec: list[Candidate] = field(default_factory=list)  # that next stage's candidates
    said: list[str] = field(default_factory=list)  # this stage's judge answers so far
    history: list[StageChoice] = field(default_factory=list)
    phase: str = "writing"
    judge_calls: int = 0
    retries: int = 0
    cut: str | None = None  # the stage the CONCLUSION's reserve cut short or skipped

    def __post_init__(self) -> None:
        self.params = self.request.params
        self.base = self.start

    # ---- what the engine asks --------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.phase == "done" or self.request.done

    @property
    def stage(self) -> str:
        return STAGES[self.stage_index]

    @property
    def speculating(self) -> bool:
        return self.phase == "judging" and self.spec_from is not None

    def rows_wanted(self, spare: bool = True) -> int:
        """Candidate rows to fork now: all K at a stage's start, or one at a time in serial mode; while
        a last round is judged and ``spare`` (nobody else waits for rows), the next stage's, ahead."""
        if self.finished:
            return 0
        if self.speculating:
            judged = all(j.request.started is not None for j in self.judgements)  # the judge goes first
            return self.params.beams - len(self.spec) if spare and judged else 0
        if self.phase != "writing" or self.started >= self.params.beams:
            return 0
        if self.request.serial_beams:
            return 1 if all(c.finished for c in self.candidates) else 0
        return self.params.beams - self.started

    def fork(self, rows: int) -> tuple[Snapshot, list[Row], list[ValidParams], bool]:
        """``rows`` new candidates from the stage's start (while speculating: the next stage's, from the
        likelier winner): the snapshot they continue from (the engine shares its pages with them), their rows
        and sampling parameters, and whether their first tokens are still to be drawn (after a prefill: from
        its logits) or are the winner's last token, already written (after a stage)."""
        ahead = self.spec_from if self.speculating else None
        base = ahead.snapshot if ahead is not None else self.base
        assert base is not None, "a speculated stage starts from a candidate that closed its stage"
        stage_index = self.stage_index + (ahead is not None)
        written = len(self.tokens) + (len(ahead.ids) if ahead is not None else 0)
        into = self.spec if ahead is not None else self.candidates
        first = len(into) if ahead is not None else self.started
        params = [candidate_params(self.params, stage_index, first + i, written) for i in range(rows)]
        stop = f"</{STAGES[stage_index].upper()}>"
        written_ids = (self.tokens + ahead.ids) if ahead is not None else self.tokens
        tail = self.worker.tokenizer.decode(written_ids[-1:]) if written_ids else ""
        lead = "" if not written_ids or tail[-1:].isspace() else GAP  # the stage's opening, as the model spaces it
        new_rows = []
        for p in params:
            request = InternalRequest(image=None, question="", params=p, client=self.request.client)
            structure = None
            if self.structured and not p.ignore_eos:
                grammar = self.worker.grammar
                structure = grammar.candidate(STAGES[stage_index], p.max_new_tokens, self.params.max_new_tokens, lead)
            streamer = RowStreamer(self.worker.tokenizer, request, self.worker.eos_ids, stop, structure)
            into.append(Candidate(request, streamer))
            new_rows.append(Row(request, streamer, beam=self))
        if ahead is None:
            self.started += rows
        return base, new_rows, params, base.logits is not None

    def candidate_done(self, row: Row, snapshot: Snapshot | None) -> None:
        """A candidate row left the batch (closing tag, end of turn or out of tokens)."""
        for candidate in self.candidates + self.spec:
            if candidate.request is row.request:
                candidate.snapshot = snapshot
                candidate.finished = True
                return
        if snapshot is not None:  # a candidate dropped meanwhile: nobody will fork from it
            snapshot.release()

    def close(self) -> None:
        """The search is over: every cache it kept aside goes back to the pool."""
        for snapshot in [self.start, self.base, *(c.snapshot for c in self.candidates + self.spec + self.contenders)]:
            if snapshot is not None:
                snapshot.release()

    def advance(self) -> list[Request]:
        """Move on when a phase is complete; returns judge calls for the engine to queue (first in line)."""
        if self.finished:
            self.phase = "done"
            return []
        if self.phase == "writing":
            self._cut_stragglers()
        if self.phase == "writing" and self.started >= self.params.beams and all(c.finished for c in self.candidates):
            self._judge_or_decide()
        elif self.phase == "judging" and all(j.request.done for j in self.judgements) and not self.queued:
            self._after_round()
        if self.phase == "judging" and self.queued:
            if not self.request.serial_beams:
                calls, self.queued = self.queued, []
                return [j.request for j in calls]
            if all(j.request.done for j in self.judgements if j not in self.queued):
                return [self.queued.pop(0).request]
        return []

    def restart_stage(self, error: DemoError) -> None:
        """The running stage's rows were lost to a failed step: write it again (or give up)."""
        self.retries += 1
        if self.retries > MAX_STAGE_RETRIES:
            self.fail(error)
            return
        for judgement in self.judgements:
            judgement.request.cancel()
        self._drop_speculation()
        keep = {id(self.base), id(self.start)}
        for candidate in self.candidates:
            if candidate.snapshot is not None and id(candidate.snapshot) not in keep:
                candidate.snapshot.release()
        self.candidates, self.started, self.judgements, self.queued, self.said = [], 0, [], [], []
        self.contenders = []
        self.phase = "writing"

    def fail(self, error: DemoError) -> None:
        self.cancel_children()
        self.request.fail(error)
        self.phase = "done"

    def cancel_children(self) -> None:
        self._drop_speculation()
        for candidate in self.candidates:
            candidate.request.cancel()
        for judgement in self.judgements:
            judgement.request.cancel()

    # ---- the page's view -------------------------------------------------------------------------
    def view(self) -> BeamView:
        """Decided stages, then the running one (read from other threads: copies, never raises)."""
        stages = list(self.history)
        if self.phase != "done" and self.stage_index < len(STAGES):
            stage = self.stage
            texts = tuple(c.inner(stage) for c in list(self.candidates))
            stages.append(StageChoice(stage, texts, None, tuple(self.said)))
        return BeamView(tuple(stages), self.phase, self.params.beams, self.judge_calls)

    # ---- decisions --------------------------------------------------------------------------------
    def _cut_stragglers(self) -> None:
        """Stop candidate rows that can no longer close the stage within the limit (they leave the batch)."""
        limit = stage_limit(self.params.beams, self.candidates)
        if limit is None:
            return
        for candidate in self.candidates:
            if not candidate.finished and candidate.misses(limit):
                candidate.streamer.cut()

    def _judge_or_decide(self) -> None:
        """Cut stragglers; keep the candidates that closed the stage on their own (else those the structure
        closed, else any with text); drop repeats; judge the rest."""
        limit = stage_limit(self.params.beams, self.candidates)
        for candidate in self.candidates:
            if limit is not None and candidate.misses(limit):
                candidate.cut_at = limit
        self.contenders = unique = contenders(self.candidates)
        if len(unique) == 1:
            self._decide(unique[0])
            return
        self._new_round()
        # Write the next stage ahead from the contender most candidates agree on (the first on a tie).
        likelier = max(unique, key=lambda c: sum(x.tagged and x.ids == c.ids for x in self.candidates))
        if (
            not self.request.serial_beams
            and self.stage_index < len(STAGES) - 1
            and self.params.max_new_tokens - len(self.tokens) - len(likelier.ids) > self._reserve
            and likelier.tagged
        ):
            self.spec_from = likelier

    def _new_round(self) -> None:
        """Pair the contenders in order (a last odd one goes through) and queue one judge call per pair."""
        pairs = list(zip(self.contenders[0::2], self.contenders[1::2], strict=False))
        self.judgements = [
            Judgement(judge_request(self.worker, self.request, self.stage, a, b), a, b) for a, b in pairs
        ]
        self.queued = list(self.judgements)
        self.judge_calls += len(pairs)
        self.phase = "judging"

    def _drop_speculation(self) -> None:
        for candidate in self.spec:
            candidate.request.cancel()
            if candidate.snapshot is not None:
                candidate.snapshot.release()
        self.spec_from, self.spec = None, []

    def _after_round(self) -> None:
        winners = [j.winner() for j in self.judgements]
        self.said += [j.request.text.strip() for j in self.judgements]
        if len(self.contenders) % 2:
            winners.append(self.contenders[-1])
        self.contenders, self.judgements = winners, []
        if self.spec_from is not None and self.spec_from not in winners:
            self._drop_speculation()  # the guess lost a round: free its rows now
        if len(winners) > 1:
            self._new_round()
            return
        ahead, self.spec = (self.spec, []) if winners[0] is self.spec_from else ([], self.spec)
        self._drop_speculation()  # cancels the guess's rows unless it won (then they were taken out above)
        self._decide(winners[0])
        if ahead and self.phase == "writing":  # the guess won: its next stage is under way
            self.candidates, self.started = ahead, len(ahead)
        else:
            for candidate in ahead:
                candidate.request.cancel()

    def _decide(self, winner: Candidate) -> None:
        """Keep the winner: its tokens extend the answer and its cache starts the next stage."""
        stage = self.stage
        self.history.append(
            StageChoice(
                stage,
                tuple(c.inner(stage) for c in self.candidates),
                self.candidates.index(winner),
                tuple(self.said),
                tuple(c.tagged for c in self.candidates),
            )
        )
        self.tokens += winner.ids
        self.text += self.worker.tokenizer.decode(winner.ids, skip_special_tokens=True)
        request = self.request
        request.token_ids = list(self.tokens)
        request.batch_size = max(request.batch_size, *(c.request.batch_size for c in self.candidates))
        request.push_text(self.text)
        for candidate in self.candidates:  # the losers' caches go back to the pool
            if candidate is not winner and candidate.snapshot is not None:
                candidate.snapshot.release()
        self.candidates, self.started, self.judgements, self.queued, self.said = [], 0, [], [], []
        if winner.streamer.structure is not None and winner.streamer.structure.cut:
            self.cut = self.cut or stage
        if not winner.tagged:  # it ended the answer (end of turn) or ran out of tokens
            self._finish(winner.streamer.request.finish_reason or "stop")
        elif self.stage_index == len(STAGES) - 1:
            self._finish("stop")
        elif len(self.tokens) >= self.params.max_new_tokens:
            self._finish("length")
        else:
            if self.base is not self.start:
                self.base.release()
            self.base = winner.snapshot  # type: ignore[assignment]  # a tagged candidate always has one
            winner.snapshot = None  # now the search's base: released with it
            self.start.release()  # the prompt's own pages: every later stage forks from a winner (image pages shared)
            self.stage_index = self._next_stage()
            self.phase = "writing"

    def _next_stage(self) -> int:
        """The next stage, or the CONCLUSION when the answer's reserve is reached (the stages between skipped)."""
        last = len(STAGES) - 1
        left = self.params.max_new_tokens - len(self.tokens)
        if self.structured and (self.cut or left <= self._reserve):
            if self.stage_index + 1 < last:
                self.cut = self.cut or STAGES[self.stage_index + 1]
            return last
        return self.stage_index + 1

    @property
    def _reserve(self) -> int:
        """The answer's CONCLUSION reserve (0 without stage structure: the next stage may start at any length)."""
        return conclusion_reserve(self.params.max_new_tokens, self.worker.grammar.overhead) if self.structured else 0

    def _finish(self, reason: str) -> None:
        if self.cut is not None:
            self.request.cut_stage = self.cut
            reason = "length" if reason == "stop" else reason
        self.phase = "done"
        if STOP_TEXT in self.text:
            self.text = self.text[: self.text.index(STOP_TEXT) + len(STOP_TEXT)]
            self.request.text = self.text
        self.request.finish(reason)


def candidate_params(p: ValidParams, stage_index: int, index: int, written: int) -> ValidParams:
    """Candidate ``index`` of stage ``stage_index``, after ``written`` answer tokens: its own seed, and the
    paper's sampling when the visitor asked for greedy answers."""
    return replace(
        p,
        max_new_tokens=max(1, p.max_new_tokens - written),
        temperature=p.temperature if p.temperature > 0 else PAPER_TEMPERATURE,
        top_p=p.top_p if p.temperature > 0 else PAPER_TOP_P,
        seed=candidate_seed(p.seed, stage_index, index),
        reasoning="normal",
    )


def stage_limit(beams: int, candidates: list[Candidate]) -> int | None:
    """The tokens a candidate of this stage may take, known once half of the K have closed the stage.

    It depends only on the candidates' lengths, not on when they finished, so a search with all K
    candidates at once, in waves, or one at a time (``serial_beams``) cuts the same candidates at the
    same token; when more short ones close later (waves), the limit only goes down.
    """
    quorum = (beams + 1) // 2
    closed = sorted(len(c.streamer.ids) for c in candidates if c.streamer.reached_stop_text)
    return STRAGGLER_FACTOR * closed[quorum - 1] + STRAGGLER_SLACK if len(closed) >= quorum else None


def contenders(candidates: list[Candidate]) -> list[Candidate]:
    """Who is judged: the candidates that closed the stage on their own (else those the structure closed,
    else any with text), each distinct answer once."""
    pool = (
        [c for c in candidates if c.closed_itself]
        or [c for c in candidates if c.tagged]
        or [c for c in candidates if c.ids]
        or candidates
    )
    unique: dict[tuple[int, ...], Candidate] = {}
    for candidate in pool:
        unique.setdefault(tuple(candidate.ids), candidate)
    return list(unique.values())


def judge_request(worker: Worker, request: Request, stage: str, first: Candidate, second: Candidate) -> JudgeRequest:
    """The judge call comparing two candidates' ``stage``, over the visitor's picture (its states come cached)."""
    text = judge_question(stage, request.question, first.inner(stage), second.inner(stage))
    judge = JudgeRequest(image=None, question=text, params=JUDGE_PARAMS)
    judge.client, judge.image_key = request.client, request.image_key
    judge.inputs = worker.prepare_with(request.inputs, text)
    return judge
