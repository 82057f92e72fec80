"""Stage-structured decoding: the four stage tags are the engine's, not left to sampling.

LLaVA-CoT answers ``<SUMMARY>…</SUMMARY> <CAPTION>…</CAPTION> <REASONING>…</REASONING>
<CONCLUSION>…</CONCLUSION>``, but a sampled answer (temperature 1.3) breaks that about half the time:
an opening tag never closed (``<SUMMARY de part…``), a stage repeated or skipped, a stage empty, an end of
turn before the CONCLUSION. Every answer here follows the grammar: it opens with ``<SUMMARY>``, a stage is
followed only by the next one's opening, no tag repeats or comes out of order, no stage is empty, and the
answer ends at ``</CONCLUSION>``. Inside a stage, ``<`` starts ordinary text unless it can still become the
closing tag; once ``</`` is written only the rest of that closing tag may follow (``</<SUMMARY>`` is closed as
``</SUMMARY>``). No token that writes a control character (other than newline and tab) is committed, nor one that
finishes a control character the tokens before it began (byte tokens: ``\xc2`` then ``\x9b``): it is drawn again
(the panels' parser, :func:`vlm_demo.cot.stages.parse_stages`, drops any that come from elsewhere).

How, without touching what the model already writes well: a :class:`StageTracker` per row reads each
*sampled* token before it is committed (:mod:`~vlm_demo.engine.decoding.choice` asks it, and makes the second
draws it asks for). A token that keeps the text inside the grammar passes untouched,
so a well-formed greedy answer is token-identical to an unconstrained one. A token that would break it is
replaced before it enters the cache (the continuous engine overwrites the row's next input; the dynamic
engine edits ``generate``'s last column in place, which its next step reads): by the rest of the tag the
grammar wants there, tokenised as the model's own tokenizer splits that text, one forced token per step;
or, when the model tries to close or leave a stage that has no text yet, by a second draw from the same
logits with every ``<``-token, control character, token that starts inside a character, whitespace-only token and
end of turn masked (rare: the one extra host read it costs happens only then). The tracker is host-side string work
on tokens the engine reads back anyway: no extra host sync.

A reserve keeps room for the answer: once a row's budget is down to :func:`conclusion_reserve` tokens, the
running stage is closed and ``<CONCLUSION>`` opened (the stages in between are skipped), and the
CONCLUSION is closed with the last tokens; such an answer reports ``finish_reason`` "length" and names the
stage that was cut.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Sequence

import torch

from vlm_demo.cot.stages import CONTROL, STAGES

OPEN = {stage: f"<{stage.upper()}>" for stage in STAGES}
CLOSE = {stage: f"</{stage.upper()}>" for stage in STAGES}
NAMES = tuple(stage.upper() for stage in STAGES)
GAP = "\n\n"  # what the model writes between stages
RESERVE_FROM = 48  # budgets this small get no reserve: the forced tags alone would take most of it
RESAMPLE = -1  # ``check``'s answer: draw this row again with ``StageGrammar.banned_ids`` masked
MOST_BLANK = 4  # whitespace characters allowed before a stage's opening tag, or before its first text

_TAG_START = re.compile(r"<\s*(/?)\s*([A-Za-z]*)\s*(>?)")


class StageGrammar:
    """What a tokenizer needs for stage-structured decoding, computed once per worker: each token's text,
    how tag texts tokenise, and the tokens a stage with no text yet must not start with."""

    def __init__(self, tokenizer: object, eos_ids: Sequence[int]) -> None:
        decode: Callable[[list[int]], str] = tokenizer.decode  # type: ignore[attr-defined]
        size = len(tokenizer)  # type: ignore[arg-type]
        self.texts = [decode([i]) for i in range(size)]
        self.decode = decode
        self.eos = frozenset(eos_ids)
        self._encode: Callable[..., list[int]] = tokenizer.encode  # type: ignore[attr-defined]
        # tokens that would write a control character (newline and tab aside): never committed to an answer
        self.control = frozenset(i for i, text in enumerate(self.texts) if CONTROL.search(text))
        # tokens that start inside a character (a UTF-8 continuation byte: alone they decode to U+FFFD): after a
        # token that began a character they may finish it, a control character too ("\xc2" then "\x9b": U+009B)
        self.continuing = frozenset(i for i, text in enumerate(self.texts) if text.startswith("\ufffd"))
        blank = {i for i, text in enumerate(self.texts) if text and text.isspace()}  # a redraw must write text
        tags = {i for i, text in enumerate(self.texts) if "<" in text}
        self.banned_ids = sorted(tags | self.control | blank | self.eos | self.continuing)
        self._bans: dict[torch.device, torch.Tensor] = {}
        self._encoded: dict[str, list[int]] = {}
        last = STAGES[-1]
        jumps = [len(self.encode(CLOSE[s] + GAP + OPEN[last])) for s in STAGES[:-1]]
        self.overhead = max(jumps) + len(self.encode(CLOSE[last]))

    def encode(self, text: str) -> list[int]:
        if text not in self._encoded:
            self._encoded[text] = list(self._encode(text, add_special_tokens=False))
        return self._encoded[text]

    def ban_mask(self, size: int, device: torch.device) -> torch.Tensor:
        """``[size]`` bool, True for the tokens a second draw must not take (kept per device)."""
        if device not in self._bans:
            mask = torch.zeros(size, dtype=torch.bool)
            mask[[i for i in self.banned_ids if i < size]] = True
            self._bans[device] = mask.to(device)
        return self._bans[device]

    def answer(self, budget: int) -> StageTracker:
        """The tracker of a whole answer: the four stages, with the CONCLUSION's reserve."""
        reserve = conclusion_reserve(budget, self.overhead)
        return StageTracker(self, STAGES, budget, reserve, close_at_end=reserve > 0)

    def candidate(self, stage: str, budget: int, answer_budget: int, lead: str) -> StageTracker:
        """The tracker of a Think-harder candidate: one stage whose opening (after ``lead``) is forced;
        a stage before the CONCLUSION closes early when the answer's reserve is reached."""
        reserve = conclusion_reserve(answer_budget, self.overhead)
        last = stage == STAGES[-1]
        return StageTracker(
            self, (stage,), budget, 0 if last else reserve, force_open=lead, close_at_end=last and reserve > 0
        )


def conclusion_reserve(budget: int, overhead: int) -> int:
    """Tokens kept for the CONCLUSION: the forced tags, plus 10 % of the budget (at least 8, at most 128)."""
    if budget < RESERVE_FROM:
        return 0
    return overhead + min(128, max(8, budget // 10))


def _tag_like(fragment: str) -> str | None:
    """``fragment`` (starting at "<") as a tag in the making, normalised ("</CAP", "<SUMMARY>"), or ``None``
    when it can no longer be one of the eight stage tags ("< 5", "<b>", "<Sunday")."""
    match = _TAG_START.match(fragment)
    if match is None or match.end() != len(fragment.rstrip()) and not fragment[match.end() :].isspace():
        return None
    slash, letters, closing = match.groups()
    letters = letters.upper()
    if closing and letters not in NAMES:
        return None
    if not any(name.startswith(letters) for name in NAMES):
        return None
    return f"<{slash}{letters}{closing}"


class StageTracker:
    """One row's place in the grammar. ``check(token, written)`` returns the token to commit (the sampled
    one, or a replacement) or :data:`RESAMPLE`; ``cut`` names the stage the reserve cut short."""

    def __init__(
        self,
        grammar: StageGrammar,
        stages: Sequence[str],
        budget: int,
        reserve: int = 0,
        force_open: str | None = None,
        close_at_end: bool = False,
    ) -> None:
        self.grammar = grammar
        self.stages = tuple(stages)
        self.budget = budget
        self.reserve = reserve  # once this few tokens are left, the running stage closes (0: never)
        self.close_at_end = close_at_end  # the last stage is closed with the budget's last tokens
        self.index = 0  # the stage being opened or written
        self.phase = "open"  # "open" (expecting OPEN[stage]), "body", or "done"
        self.matched = 0  # characters of the opening tag written so far
        self.content = False  # the running stage has non-whitespace text
        self.pending = ""  # a trailing "<…" that may still become the closing tag
        self.blank = 0  # whitespace written since the last tag while the stage has no text (at most MOST_BLANK)
        self.jump = False  # the reserve cut the running stage: the last stage follows it
        self.forced: deque[int] = deque()
        self.partial: list[int] = []  # the last committed tokens while they end inside a character (at most 3)
        self.cut: str | None = None
        self.corrections = 0  # sampled tokens replaced or drawn again (the tests read it)
        self.repaired = False  # a sampled token broke the grammar and was replaced or drawn again
        if force_open is not None:
            self.forced.extend(grammar.encode(force_open + OPEN[self.stage]))

    @property
    def stage(self) -> str:
        return self.stages[min(self.index, len(self.stages) - 1)]

    @property
    def done(self) -> bool:
        return self.phase == "done"

    def check(self, token: int, written: int, redrawn: bool = False) -> int:
        """The token to commit after ``written`` tokens, given the model sampled ``token`` (``redrawn``:
        a second draw with the "<"-tokens masked, which is taken as it is)."""
        if self.phase == "done":
            return token
        if not self.forced and not redrawn:
            self._plan(written)
            if not self.forced:
                fix = self._verdict(token)
                if fix == RESAMPLE:
                    self.corrections += 1
                    self.repaired = True
                    return RESAMPLE
                if fix is not None:
                    self.repaired = True
                    self.forced.extend(fix)  # type: ignore[arg-type]
                elif not self._closes_in_time(token, written):  # "</" then "b": the tag would no longer fit
                    self._close_last(self.grammar.encode(self._rest_of_close()))
        if self.forced:
            forced = self.forced.popleft()
            self._take(self.grammar.texts[forced])
            self.corrections += forced != token
            return self._remember(forced)
        self._take(self.grammar.texts[token] if token not in self.grammar.eos else "")
        return self._remember(token)

    def _remember(self, token: int) -> int:
        """Keep the committed ``token`` while the text ends inside a character (returns it)."""
        ends_inside = self.grammar.texts[token].endswith("\ufffd") and token not in self.grammar.eos
        self.partial = [*self.partial[-2:], token] if ends_inside else []
        return token

    def _completes_control(self, token: int) -> bool:
        """Whether ``token`` finishes a character the committed tokens began, and that is a control character."""
        if not self.partial or token not in self.grammar.continuing:
            return False
        return CONTROL.search(self.grammar.decode([*self.partial, token])) is not None

    # ---- what to force ------------------------------------------------------------------------------------
    def _plan(self, written: int) -> None:
        """Force the reserve's tags when the budget comes down to it."""
        left = self.budget - written
        last = self.stages[-1]
        if self.reserve and self.cut is None and left <= self.reserve and (len(self.stages) == 1 or self.stage != last):
            text = self._jump_text()
            if text is not None:
                self.cut = self.stage
                if self.phase == "open":  # the stage never opened: the last one comes next
                    self.index = len(self.stages) - 1
                else:
                    self.jump = True  # once this stage closes, the last one comes next
                self.forced.extend(self.grammar.encode(text))
                return
        if self.close_at_end and self.stage == last and self.phase == "body" and self.content:
            closing = self.grammar.encode(self._rest_of_close())
            if left <= len(closing):
                self._close_last(closing)

    def _close_last(self, closing: list[int]) -> None:
        """Force the last stage's closing tag (``closing``: what is left of it) with the budget's last tokens."""
        self.cut = self.cut or self.stages[-1]
        self.close_at_end = False
        self.forced.extend(closing)

    def _closes_in_time(self, token: int, written: int) -> bool:
        """Whether, with ``token`` taken, the last stage's closing tag still fits the budget (a token that
        breaks off a closing tag under way puts the whole tag back to write)."""
        if not (self.close_at_end and self.stage == self.stages[-1] and self.phase == "body"):
            return True
        probe = _Probe(self)
        probe.feed(self.grammar.texts[token])
        if probe.phase != "body" or not probe.content:
            return True
        rest = self.grammar.encode(_rest_of_close(CLOSE[self.stage], probe.pending))
        return 1 + len(rest) <= self.budget - written

    def _jump_text(self) -> str | None:
        """Close the running stage and open the last one (a candidate: just close its stage); ``None``
        while that cannot be written cleanly yet (mid-tag, or a stage with no text)."""
        last = self.stages[-1]
        if self.phase == "body" and self.content:
            return self._rest_of_close() if len(self.stages) == 1 else self._rest_of_close() + GAP + OPEN[last]
        if self.phase == "open" and self.matched == 0 and len(self.stages) > 1 and self.stage != last:
            return OPEN[last]
        return None

    def _rest_of_close(self) -> str:
        return _rest_of_close(CLOSE[self.stage], self.pending)

    def _verdict(self, token: int) -> list[int] | int | None:
        """``None`` when ``token`` keeps the text in the grammar; else the tokens to force instead (the part of
        the token's text that fitted, then the tag the grammar wants there) or RESAMPLE."""
        if token in self.grammar.eos:
            return self._instead_of_leaving(_Probe(self), "")
        if token in self.grammar.control or self._completes_control(token):  # in text: draw again; mid-tag: its rest
            return RESAMPLE if self.phase == "body" and not self.pending else self._instead_of_leaving(_Probe(self), "")
        text = self.grammar.texts[token]
        probe = _Probe(self)
        if probe.feed(text):
            return None
        return self._instead_of_leaving(probe, text[: probe.consumed])

    def _instead_of_leaving(self, at: _Probe, fitted: str) -> list[int] | int:
        """Where the text stops fitting (``at``): finish the opening tag, or close the stage properly, or
        (the stage has no text yet) draw again."""
        if at.phase == "open":
            return self.grammar.encode(fitted + OPEN[at.stages[at.index]][at.matched :])
        if not at.content:
            return RESAMPLE
        return self.grammar.encode(fitted + _rest_of_close(CLOSE[at.stages[at.index]], at.pending))

    def _take(self, text: str) -> None:
        probe = _Probe(self, taken=True)
        if not probe.feed(text):  # a forced or redrawn token that does not fit: keep the state anyway
            probe.pending = ""
        probe.commit(self)


def _rest_of_close(closing: str, pending: str) -> str:
    """What is left to write of ``closing`` after the partial tag ``pending`` ("</CAP" -> "TION>"; all of it after
    a "< " that turned out not to be its start)."""
    return closing[len(pending) :] if closing.startswith(pending) else closing


def _wrong_tag(candidate: str) -> bool:
    """Whether ``candidate`` ("<" or a trailing fragment that does not continue the wanted closing tag) is a stage
    tag in the making all the same, which the text must not get: another stage's tag or this one's opening, in any
    case or spacing ("<S", "</c", "< CAPTION"), or a closing tag under way that went astray ("</SUMx", "</<",
    "</ ")."""
    if candidate.startswith("</") and (not candidate[-1].isalnum() or any(c.isalpha() for c in candidate[2:-1])):
        return True
    fragment = _tag_like(candidate)
    return fragment is not None and any(c.isalpha() for c in fragment)


class _Probe:
    """A copy of a tracker's state that consumes text character by character, to see whether a token fits."""

    def __init__(self, tracker: StageTracker, taken: bool = False) -> None:
        # ``taken``: the text is committed whatever it holds (a redraw's " word"), so whitespace past the limit
        # is only whitespace: the word after it is the stage's text, and the stage may close
        self.taken = taken
        self.stages = tracker.stages
        self.index, self.phase, self.matched = tracker.index, tracker.phase, tracker.matched
        self.content, self.pending, self.jump = tracker.content, tracker.pending, tracker.jump
        self.blank = tracker.blank
        self.consumed = 0  # characters of the last text fed that fitted

    def commit(self, tracker: StageTracker) -> None:
        tracker.index, tracker.phase, tracker.matched = self.index, self.phase, self.matched
        tracker.content, tracker.pending, tracker.jump = self.content, self.pending, self.jump
        tracker.blank = self.blank

    def feed(self, text: str) -> bool:
        for self.consumed, char in enumerate(text):
            if not self._char(char):
                return False
        self.consumed = len(text)
        return True

    def _char(self, char: str) -> bool:
        if self.phase == "done":
            return True
        stage = self.stages[self.index]
        if self.phase == "open":
            literal = OPEN[stage]
            if self.matched == 0 and char.isspace():
                self.blank += 1
                return self.blank <= MOST_BLANK or self.taken  # past that, the opening tag is forced
            if char != literal[self.matched]:  # exactly the tag: the stop text and the panels read it so
                return False
            self.matched += 1
            if self.matched == len(literal):
                self.phase, self.content, self.pending, self.blank = "body", False, "", 0
            return True
        if self.pending or char == "<":
            closing, candidate = CLOSE[stage], self.pending + char
            if closing.startswith(candidate):  # the closing tag, exactly, so far
                if not self.content:
                    return False  # a stage with no text yet cannot close
                if candidate == closing:
                    self.index = len(self.stages) - 1 if self.jump else self.index + 1
                    self.jump = False
                    self.phase = "done" if self.index == len(self.stages) else "open"
                    self.matched, self.pending, self.blank = 0, "", 0
                    return True
                self.pending = candidate
                return True
            if _wrong_tag(candidate):
                return False  # another stage's tag, this one's opening again, its closing misspelt: forced instead
            if candidate[-1].isspace() and candidate.strip() == "<":
                self.pending = candidate  # "< ": a tag or not, the next character says
                return True
            self.content, self.pending = True, ""  # not a tag after all ("< 5", "x<y", "<b>", "</b>"): text
            return self._char(char) if char == "<" else True  # ... but this "<" may open a tag of its own
        if not char.isspace():
            self.content = True
        elif not self.content:
            self.blank += 1
            return self.blank <= MOST_BLANK or self.taken  # a stage of nothing but whitespace: its text drawn again
        return True
