"""The vision tower over each picture's tiles, some layers at a time.

transformers' processor packs every picture to ``max_image_tiles`` (four 560-px tiles at 11B) and the stock
forward runs the whole tower, and projects, all four; the text then masks the padding tiles out for the
tokens after the picture's placeholder. Dropping the padding tiles is **not exact**, for two reasons found
in the model's own code: inside the tower, Mllama's aspect-ratio mask blocks only padding-to-padding
attention, so a real tile's tokens attend to the padding tiles (Meta's reference encoder has the same mask,
so the checkpoint was trained that way); and the text tokens before the placeholder see no tile, which in
transformers' cross-attention means they attend to every tile of the states, padding ones included.

``--vision-tiles real`` (the default) runs each picture as if the model's tile limit were its own tile
count: the tower, the projector, the prefill's cross-attention keys and values and the image-state cache
all take its real tiles only (a one-tile picture costs a quarter of a four-tile one). A four-tile picture
is bit-identical to the stock forward; 1-3-tile pictures get different states (by 0.3-0.7 % of their norm on
the random real-shape model, 7-36 % on the tiny trained one, whose greedy answers stay the same; nothing can
say here what it does to the real checkpoint's answers: see docs/architecture.md). ``--vision-tiles all`` is the stock computation on every tile, split at its layers
(tested bit-exact). Dynamic batching (``generate``) always runs the stock forward.

A :class:`TowerJob` is a group of pictures of one tile count (one ``[pictures, tiles × patches, width]``
batch: no picture ever sees another's padding) moving through the tower's local and global layers; the
engine runs a few layers a step (``advance``) so that newcomers' pictures do not stall the running rows, or
all of them at once (``run``). Each layer is the stock module (``MllamaVisionEncoderLayer``) with the stock
mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.mllama.modeling_mllama import _prepare_aspect_ratio_attention_mask

MODES = ("real", "all")


def real_tiles(aspect_ratio_mask: torch.Tensor) -> list[int]:
    """Each picture's real tiles, from the processor's ``[pictures, tiles]`` mask (real tiles come first)."""
    return [max(1, int(n)) for n in aspect_ratio_mask.reshape(aspect_ratio_mask.shape[0], -1).sum(-1).tolist()]


@dataclass(eq=False)
class TowerJob:
    """Pictures of one tile count on their way through the tower (the engine thread's)."""

    tower: Any  # MllamaVisionModel
    hidden: torch.Tensor  # [pictures, tiles × padded patches, width]
    mask: torch.Tensor  # the stock additive mask for those tiles
    aspect_ratio_ids: torch.Tensor  # [pictures]
    tiles: int  # tiles each picture runs (its real ones, or all with ``--vision-tiles all``)
    real: list[int]  # each picture's real tiles (what is projected and kept)
    layer: int = 0  # layers done, local then global
    kept: list[torch.Tensor] = field(default_factory=list)  # the local layers' outputs the model concatenates

    @property
    def pictures(self) -> int:
        return self.hidden.shape[0]

    @property
    def layers(self) -> int:
        return len(self.tower.transformer.layers) + len(self.tower.global_transformer.layers)

    @property
    def layers_left(self) -> int:
        return self.layers - self.layer

    @property
    def done(self) -> bool:
        return self.layer >= self.layers

    @property
    def tile_layers_left(self) -> int:
        """The work left, in tiles × layers (what the engine paces)."""
        return self.layers_left * self.pictures * self.tiles

    @torch.inference_mode()
    def advance(self, layers: int) -> None:
        """Run up to ``layers`` more layers."""
        tower, local = self.tower, len(self.tower.transformer.layers)
        for _ in range(min(layers, self.layers_left)):
            if self.layer < local:
                self.hidden = tower.transformer.layers[self.layer](hidden_states=self.hidden, attention_mask=self.mask)
                if self.layer in tower.intermediate_layers_indices:
                    self.kept.append(self.hidden)
                if self.layer + 1 == local:
                    self._between()
            else:
                layer = tower.global_transformer.layers[self.layer - local]
                self.hidden = layer(hidden_states=self.hidden, attention_mask=self.mask)
            self.layer += 1

    def run(self) -> None:
        self.advance(self.layers_left)

    def _between(self) -> None:
        """After the local layers: the post-norm and the post-tile embedding, as the stock forward does."""
        tower = self.tower
        width = self.hidden.shape[-1]
        hidden = tower.layernorm_post(self.hidden).reshape(self.pictures, self.tiles, -1, width)
        hidden = hidden + _tile_embedding(tower.post_tile_positional_embedding, self.aspect_ratio_ids, self.tiles)
        self.hidden = hidden.reshape(self.pictures, -1, width)

    def states(self) -> torch.Tensor:
        """``[pictures, tiles, patches, width × (1 + intermediate layers)]``: what the stock tower returns."""
        assert self.done, "the tower has layers left"
        patches = self.tower.num_patches
        indices = self.tower.intermediate_layers_indices
        kept = [self.kept[sorted(set(indices)).index(i)] for i in indices]
        parts = [self.hidden, *kept]
        shaped = [p.reshape(self.pictures, self.tiles, -1, p.shape[-1])[:, :, :patches] for p in parts]
        return torch.cat([shaped[0], torch.stack(shaped[1:], dim=-1).flatten(-2)], dim=-1)


@torch.inference_mode()
def start(
    tower: Any, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor, aspect_ratio_mask: torch.Tensor, tiles: int
) -> TowerJob:
    """A job for pictures of ``[pictures, max tiles, channels, h, w]`` pixels running their first ``tiles``
    tiles (the embeddings done; no layer yet). With ``tiles`` = the max, the mask is the processor's (the stock
    computation); fewer, and every tile run is real."""
    pictures, width = pixel_values.shape[0], tower.hidden_size
    weight = tower.patch_embedding.weight
    pixels = pixel_values[:, :tiles].reshape(pictures * tiles, *pixel_values.shape[2:]).to(weight.device, weight.dtype)
    hidden = tower.patch_embedding(pixels).flatten(2).transpose(1, 2)
    hidden = hidden.reshape(pictures, tiles, -1, width)
    hidden = hidden + _tile_embedding(tower.pre_tile_positional_embedding, aspect_ratio_ids, tiles)
    hidden = tower.apply_class_embedding(hidden.reshape(pictures * tiles, -1, width))
    patches = hidden.shape[1]
    hidden = hidden.reshape(pictures, tiles, patches, width)
    position = tower.gated_positional_embedding
    gate = position.gate.tanh()
    hidden = hidden + ((1 - gate) * position.embedding).view(1, 1, patches, width)
    tile_position = position.tile_embedding(aspect_ratio_ids).reshape(pictures, -1, patches, width)[:, :tiles]
    hidden = tower.layernorm_pre(hidden + gate * tile_position)
    hidden = F.pad(hidden, (0, 0, 0, (8 - patches % 8) % 8))
    mask = aspect_ratio_mask[:, :tiles].to(hidden.device) if tiles == pixel_values.shape[1] else None
    if mask is None:
        mask = torch.ones(pictures, tiles, dtype=torch.long, device=hidden.device)
    mask = _prepare_aspect_ratio_attention_mask(mask, tower.num_patches, hidden.shape[2], hidden.dtype)
    real = real_tiles(aspect_ratio_mask)
    return TowerJob(tower, hidden.reshape(pictures, -1, width), mask, aspect_ratio_ids, tiles, real)


def _tile_embedding(module: Any, aspect_ratio_ids: torch.Tensor, tiles: int) -> torch.Tensor:
    """A gated per-tile embedding (``MllamaPrecomputedAspectRatioEmbedding``) for the first ``tiles`` tiles."""
    embedding = module.embedding(aspect_ratio_ids).reshape(aspect_ratio_ids.shape[0], -1, 1, module.hidden_size)
    embedding = embedding[:, :tiles]
    return embedding * module.gate.tanh() if module.is_gated else embedding


def jobs(tower: Any, inputs: list[dict[str, torch.Tensor]], mode: str) -> list[tuple[list[int], TowerJob]]:
    """The tower jobs for some pictures (each ``inputs`` a processor output of one picture): pictures grouped
    by the tiles they run (their real tiles, or all), each job with the indices of its pictures."""
    groups: dict[int, list[int]] = {}
    for index, one in enumerate(inputs):
        tiles = real_tiles(one["aspect_ratio_mask"])[0] if mode == "real" else one["pixel_values"].shape[2]
        groups.setdefault(tiles, []).append(index)
    made = []
    for tiles, members in sorted(groups.items(), reverse=True):
        pixel_values = torch.cat([inputs[i]["pixel_values"][:, 0] for i in members])
        ids = torch.cat([inputs[i]["aspect_ratio_ids"][:, 0] for i in members]).to(tower.patch_embedding.weight.device)
        masks = torch.cat([inputs[i]["aspect_ratio_mask"][:, 0] for i in members])
        made.append((members, start(tower, pixel_values, ids, masks, tiles)))
    return made
