"""Runs batches on one loaded ``MllamaForConditionalGeneration`` (loading is :mod:`~vlm_demo.engine.weights.loader`'s).

The worker owns the model and processor.
``prepare`` turns one request into tensors on the caller's thread (so a broken image fails alone,
before it can join a batch). Dynamic mode: ``run`` left-pads a batch of prepared requests and calls
``generate`` once, with per-row sampling and per-row streaming/stopping. Continuous mode:
``prefill`` runs newcomers together over their pictures' projected states (asked once of
:mod:`~vlm_demo.engine.executor.picture_states`; :mod:`~vlm_demo.engine.executor.vision` runs the tower on each picture's real
tiles, some layers at a time if the engine wants), ``decode`` one step for
every running row over the page pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteriaList

from vlm_demo.engine.batching.job import Request
from vlm_demo.engine.batching.rows import StepInputs
from vlm_demo.engine.decoding.choice import GenerateChoice
from vlm_demo.engine.decoding.detokenizer import BatchStreamer, RowStreamer
from vlm_demo.engine.decoding.structure import StageGrammar, StageTracker
from vlm_demo.engine.executor.picture_states import PictureStates
from vlm_demo.engine.executor.prefill import Prefill
from vlm_demo.engine.executor.vision import TowerJob, jobs, real_tiles
from vlm_demo.errors import InvalidRequestError
from vlm_demo.prompt import Turn, chat_messages
from vlm_demo.request import ValidParams

# Tensors whose second dimension is the token sequence: these get left padding in a batch.
SEQUENCE_KEYS = ("input_ids", "attention_mask", "cross_attention_mask")


def left_pad(tensors: list[torch.Tensor], value: int | float) -> torch.Tensor:
    """Stack ``[1, L_i, ...]`` tensors into ``[B, max L, ...]``, padding on the left."""
    longest = max(t.shape[1] for t in tensors)
    rows = []
    for t in tensors:
        missing = longest - t.shape[1]
        if missing:
            pad = torch.full((1, missing, *t.shape[2:]), value, dtype=t.dtype)
            t = torch.cat([pad, t], dim=1)
        rows.append(t)
    return torch.cat(rows, dim=0)


def collate(inputs: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Merge single-request processor outputs into one left-padded batch.

    Left padding is what makes batched rows equal their single runs: ``generate`` reads each row's
    last position, which must be a real token, not padding.
    """
    batch: dict[str, torch.Tensor] = {}
    for key in inputs[0]:
        values = [x[key] for x in inputs]
        if key in SEQUENCE_KEYS:
            batch[key] = left_pad(values, pad_id if key == "input_ids" else 0)
        else:
            batch[key] = torch.cat(values, dim=0)
    return batch


def input_device(model: Any) -> torch.device:
    """Where inputs go: the token embedding's device. With a model spread by ``device_map`` the
    first parameter (the vision tower's) may sit on another GPU or be offloaded (``meta``)."""
    device = model.get_input_embeddings().weight.device
    if device.type == "meta":
        return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    return device


class Worker:
    """One model replica; not thread-safe by design (the engine calls it from one thread)."""

    def __init__(self, model: Any, processor: Any, name: str) -> None:
        self.model = model
        self.processor = processor
        self.name = name
        self.tokenizer = processor.tokenizer
        self.device = input_device(model)
        self.dtype = next(model.parameters()).dtype
        self.pad_id = self._pad_id()
        self.eos_ids = self._eos_ids()
        self._grammar: StageGrammar | None = None
        self.vision_encodes = 0  # pictures run through the vision tower (the engine reports it)
        self.vision_tiles_run = 0  # tiles those pictures ran through it (``vlm_vision_tiles_total``)
        self.vision_tiles = "real"  # --vision-tiles: the engine sets it (the tests share one worker)

    @property
    def tower(self) -> Any:
        """The model's vision tower (``MllamaVisionModel``)."""
        return self.model.model.vision_model

    def tiles_run(self, inputs: dict[str, Any]) -> int:
        """Tiles of a request's picture (its processor ``inputs``) the tower runs and the prefill attends to: its real ones (``--vision-tiles
        real``), or all the processor packed (``all``: the stock computation)."""
        if "pixel_values" not in inputs:
            return 0
        if self.vision_tiles == "real":
            return real_tiles(inputs["aspect_ratio_mask"])[0]
        return int(inputs["pixel_values"].shape[2])

    @contextmanager
    def tiles_as(self, mode: str) -> Iterator[None]:
        """Run the tower on ``mode``'s tiles for a while (``all``: to compare with the stock forward, which
        runs every tile the processor packed), then back to the engine's choice."""
        kept, self.vision_tiles = self.vision_tiles, mode
        try:
            yield
        finally:
            self.vision_tiles = kept

    def _pad_id(self) -> int:
        tok = self.tokenizer
        if tok.pad_token_id is not None:
            return int(tok.pad_token_id)
        pad = self.model.generation_config.pad_token_id
        if isinstance(pad, int):
            return pad
        return int(tok.convert_tokens_to_ids("<|finetune_right_pad_id|>"))

    def _eos_ids(self) -> list[int]:
        ids = self.model.generation_config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        for token in ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"):
            tid = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid >= 0 and tid != self.tokenizer.unk_token_id and tid not in ids:
                ids.append(tid)
        return ids

    @property
    def grammar(self) -> StageGrammar:
        """The stage grammar's view of this tokenizer (every token's text: built once, on first use)."""
        if self._grammar is None:
            self._grammar = StageGrammar(self.tokenizer, self.eos_ids)
        return self._grammar

    def tracker(self, params: ValidParams, structured: bool) -> StageTracker | None:
        """A whole answer's stage tracker, unless structure is off (or a benchmark forces lengths)."""
        return self.grammar.answer(params.max_new_tokens) if structured and not params.ignore_eos else None

    def prompt(self, question: str, history: Sequence[Turn] = ()) -> str:
        """The chat-templated prompt text, as the model was trained: the image placeholder in the first user
        turn, then each earlier question and answer (a follow-up), then the question."""
        return self.processor.apply_chat_template(chat_messages(question, history), add_generation_prompt=True)

    def prepare(self, image: Any, question: str, history: Sequence[Turn] = ()) -> dict[str, torch.Tensor]:
        """Tokenise and preprocess one request; raise ``InvalidRequestError`` if the image is unusable."""
        text = self.prompt(question, history)
        try:
            # The template already starts with <|begin_of_text|>: no second BOS.
            return dict(self.processor(images=image, text=text, add_special_tokens=False, return_tensors="pt"))
        except Exception as exc:  # the processor raises many types for odd images
            raise InvalidRequestError(f"Could not process the image: {exc}") from exc

    def prepare_with(self, image_inputs: dict[str, torch.Tensor], question: str) -> dict[str, torch.Tensor]:
        """Another question about an already prepared image (a stage-beam judge prompt), without
        resizing and tiling the image again: the pixel tensors are shared, the text is tokenised, and
        the cross-attention mask is rebuilt the processor's way (every token from the image's
        placeholder on sees the image's tiles). Equal to ``prepare`` on the same image (tested)."""
        ids = self.tokenizer(self.prompt(question), add_special_tokens=False, return_tensors="pt")["input_ids"]
        image_id = self.model.config.image_token_index
        where = (ids[0] == image_id).nonzero()
        tiles = image_inputs["cross_attention_mask"][:, -1:]  # [1, 1, images, tiles]: which tiles are real
        cross = torch.zeros((1, ids.shape[1], *tiles.shape[2:]), dtype=tiles.dtype)
        if len(where):
            cross[:, int(where[0]) :] = tiles
        inputs = {k: v for k, v in image_inputs.items() if k not in SEQUENCE_KEYS}
        return {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids), "cross_attention_mask": cross}

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for key, value in batch.items():
            value = value.to(self.device)
            out[key] = value.to(self.dtype) if value.is_floating_point() else value
        return out

    def generation_config(self, max_new_tokens: int) -> GenerationConfig:
        """Greedy at the ``generate`` level; sampling and stopping are decided per row by us.

        Unset fields would be filled from the checkpoint's generation_config.json, so every field
        that changes logits or stops rows is set to a neutral value here, end-of-turn included.
        """
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            temperature=1.0,
            top_p=1.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            num_beams=1,
            pad_token_id=self.pad_id,
            eos_token_id=[],
            bos_token_id=self.model.generation_config.bos_token_id,
        )

    @property
    def cross_attention_layers(self) -> frozenset[int]:
        return frozenset(self.model.config.get_text_config().cross_attention_layers)

    @torch.inference_mode()
    def prefill(self, requests: list[Request], pictures: PictureStates | None = None, reserve: int = 0) -> Prefill:
        """Continuous mode: run newcomers' prompts together, left-padded like a dynamic batch (positions
        counted from each row's first real token, as ``generate`` does), over their pictures' real tiles only;
        return their cache, last logits and which tiles each row sees, ready to be written into pages. Their
        pictures run the same number of tiles (``tiles_run``): the text before a picture's placeholder attends
        to every tile of the cross-attention states, padding ones too, so rows of other tile counts would change
        each other's answers. The pictures' states come from ``pictures``, asked once
        (:meth:`~vlm_demo.engine.executor.picture_states.PictureStates.for_rows`: the request's own, the image-state
        cache's, or the tower's; without one, the tower's)."""
        batch = collate([r.prefill_inputs() for r in requests], self.pad_id)
        pictures = pictures if pictures is not None else PictureStates(self.encode_pictures)
        states = pictures.for_rows(requests, reserve)
        tiles = states[0].shape[0]
        assert all(s.shape[0] == tiles for s in states), "a prefill's pictures must run the same number of tiles"
        cross = torch.stack(states)
        for key in ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"):
            batch.pop(key, None)
        batch["cross_attention_mask"] = batch["cross_attention_mask"][..., :tiles]  # the tiles the tower ran
        seen = batch["cross_attention_mask"][:, -1].reshape(len(requests), -1) > 0  # host side: what decoding sees
        inputs = self.to_device(batch)
        inputs["cross_attention_states"] = cross.reshape(len(requests), -1, cross.shape[-1])
        lengths = [r.input_tokens for r in requests]
        mask = inputs["attention_mask"].bool()
        if len(set(lengths)) == 1:  # no padding: what generate passes then (no mask, default positions)
            inputs["attention_mask"] = None  # type: ignore[assignment]  # what generate takes for no mask
        else:
            inputs["position_ids"] = (inputs["attention_mask"].long().cumsum(-1) - 1).masked_fill(~mask, 0)
        out = self.model(**inputs, use_cache=True, logits_to_keep=1)
        digests = [r.image_key for r in requests]
        return Prefill(out.cache, out.logits[:, -1].float(), mask, lengths, seen, [s.shape[0] for s in states], digests)

    def tower_jobs(self, inputs: list[dict[str, torch.Tensor]]) -> list[tuple[list[int], TowerJob]]:
        """Tower jobs for pictures (processor outputs), grouped by the tiles they run (``--vision-tiles``)."""
        return jobs(self.tower, inputs, self.vision_tiles)

    @torch.inference_mode()
    def project(self, job: TowerJob) -> list[torch.Tensor]:
        """A finished job's pictures through the projector, each ``[tiles run, patches, hidden]`` (what every
        cross-attention layer turns into its keys and values)."""
        self.vision_encodes += job.pictures
        self.vision_tiles_run += job.pictures * job.tiles
        return list(self.model.model.multi_modal_projector(job.states()))

    @torch.inference_mode()
    def encode_pictures(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Pictures (processor outputs) through the whole tower at once: each ``[tiles run, patches, hidden]``."""
        out: list[torch.Tensor | None] = [None] * len(inputs)
        for members, job in self.tower_jobs(inputs):
            job.run()
            for index, states in zip(members, self.project(job), strict=True):
                out[index] = states
        return out  # type: ignore[return-value]

    def synchronize(self) -> None:
        """Wait for the device's queued work (timing what a step spent)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def decode(self, step: Callable[[StepInputs], torch.Tensor], inputs: StepInputs) -> torch.Tensor:
        """Continuous mode: one decode step for every running row over the page pool; ``[rows, vocab]`` logits."""
        return step(inputs)

    @torch.inference_mode()
    def run(self, batch: list[Request], structured: bool = True, on_step: Callable[[], bool] | None = None) -> None:
        """Generate for every request in ``batch``; each row streams and finishes on its own (and follows the
        stage grammar when ``structured``). ``on_step`` is called after each step; True stops them all."""
        now = time.monotonic()
        for request in batch:
            request.started = request.started or now
            request.batch_size = max(request.batch_size, len(batch))
            request.reset_progress()
        inputs = self.to_device(collate([r.inputs for r in batch], self.pad_id))
        rows = [
            RowStreamer(self.tokenizer, r, self.eos_ids, structure=self.tracker(r.params, structured)) for r in batch
        ]
        choice = GenerateChoice([r.params for r in batch])
        streamer = BatchStreamer(rows, choice, on_step)
        self.vision_encodes += len(batch)  # generate runs the stock tower: every tile the processor packed
        self.vision_tiles_run += sum(int(r.inputs["pixel_values"].shape[2]) for r in batch)
        self.model.generate(
            **inputs,
            generation_config=self.generation_config(max(r.params.max_new_tokens for r in batch)),
            logits_processor=choice.processors,
            stopping_criteria=StoppingCriteriaList([streamer]),
        )
        streamer.finish_all()
