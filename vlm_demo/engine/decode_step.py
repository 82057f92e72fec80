"""One decode step of Mllama's text model, written out: a token for every running row.

Continuous batching calls the text model once per generated token. Through
``MllamaForConditionalGeneration.forward`` each call also pays for the multimodal wrapper, two mask
builders, output-capturing and deprecation decorators and gradient-checkpointing shims around every
layer. On a small model, and on a fast GPU with the 11B model at small batch sizes, that Python work
costs as much as the arithmetic. ``TextDecodeStep`` runs the same operations, in the same order, on
the same modules' weights (token-identical to ``generate``: the continuous-batching tests check it),
and nothing else. It expects what ``RunningBatch.step_inputs`` prepares, as ``Worker.decode`` hands
it on: a 4-D self-attention mask (boolean for sdpa, additive for eager, which adds the mask to the
scores) or ``None``, cross-attention masks already in the layers' form, and a cache whose
cross-attention layers hold every row's image states.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.mllama.modeling_mllama import apply_rotary_pos_emb, eager_attention_forward


def single_device(model: torch.nn.Module) -> bool:
    """The written-out step moves no tensors between devices; a model spread by ``device_map``
    (or offloaded) keeps the stock forward, whose accelerate hooks do."""
    return len({p.device for p in model.parameters()}) == 1


class TextDecodeStep:
    def __init__(self, model: Any) -> None:
        self.text = model.model.language_model
        self.lm_head = model.lm_head
        config = self.text.config
        self.cross_layers = frozenset(config.cross_attention_layers)
        self.attention = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)
        with torch.no_grad():  # the tanh gates are constants at inference: computed once, same values
            self.gates = {
                index: (layer.cross_attn_attn_gate.tanh(), layer.cross_attn_mlp_gate.tanh())
                for index, layer in enumerate(self.text.layers)
                if index in self.cross_layers
            }

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cross_attention_mask: torch.Tensor,
        full_text_row_masked_out_mask: torch.Tensor,
        cache: Any,
    ) -> torch.Tensor:
        """``[B, 1]`` tokens at ``[B, 1]`` positions -> ``[B, vocab]`` float32 logits; extends ``cache``.

        Run it under ``torch.inference_mode`` (``Worker.decode`` does), as any forward pass.
        """
        hidden = self.text.embed_tokens(input_ids)
        cos, sin = self.text.rotary_emb(hidden, position_ids)
        for index, layer in enumerate(self.text.layers):
            if index in self.cross_layers:
                hidden = self._cross_layer(
                    index, layer, hidden, cross_attention_mask, full_text_row_masked_out_mask, cache
                )
            else:
                hidden = self._self_layer(layer, hidden, cos, sin, attention_mask, cache)
        hidden = self.text.norm(hidden)
        return self.lm_head(hidden[:, -1]).float()

    def _self_layer(
        self, layer: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any, cache: Any
    ) -> torch.Tensor:
        attn = layer.self_attn
        rows = hidden.shape[0]
        x = layer.input_layernorm(hidden)
        query = attn.q_proj(x).view(rows, 1, attn.num_heads, attn.head_dim).transpose(1, 2)
        key = attn.k_proj(x).view(rows, 1, attn.num_key_value_heads, attn.head_dim).transpose(1, 2)
        value = attn.v_proj(x).view(rows, 1, attn.num_key_value_heads, attn.head_dim).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        key, value = cache.update(key, value, attn.layer_idx)
        out, _ = self.attention(attn, query, key, value, mask, dropout=0.0, scaling=attn.scaling)
        hidden = hidden + attn.o_proj(out.reshape(rows, 1, -1).contiguous())
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def _cross_layer(
        self, index: int, layer: Any, hidden: torch.Tensor, mask: torch.Tensor, row_mask: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        attn = layer.cross_attn
        rows = hidden.shape[0]
        attn_gate, mlp_gate = self.gates[index]
        query = attn.q_proj(layer.input_layernorm(hidden)).view(rows, 1, attn.num_heads, attn.head_dim).transpose(1, 2)
        query = attn.q_norm(query)
        image = cache.layers[index]  # every row's projected image states, cached at prefill
        out, _ = self.attention(attn, query, image.keys, image.values, mask, dropout=0.0, scaling=attn.scaling)
        hidden = hidden + attn_gate * attn.o_proj(out.reshape(rows, 1, -1).contiguous())
        mlp = row_mask[:, 0] * layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden + mlp_gate * mlp
