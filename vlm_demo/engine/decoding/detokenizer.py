"""Per-row streaming and stopping inside one batched ``generate`` call.

transformers' stock streamers accept batch size 1 only, and its stop rules apply to the whole batch.
``BatchStreamer`` is handed to ``generate`` as a stopping criterion because that hook sees every
step's token ids for all rows, on CPU and on GPU alike (the ``streamer`` hook lags one step on CUDA).
Each row decodes incrementally, streams its own text, and stops on its own: end of turn, the closing
``</CONCLUSION>`` tag, its own ``max_new_tokens``, or cancellation. Which token a row commits for the one
it sampled is :mod:`~vlm_demo.engine.decoding.choice`'s to say (with stage structure on, it may replace it);
``BatchStreamer`` writes a replacement into ``generate``'s last column, which the next step reads as its input.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from tokenizers.decoders import DecodeStream
from transformers import StoppingCriteria

from vlm_demo.engine.batching.job import STOP_TEXT, Request
from vlm_demo.engine.decoding.choice import GenerateChoice, replacements
from vlm_demo.engine.decoding.structure import StageGrammar, StageTracker

__all__ = ["STOP_TEXT", "BatchStreamer", "RowStreamer", "StageGrammar"]


class RowStreamer:
    """Incremental detokenizer and stop rule for one row.

    Decoding the whole sequence every step is quadratic; decoding only the newest token breaks
    multi-byte characters and merges. So, as TGI does, decode a short window twice and emit the
    difference, holding back text that ends in an incomplete UTF-8 character ("\\ufffd"). With a
    Rust-backed tokenizer, ``tokenizers``' ``DecodeStream`` does exactly that in one native call per
    token; it runs for every row on every step, so the Python version is only the fallback.

    Taking a token (``accept``: its id, end of turn, the length limit) is kept apart from turning it into
    text (``render``: decoding, the stop text), so the continuous engine can launch its next step on the
    device before it renders this one's tokens; ``feed`` does both at once.
    """

    def __init__(
        self,
        tokenizer: Any,
        request: Request,
        eos_ids: Sequence[int],
        stop_text: str | re.Pattern[str] | None = STOP_TEXT,
        structure: StageTracker | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.structure = structure  # the stage grammar this row follows (None: free text)
        # The row ends once its text contains this (a stage's closing tag) or matches it (a judge's choice).
        self.stop_text = stop_text
        self.request = request
        self.eos_ids = set(eos_ids)
        self.ids: list[int] = []
        self.rendered = 0  # how many of ``ids`` are text already
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.done = False
        self.reached_stop_text = False  # ended at ``stop_text`` (not at end of turn or a limit)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = DecodeStream(skip_special_tokens=True) if self._backend is not None else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _next_text(self, count: int) -> str:
        """The text token ``count - 1`` completes, after the ones before it ("" while a character is partial)."""
        if self._stream is not None and self._backend is not None:
            return self._stream.step(self._backend, self.ids[count - 1]) or ""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.ids[self.prefix_offset : count])
        if len(window) <= len(prefix) or window.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, count
        return window[len(prefix) :]

    def _stop_end(self, text: str, new: int) -> int:
        """Where the stop rule's first match in ``text`` ends (-1: none); only the last ``new`` characters
        are new, so a stop string is looked for near the end."""
        stop = self.stop_text
        if not stop:
            return -1
        if isinstance(stop, str):
            at = text.find(stop, max(0, len(text) - new - len(stop)))
            return at + len(stop) if at >= 0 else -1
        match = stop.search(text)
        return match.end() if match else -1

    def feed(self, token_id: int) -> bool:
        """Take the row's next token and render it; return True once the row has finished."""
        return self.accept(token_id) or self.render()

    def accept(self, token_id: int) -> bool:
        """Take the row's next token (its id, end of turn, the length limit; no decoding); True once finished."""
        if self.done:
            return True
        request = self.request
        if request.cancelled:
            return self._stop("cancelled")
        params = request.params
        if token_id in self.eos_ids and not params.ignore_eos:
            return self.render() or self._stop("stop")
        self.ids.append(token_id)
        request.token_ids.append(token_id)
        if len(self.ids) >= params.max_new_tokens:
            return self.render() or self._stop("length")
        return False

    def render(self) -> bool:
        """Turn the tokens taken since the last render into text, and stop at the stop text (tokens taken after
        it are dropped); True once the row has finished."""
        if self.done:
            return True
        request, before = self.request, self.text
        while self.rendered < len(self.ids):
            self.rendered += 1
            new = self._next_text(self.rendered)
            if not new:
                continue
            self.text += new
            end = self._stop_end(self.text, len(new))
            if end >= 0 and not request.params.ignore_eos:
                extra = len(self.ids) - self.rendered
                if extra:
                    del self.ids[-extra:], request.token_ids[-extra:]
                self.text = self.text[:end]
                self.reached_stop_text = True
                request.push_text(self.text)
                return self._stop("stop")
        if self.text != before:
            request.push_text(self.text)
        return False

    def cut(self) -> None:
        """End the row here, as if it ran out of tokens (a stage-beam straggler)."""
        if not self.done:
            self._stop("length")

    def _stop(self, reason: str) -> bool:
        self.done = True
        cut = self.structure.cut if self.structure is not None else None
        if cut is not None:  # the reserve cut a stage short: the answer ran out of tokens, honestly said
            self.request.cut_stage = cut
            reason = "length" if reason == "stop" else reason
        if reason != "cancelled":
            full = self._decode(self.ids)
            end = self._stop_end(full, len(full)) if reason == "stop" else -1
            if end >= 0:
                full = full[:end]
            if full.startswith(self.text):  # flush anything held back (a trailing partial character)
                self.text = full
            self.request.push_text(self.text)
            self.request.finish(reason)
        return True


class BatchStreamer(StoppingCriteria):
    """Feeds each step's newest token, as ``choice`` commits it, to every row and tells ``generate`` which rows
    are done."""

    def __init__(
        self, rows: list[RowStreamer], choice: GenerateChoice, on_step: Callable[[], bool] | None = None
    ) -> None:
        self.rows = rows
        self.choice = choice
        self.on_step = on_step  # told after each step; True: stop every row

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor | None = None, **kwargs: Any
    ) -> torch.BoolTensor:
        newest = input_ids[:, -1].tolist()
        committed = self.choice.commit(self.rows, newest)
        changed = replacements(newest, committed)
        if changed:  # generate's next step reads this column as its input: the replacement takes effect
            where = torch.tensor(list(changed), device=input_ids.device)
            input_ids[where, -1] = torch.tensor(list(changed.values()), device=input_ids.device)
        flags = [row.feed(token) for row, token in zip(self.rows, committed, strict=False)]
        if self.on_step is not None and self.on_step():
            flags = [True] * len(flags)
        return cast(torch.BoolTensor, torch.tensor(flags, dtype=torch.bool, device=input_ids.device))

    def finish_all(self) -> None:
        """After ``generate`` returns, end rows it stopped for its own reasons (overall length)."""
        for row in self.rows:
            if not row.done:
                row._stop("length")
