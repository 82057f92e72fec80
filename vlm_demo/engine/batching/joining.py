"""How rows join the running batch: newcomers from their prefill, a Think-harder search's candidates from
its snapshot.

A newcomer's cache is written into fresh pages (``RunningRows.place``); a candidate shares its snapshot's
pages (``PageTable.fork``). Either way the row's first token is committed here: drawn from the prompt's
logits and chosen as every step's are (:mod:`~vlm_demo.engine.decoding.choice`: the stage structure may
replace it), or, for a row resuming after it was handed back, the last token it wrote, its draw counter
where it was. What joins when is the scheduler's plan; what to do when a
prefill fails is the engine's.
"""

from __future__ import annotations

import numpy as np
import torch

from vlm_demo.engine.batching.job import Request
from vlm_demo.engine.batching.rows import Row, RunningRows
from vlm_demo.engine.decoding.choice import TokenChoice
from vlm_demo.engine.decoding.detokenizer import RowStreamer
from vlm_demo.engine.decoding.sampler import RowSampling
from vlm_demo.engine.executor.prefill import Prefill
from vlm_demo.engine.executor.worker import Worker
from vlm_demo.engine.kv.page_table import Placement
from vlm_demo.engine.search.beam import StageBeam
from vlm_demo.request import STAGE_BEAM


class Joiner:
    def __init__(self, worker: Worker, rows: RunningRows, structured: bool) -> None:
        self.worker = worker
        self.rows = rows
        self.structured = structured

    def send(self, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """Per-row numbers to the device, in tensors of their own (they live as long as the rows)."""
        return self.rows.staging.send(parts, persist=True)

    def sampling(self, params: list) -> RowSampling:
        return RowSampling(params, self.worker.device, send=self.send)

    def fork(self, search: StageBeam, count: int) -> None:
        """``count`` candidate rows of a search, sharing its start's pages (the plan kept a page for each)."""
        base, rows, params, own_first = search.fork(count)
        places = self.rows.table.fork(base, count)
        assert places is not None, "the plan keeps a page for each candidate"
        sampling = self.sampling(params)
        if own_first:  # drawn from the prompt's logits: the candidates' first tokens
            choice = TokenChoice(sampling, base.logits.expand(count, -1))  # type: ignore[union-attr]
            tokens = choice.draw()
            tokens = self._start(rows, tokens, choice, tokens.tolist())
        else:  # the winner's last token, already written: the candidates' next input
            tokens = base.next_token.expand(count)  # type: ignore[union-attr]
        for row in rows:
            row.request.batch_size = len(self.rows) + count
        self.rows.join(rows, places, tokens, sampling)

    def join(self, group: list[Request], prefill: Prefill, places: list[Placement]) -> list[StageBeam]:
        """Newcomers whose prefill is placed: plain answers join the running rows; a Think-harder request keeps
        its prompt's cache aside as its search's start (returned: the engine runs them)."""
        sampling = self.sampling([r.params for r in group])
        tokens = TokenChoice(sampling, prefill.logits).draw()
        first = tokens.tolist()  # the newcomers' first tokens (a host read, once per admission)
        self.rows.staging.recycle()
        searches = []
        joining = [i for i, r in enumerate(group) if r.params.reasoning != STAGE_BEAM]
        for i, request in enumerate(group):
            if i not in joining:
                start = self.rows.table.keep_aside(places[i], prefill.logits[i : i + 1].clone())
                request.beam = search = StageBeam(request, start, self.worker, self.structured)
                searches.append(search)
        if joining:
            rows = [Row(group[i], self._streamer(group[i])) for i in joining]
            choice = TokenChoice(sampling.select(joining), prefill.logits[joining])
            tokens = self._start(rows, tokens[joining], choice, [first[i] for i in joining])
            for row in rows:
                row.request.batch_size = max(row.request.batch_size, len(self.rows) + len(rows))
                row.request.resume = None
            self.rows.join(rows, [places[i] for i in joining], tokens, choice.sampling)
        return searches

    def _streamer(self, request: Request) -> RowStreamer:
        if request.resume is not None:
            return request.resume.streamer
        tracker = self.worker.tracker(request.params, self.structured and request.staged)
        return RowStreamer(self.worker.tokenizer, request, self.worker.eos_ids, request.stop_text, tracker)

    def _start(
        self, rows: list[Row], tokens: torch.Tensor, choice: TokenChoice[RowSampling], sampled: list[int]
    ) -> torch.Tensor:
        """The rows' first tokens: a newcomer commits the one drawn from its prompt's logits (as ``choice`` has it);
        a resumed row continues from the last token it wrote, its draws where they were. Returns the rows' next
        inputs."""
        fresh = [i for i, row in enumerate(rows) if row.request.resume is None]
        values = list(sampled)
        chosen = choice.commit([rows[i].streamer for i in fresh], [sampled[i] for i in fresh], fresh)
        for i, token in zip(fresh, chosen, strict=True):
            values[i] = token
            rows[i].streamer.feed(token)
        resumes = {i: row.request.resume for i, row in enumerate(rows) if row.request.resume is not None}
        for i in resumes:
            values[i] = rows[i].request.token_ids[-1]
        if resumes:
            draws = [resumes[i].draws if i in resumes else 1 for i in range(len(rows))]
            (choice.sampling.draws,) = self.send([np.asarray(draws)])
        if values == sampled:
            return tokens
        (out,) = self.send([np.asarray(values)])
        return out
