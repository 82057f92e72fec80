"""Building the tiny model: its tokenizer, processor and config, the trained model saved, the copy every
process uses (shipped, or built once into a cache, behind a lock), and the command line that builds it."""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from vlm_demo.models.tiny.contract import (
    BOS,
    CHAT_TEMPLATE,
    EOM,
    EOS_TEXT,
    EOT,
    IMAGE_TOKEN,
    LLAMA3_SPLIT,
    PAD,
    SPECIAL_TOKENS,
)
from vlm_demo.models.tiny.data import TRAIN_STEPS, _tokenizer_corpus
from vlm_demo.models.tiny.train import _deterministic_torch, train

if TYPE_CHECKING:
    from transformers import MllamaConfig, MllamaProcessor, PreTrainedTokenizerFast

log = logging.getLogger(__package__)

TINY_VERSION = "6"  # bump when the recipe changes: cached copies with another stamp are rebuilt
VERSION_FILE = "tiny_version.txt"
# The built model, committed (1.4 MB), so a fresh clone serves at once instead of training for minutes. A test
# rebuilds it from this package and checks every file but the weights is bit-identical, the weights have the same
# tensors and the rebuilt model answers alike; after changing the recipe, bump TINY_VERSION and rebuild it:
# ``python -m vlm_demo.models.tiny vlm_demo/models/tiny_model``.
SHIPPED_DIR = Path(__file__).resolve().parent.with_name("tiny_model")

TILE_SIZE = 16  # vision image_size = the processor's tile size; 16 px (not 28) keeps 4-px patches cheap
MAX_TILES = 4
BPE_VOCAB_SIZE = 1000
CROSS_LAYERS = [2]  # the text layers that attend to the image (of 4)
BUILD_THREADS = 1  # fixed for reproducible sums; 2 threads ran 13x slower when another process shared the 2 cores


def build_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    """Byte-level BPE with Llama-3 specials; ``<|image|>`` is added last so its id equals the text vocab size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_tokenizer_corpus(seed), trainer)
    bpe.add_special_tokens(SPECIAL_TOKENS)
    bpe.add_special_tokens([IMAGE_TOKEN])
    bos_id = bpe.token_to_id(BOS)
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        padding_side="left",  # what batched generation needs; training asks for right padding explicitly
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def build_processor(seed: int = 0) -> MllamaProcessor:
    """Tokenizer + image processor with tiles of the vision ``image_size``."""
    from transformers import MllamaProcessor
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    # The PIL backend explicitly: it works without torchvision, and the saved processor stays the one trained on.
    image_processor = MllamaImageProcessorPil(size={"height": TILE_SIZE, "width": TILE_SIZE}, max_image_tiles=MAX_TILES)
    return MllamaProcessor(
        image_processor=image_processor, tokenizer=build_tokenizer(seed), chat_template=CHAT_TEMPLATE
    )


def build_config(text_vocab_size: int, tokenizer: PreTrainedTokenizerFast) -> MllamaConfig:
    """~331k parameters; the one cross-attention layer (2) lies inside the 4 text layers, else images are ignored."""
    from transformers import MllamaConfig

    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_global_layers=1,
        attention_heads=2,
        image_size=TILE_SIZE,
        patch_size=4,  # 4x4 patches per tile: the one row of colour a 1024x16 strip keeps is 1/4 of a patch
        max_num_tiles=MAX_TILES,
        intermediate_layers_indices=[0],
        vision_output_dim=64,  # hidden_size * (1 + len(intermediate_layers_indices))
        initializer_range=0.02,
    )

    def ids(token: str) -> int:
        found = tokenizer.convert_tokens_to_ids(token)  # one token: one id
        assert isinstance(found, int), token
        return found

    text = dict(
        vocab_size=text_vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        cross_attention_layers=CROSS_LAYERS,
        max_position_embeddings=4096,
        # Llama's theta of 500000 leaves a 16-dim head only ~3 useful frequencies over 300 tokens; counting needs more.
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=ids(BOS),
        eos_token_id=[ids(EOT), ids(EOM), ids(EOS_TEXT)],
        pad_token_id=ids(PAD),
        initializer_range=0.02,
    )
    config = MllamaConfig(vision_config=vision, text_config=text, image_token_index=ids(IMAGE_TOKEN))
    text_config = config.get_text_config()
    assert all(0 <= i < text_config.num_hidden_layers for i in text_config.cross_attention_layers)
    return config


def _open_tanh_gates(model: torch.nn.Module) -> None:
    """Set the tanh gates to 1 so the image reaches the text from step one (they start at 0).

    Only these names: a plain ``"gate" in name`` also hits every MLP ``gate_proj``.
    """
    names = ("cross_attn_attn_gate", "cross_attn_mlp_gate", "gate_attn", "gate_ffn")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.rsplit(".", 1)[-1] in names:
                param.fill_(1.0)


def build_tiny(out_dir: str | os.PathLike, seed: int = 0, *, steps: int = TRAIN_STEPS) -> str:
    """Build, train and save the tiny model + processor into ``out_dir``; returns the path.

    ``steps`` exists so tests can check determinism cheaply; the default is the trained recipe.
    """
    from transformers import GenerationConfig, MllamaForConditionalGeneration

    out = Path(out_dir)
    with _deterministic_torch(BUILD_THREADS):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        processor = build_processor(seed)
        tokenizer = processor.tokenizer
        image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        config = build_config(text_vocab_size=image_id, tokenizer=tokenizer)
        model = MllamaForConditionalGeneration(config)
        _open_tanh_gates(model)
        log.info("tiny model: %d parameters, text vocab %d", sum(p.numel() for p in model.parameters()), image_id)
        train(model, processor, seed, steps)
    ids = tokenizer.convert_tokens_to_ids
    model.generation_config = GenerationConfig(
        bos_token_id=ids(BOS), eos_token_id=[ids(EOT), ids(EOM), ids(EOS_TEXT)], pad_token_id=ids(PAD)
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return str(out)


def default_tiny_dir() -> Path:
    """The copy shipped with the package (:data:`SHIPPED_DIR`) when it was built by this recipe
    (``TINY_VERSION``); else ``~/.cache/vlm_demo/tiny``, where it is built on first use."""
    if _is_current(SHIPPED_DIR):
        return SHIPPED_DIR
    return Path.home() / ".cache" / "vlm_demo" / "tiny"


def _is_current(path: Path) -> bool:
    stamp = path / VERSION_FILE
    return stamp.is_file() and stamp.read_text().strip() == TINY_VERSION and (path / "config.json").is_file()


def ensure_tiny(path: str | None = None) -> str:
    """Folder of a built tiny model of the current ``TINY_VERSION``, building it first if needed: ``path``
    (``Config.tiny_dir``: ``--tiny-dir`` / ``VLM_TINY_DIR``) if given, else :func:`default_tiny_dir`.

    A file lock makes concurrent processes (pytest and a server it starts) build once; the build goes
    to a temporary folder next to the target and is renamed into place, so readers never see half a model.
    """
    target = Path(path).expanduser() if path else default_tiny_dir()
    if _is_current(target):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_current(target):
            return str(target)
        log.info("building the tiny model into %s", target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
        try:
            build_tiny(tmp)
            (tmp / VERSION_FILE).write_text(TINY_VERSION + "\n")
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by every process of this user
            if target.exists():  # a stale recipe: move it aside, since os.replace cannot overwrite a folder
                stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
                os.replace(target, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vlm_demo.models.tiny", description="Build and train the tiny offline Mllama test model."
    )
    parser.add_argument("out_dir", help="Folder to save the model and processor into.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    path = build_tiny(args.out_dir, seed=args.seed)
    (Path(path) / VERSION_FILE).write_text(TINY_VERSION + "\n")
    print(f"saved tiny model to {path} in {time.perf_counter() - start:.1f} s")
