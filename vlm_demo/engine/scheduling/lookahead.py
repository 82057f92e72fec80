"""Waiting requests' pictures through the vision tower before their admission, a few layers a step.

The tower is most of a newcomer's prefill (a 4-tile picture is ~6,400 vision tokens through 40 layers at 11B).
While rows decode, the engine runs it here for the requests next in line, as many layers per step as the
step's allowance holds (:mod:`~vlm_demo.engine.scheduling.pacing`), one group of pictures of one tile count at a time; a
request joins only once its picture is ready, so its own prefill is the text alone. The finished states are
held by the requests (and put in the image-state cache for repeats: :meth:`PictureStates.encoded
<vlm_demo.engine.executor.picture_states.PictureStates.encoded>`) until their prefill takes them. At most
``depth`` waiting requests are looked at, which bounds the states held outside the page pool to what one
prefill of that many newcomers holds anyway.
"""

from __future__ import annotations

from vlm_demo.engine.batching.job import Request
from vlm_demo.engine.executor.picture_states import PictureStates
from vlm_demo.engine.executor.vision import TowerJob
from vlm_demo.engine.executor.worker import Worker
from vlm_demo.engine.scheduling.pacing import Pacer


class Lookahead:
    """The tower job in progress for the waiting requests' pictures (the engine thread's)."""

    def __init__(self, worker: Worker, pictures: PictureStates, pacer: Pacer, depth: int) -> None:
        self.worker = worker
        self.pictures = pictures
        self.pacer = pacer
        self.depth = depth
        self.job: TowerJob | None = None
        self.showing: list[list[Request]] = []  # for each picture of the job, the waiting requests showing it

    def work(self, waiting: list[Request], seconds: float, reserve: int, must: bool) -> float:
        """Tower layers for the next waiting pictures, as many as ``seconds`` hold at the measured cost of a
        tile-layer; with ``must`` (the step prefilled nobody) at least one, so a picture always moves on.
        Returns the seconds spent."""
        budget, spent = self.pacer.units("vision", seconds, at_least=1 if must else 0), 0.0  # in tiles × layers
        while budget > 0:
            job = self.job if self.job is not None and self._wanted() else self._next(waiting, budget)
            if job is None:
                break
            width = job.pictures * job.tiles
            if budget < width and not must:
                break  # not one more layer fits: the next step goes on
            must = False
            layers = max(1, min(budget // width, job.layers_left))
            with self.pacer.timed("vision", layers * width) as took:
                job.advance(layers)
                if job.done:
                    self._finish(job, reserve)
            spent += took[0]
            budget -= layers * width
        return spent

    def _wanted(self) -> bool:
        """Whether anyone still waits for the job in progress (cancelled requests drop it)."""
        return any(not r.done for showing in self.showing for r in showing)

    def _next(self, waiting: list[Request], budget: int) -> TowerJob | None:
        """A job for the first waiting picture not ready, grouped with the next ones of its tile count as far as
        one layer of them fits the step's ``budget`` of tile-layers (a layer is the least a step runs)."""
        self.job, self.showing = None, []
        held = sum(1 for r in waiting[: self.depth] if r.vision is not None)
        if held >= self.depth:
            return None  # enough states wait already
        pictures: dict[str, list[Request]] = {}
        for request in waiting[: self.depth]:
            if not request.done and not self.pictures.ready(request):
                pictures.setdefault(request.image_key or f"request-{request.request_id}", []).append(request)
        if not pictures:
            return None
        groups = list(pictures.values())
        tiles = self.worker.tiles_run(groups[0][0].inputs)
        fit = max(1, min(self.depth - held, budget // max(1, tiles)))
        groups = [g for g in groups if self.worker.tiles_run(g[0].inputs) == tiles][:fit]
        ((_, job),) = self.worker.tower_jobs([g[0].inputs for g in groups])
        self.job, self.showing = job, groups
        return job

    def _finish(self, job: TowerJob, reserve: int) -> None:
        """The job's pictures projected and handed to the requests showing them (and to the cache)."""
        for showing, states in zip(self.showing, self.worker.project(job), strict=True):
            self.pictures.encoded(showing, states, reserve)
        self.job, self.showing = None, []
