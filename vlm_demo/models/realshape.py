"""A random-weight Mllama with Llama-3.2-11B-Vision's real structure, built offline in seconds.

The tiny model (16-px tiles, a 1k vocabulary) never exercises the real model's shapes, and shape bugs
(masks, padding, cross-attention, the 128k vocabulary) hide there. This module builds the real
structure without a download:

- :func:`full_config` is Llama-3.2-11B-Vision's architecture (40 text layers, 8 of them
  cross-attention, 32/8 GQA heads, llama3 rope scaling; a 32+8-layer vision tower on 560-px tiles).
  ``python -m vlm_demo.tools.gpucheck`` builds it on a GPU with random bf16 weights.
- :func:`narrow_config` keeps that structure (vocabulary 128256, the real special-token ids,
  560-px tiles up to 4, the 32/8 head ratio, llama3 rope, cross-attention layers) at narrow widths
  and 5 layers: the CI model (fp32 on CPU, seconds to build).
- :func:`synthetic_tokenizer` has the real vocabulary size with the Llama-3 special tokens at their
  real ids (128000-128255) and ``<|image|>`` = 128256. Its ordinary tokens are byte pairs and
  triples, so random ids decode to arbitrary bytes (incomplete UTF-8 included), not to words.

Weights are random with every tanh gate opened (they start at zero; closed gates make the text
ignore the image and hide every cross-attention bug).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from transformers import GenerationConfig, MllamaConfig, MllamaForConditionalGeneration, MllamaProcessor

from vlm_demo.models.tiny import CHAT_TEMPLATE, LLAMA3_SPLIT

TEXT_VOCAB = 128256
IMAGE_TOKEN_ID = 128256  # = the text vocabulary size, as in the real checkpoint
BOS_ID, END_OF_TEXT_ID, PAD_ID, EOM_ID, EOT_ID = 128000, 128001, 128004, 128008, 128009
EOS_IDS = [END_OF_TEXT_ID, EOM_ID, EOT_ID]

# Llama-3's 256 special tokens in id order (128000..128255).
SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    *[f"<|reserved_special_token_{i}|>" for i in range(3, 248)],
]

# Llama-3.2-11B-Vision's preprocessor_config.json.
REAL_PREPROCESSOR: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_pad": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "max_image_tiles": 4,
    "resample": 2,
    "rescale_factor": 1 / 255,
    "size": {"height": 560, "width": 560},
}

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

_TEXT_COMMON: dict[str, Any] = {
    "vocab_size": TEXT_VOCAB,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_parameters": LLAMA3_ROPE,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_IDS,
    "pad_token_id": PAD_ID,
    "tie_word_embeddings": False,
}


def full_config() -> MllamaConfig:
    """Llama-3.2-11B-Vision (and so Llama-3.2V-11B-cot): the architecture, not the weights."""
    vision = {
        "hidden_size": 1280,
        "attention_heads": 16,
        "intermediate_size": 5120,
        "num_hidden_layers": 32,
        "num_global_layers": 8,
        "intermediate_layers_indices": [3, 7, 15, 23, 30],
        "vision_output_dim": 7680,
        "image_size": 560,
        "patch_size": 14,
        "max_num_tiles": 4,
        "norm_eps": 1e-5,
    }
    text = {
        **_TEXT_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 40,
        "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38],
    }
    return MllamaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID)


def narrow_config(hidden: int = 256, layers: int = 5, cross_layers: tuple[int, ...] = (1, 3)) -> MllamaConfig:
    """The real structure at narrow widths: CI-sized (about 70 M parameters, almost all in the
    128k-row embedding and output matrices). Large initial weights keep greedy choices decisive."""
    vision = {
        "hidden_size": 32,
        "attention_heads": 2,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_global_layers": 1,
        "intermediate_layers_indices": [0],
        "vision_output_dim": 64,  # hidden * (1 + len(intermediate_layers_indices))
        "image_size": 560,
        "patch_size": 14,
        "max_num_tiles": 4,
        "norm_eps": 1e-5,
    }
    text = {
        **_TEXT_COMMON,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": layers,
        "cross_attention_layers": list(cross_layers),
        "initializer_range": 0.2,
    }
    return MllamaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID)


def _filler_tokens(count: int) -> list[str]:
    """Ordinary tokens: byte pairs, then byte triples (in the byte-level alphabet), ``count`` in all."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = list(alphabet)
    for size in (2, 3):
        for combo in itertools.product(alphabet, repeat=size):
            if len(tokens) == count:
                return tokens
            tokens.append("".join(combo))
    return tokens


def synthetic_tokenizer() -> Any:
    """Byte-level tokenizer with the real vocabulary layout (no merges: text encodes byte by byte)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(_filler_tokens(BOS_ID))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([*SPECIALS, "<|image|>"])
    core.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>",
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=131072,
    )


def real_processor(tokenizer: Any | None = None) -> MllamaProcessor:
    """The real image preprocessing (560-px tiles, up to 4, CLIP mean/std) around ``tokenizer``."""
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    tokenizer = tokenizer if tokenizer is not None else synthetic_tokenizer()
    return MllamaProcessor(MllamaImageProcessorPil(**REAL_PREPROCESSOR), tokenizer, chat_template=CHAT_TEMPLATE)


def open_gates(model: torch.nn.Module) -> None:
    """Set the tanh gates (text cross-attention, vision global layers) to 1 so the image matters.

    Only parameters named exactly like the gates: a plain ``"gate" in name`` also hits ``gate_proj``.
    """
    gates = {"cross_attn_attn_gate", "cross_attn_mlp_gate", "gate_attn", "gate_ffn", "gate"}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.rsplit(".", 1)[-1] in gates:
                param.fill_(1.0)


def build_model(
    config: MllamaConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    seed: int = 0,
) -> MllamaForConditionalGeneration:
    """Random weights (seeded), created directly on ``device`` in ``dtype``, gates open, eval mode."""
    torch.manual_seed(seed)
    config._attn_implementation = attn_implementation
    with torch.device(device):
        model = MllamaForConditionalGeneration._from_config(config, dtype=dtype)
    open_gates(model)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_IDS, pad_token_id=PAD_ID)
    return model.eval()
