"""The page table: which pages of the pool each row's cache holds, and the one place pages are taken,
shared and given back for rows (nano-vllm's block manager).

A row's :class:`Placement` lists its text pages (the last one may be partly filled) and its image pages.
Newcomers get fresh pages (``allocate``), a row opening a page gets one more (``grow``), a Think-harder
candidate shares its start's full pages and copies at most one partly filled page (``fork``), a row's cache
can be kept aside without a copy (``snapshot``), and a row that leaves gives its pages back (``release``).
It also answers the plan's questions: what a newcomer needs, which rows open a page at the next step,
what a row would give back, and how many free pages the image-state cache must leave to the newcomers.
The pool (:mod:`~vlm_demo.engine.kv.pages`) holds the bytes and the reference counts; the image-state cache
(:mod:`~vlm_demo.engine.kv.image_cache`) takes free pages of its own, never one the table reserves.

**One copy per picture.** A row's cross-attention keys/values depend on its picture's states and the model's
weights alone, never on its text: rows showing the same picture (its digest, the tiles the tower ran and the tiles
the row sees: a :data:`PictureKey`) hold the same values. The table keeps the image pages of every picture rows
hold; a newcomer whose picture is held points its image pages at them (one more owner each: no pages taken, no
states written), so eight visitors asking about one example picture hold it once. The entry goes when the last
row (or snapshot) holding those pages lets go of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlm_demo.engine.batching.job import Request
from vlm_demo.engine.kv.pages import PagePool

# A picture's cross-attention states as rows hold them: its digest, the tiles the tower ran, the tiles the row sees.
PictureKey = tuple[str, int, tuple[int, ...]]


@dataclass(eq=False)
class Placement:
    """Where one row's cache is: its pages (the last one may be partly filled) and its image pages."""

    pages: list[int]
    length: int  # tokens in its text pages (= the position of its next input)
    image_pages: list[int]
    tiles: int  # tiles whose image states it holds
    sees_image: bool  # False: no tile is visible (the model then attends evenly to all, and skips the MLP)
    picture: PictureKey | None = None  # whose states its image pages hold (None: a picture nobody shares)
    shared_picture: bool = False  # its image pages were another row's when it was placed (nothing to write)

    @property
    def all_pages(self) -> list[int]:
        return self.pages + self.image_pages


@dataclass(eq=False)
class Snapshot:
    """A row's cache kept aside (a Think-harder search's start or a stage's winner): shared pages, no copy.

    The holder must ``release`` it. ``logits`` (after a prefill) or ``next_token`` (after a step) is what
    its forks continue from."""

    place: Placement
    table: PageTable
    logits: torch.Tensor | None = None  # [1, vocab]
    next_token: torch.Tensor | None = None  # [1]
    released: bool = False

    @property
    def length(self) -> int:
        return self.place.length

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.table.release(self.place)


class PageTable:
    """Rows' pages over one pool; the engine thread's alone."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.shape = pool.shape
        self.copied_bytes = 0  # keys/values copied into a fork's own last page
        self.pictures: dict[PictureKey, list[int]] = {}  # the image pages of each picture rows hold
        self.image_held: set[int] = set()  # every image page rows or snapshots hold (each shared page once)
        self.pictures_shared = 0  # newcomers placed on a picture another row already held

    # ---- what the plan asks ------------------------------------------------------------------------
    def newcomer_pages(self, request: Request) -> int:
        """Pages a newcomer takes: its prompt, its first answer token and its picture's tiles, unless rows hold its
        picture already (then only its text pages)."""
        text = self.shape.text_pages(request.input_tokens + 1)
        if self.holds_picture(request.image_key, request.tiles):
            return text
        return text + self.shape.image_pages(request.tiles * self.shape.patches)

    def holds_picture(self, digest: str, tiles: int) -> bool:
        """Whether rows hold the states of this picture for rows seeing ``tiles`` tiles (what admission plans by)."""
        return bool(digest) and any(key[0] == digest and len(key[2]) == tiles for key in self.pictures)

    @property
    def picture_bytes(self) -> int:
        """Bytes of the pages that hold pictures' cross-attention states (a shared page counted once)."""
        return len(self.image_held) * self.shape.page_bytes

    def opens_page(self, place: Placement) -> bool:
        """Whether this row's next token starts a page (its pages are full)."""
        return place.length == self.shape.page_tokens * len(place.pages)

    def growth(self, places: Sequence[Placement | None]) -> int:
        """Pages the next step takes: one for each row whose new token opens a page."""
        return sum(1 for place in places if place is not None and self.opens_page(place))

    def owned(self, place: Placement | None) -> int:
        """Pages this row alone holds: what it would give back if it left."""
        return sum(self.pool.owners(p) == 1 for p in place.all_pages) if place is not None else 0

    def cache_reserve(self, newcomers: Sequence[Request], running: int) -> int:
        """Free pages the image-state cache must leave while ``newcomers`` are prefilled beside ``running`` rows:
        the newcomers' pages (a picture several of them show, once) and one more for every row of the next step."""
        pages, seen = 0, set()
        for request in newcomers:
            key = (request.image_key, request.tiles)
            pages += self.newcomer_pages(request)
            if request.image_key and key in seen and not self.holds_picture(*key):
                pages -= self.shape.image_pages(request.tiles * self.shape.patches)
            seen.add(key)
        return pages + running + len(newcomers)

    # ---- taking, sharing, giving back ----------------------------------------------------------------
    def allocate(self, lengths: Sequence[int], tiles: Sequence[int], sees: Sequence[bool],
                 pictures: Sequence[PictureKey | None] | None = None) -> list[Placement] | None:  # fmt: skip
        """Pages for new rows of ``lengths`` tokens holding ``tiles`` tiles each (``None``, nothing taken, when too
        few are free): fresh text pages, and fresh image pages unless the row's picture (``pictures``) is held
        already, by running rows or by an earlier row of the same call (then its pages are shared)."""
        s = self.shape
        keys = list(pictures) if pictures is not None else [None] * len(lengths)
        need, fresh = 0, set()
        for length, n, key in zip(lengths, tiles, keys, strict=True):
            need += s.text_pages(length)
            if key is None or (key not in self.pictures and key not in fresh):
                need += s.image_pages(n * s.patches)
                if key is not None:
                    fresh.add(key)
        if need > self.pool.free_pages:
            return None
        places = []
        for length, n, seen, key in zip(lengths, tiles, sees, keys, strict=True):
            text = self.pool.take(s.text_pages(length)) or []
            held = self.pictures.get(key) if key is not None else None
            if held is not None:
                self.pool.share(held)
                self.pictures_shared += 1
                places.append(Placement(text, length, list(held), n, seen, key, shared_picture=True))
                continue
            image = self.pool.take(s.image_pages(n * s.patches)) or []
            self.image_held.update(image)
            if key is not None and image:
                self.pictures[key] = image
            places.append(Placement(text, length, image, n, seen, key))
        return places

    def grow(self, places: Sequence[Placement]) -> None:
        """A page for each row whose next token opens one (the plan made sure enough are free)."""
        for place in places:
            if self.opens_page(place):
                taken = self.pool.take(1)
                if taken is None:
                    raise RuntimeError("no free page for the next token (the plan should have made room)")
                place.pages += taken

    def fork(self, snapshot: Snapshot, count: int) -> list[Placement] | None:
        """``count`` rows continuing from a snapshot: its full pages and image pages shared, its partly filled
        last page copied into a page of each row's own (``None`` when the pool lacks those pages)."""
        base = snapshot.place
        partial = base.length % self.shape.page_tokens
        if partial and count > self.pool.free_pages:
            return None
        places = []
        for _ in range(count):
            pages = base.pages[:-1] if partial else list(base.pages)
            self.pool.share(pages + base.image_pages)
            if partial:
                own = self.pool.take(1)
                assert own is not None
                self.pool.copy_page(base.pages[-1], own[0], partial, text=True)
                self.copied_bytes += partial * self.shape.text_bytes_per_token
                pages = pages + own
            places.append(Placement(pages, base.length, list(base.image_pages), base.tiles, base.sees_image,
                                    base.picture))  # fmt: skip
        return places

    def snapshot(self, place: Placement, length: int, next_token: torch.Tensor) -> Snapshot:
        """The first ``length`` tokens of a row's cache kept aside: its pages shared, nothing copied."""
        pages = place.pages[: -(-length // self.shape.page_tokens)]
        kept = Placement(list(pages), length, list(place.image_pages), place.tiles, place.sees_image, place.picture)
        self.pool.share(kept.all_pages)
        return Snapshot(kept, self, next_token=next_token)

    def keep_aside(self, place: Placement, logits: torch.Tensor | None) -> Snapshot:
        """A placement nobody runs yet (a search's prompt) as a snapshot: the pages are handed over, not shared."""
        return Snapshot(place, self, logits=logits)

    def release(self, place: Placement) -> None:
        """One owner less for each of the row's pages (pages nobody owns go back to the free list, and a picture
        whose pages nobody holds is forgotten)."""
        self.pool.release(place.all_pages)
        gone = [p for p in place.image_pages if self.pool.owners(p) == 0]
        self.image_held.difference_update(gone)
        if gone and place.picture is not None and self.pictures.get(place.picture) == place.image_pages:
            del self.pictures[place.picture]

    def inert(self, count: int) -> list[Placement]:
        """Rows that pad a step to its CUDA graph's size: they write into the pool's null pages and read only those."""
        null = self.pool.null_pages()
        return [Placement(null[:1], 0, null[1:], 1, False) for _ in range(count)]
