"""One decode step of Mllama's text model over the page pool: a token for every running row.

The stock forward keeps its cache in per-layer tensors of shape ``[rows, heads, length, dim]``: rows
joining or leaving copy every row, and a padded batch reads every row at the longest length. This step
runs the same operations on the same modules' weights, but each self-attention layer writes the rows'
new keys/values into their pages and attends over each row's own tokens, and each cross-attention layer
attends over the tiles each row sees (:mod:`~vlm_demo.engine.attention`). Its inputs are
:class:`~vlm_demo.engine.rows.StepInputs`: tensors only, nothing that is a Python number per step.

A model spread over several devices (``device_map``) runs here too: the hidden states move to each
layer's device, as accelerate's hooks would move them, and each device holds its layers' pages.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.mllama.modeling_mllama import apply_rotary_pos_emb

from vlm_demo.engine.attention import Layout, PagedAttention
from vlm_demo.engine.pages import PagePool, PageShape, page_tokens_for
from vlm_demo.engine.rows import StepInputs


def layer_devices(model: Any) -> dict[int, torch.device]:
    """Each text layer's device (where its pages must live)."""
    return {i: next(layer.parameters()).device for i, layer in enumerate(model.model.language_model.layers)}


def pageable(model: Any) -> bool:
    """Whether every text layer's weights sit on a device (offloaded weights, on ``meta``, are moved in by
    accelerate's hooks on the whole text model, which this step does not call)."""
    return all(d.type != "meta" for d in layer_devices(model).values())


def page_shape(model: Any, dtype: torch.dtype) -> PageShape:
    """The pages this model's cache takes, on the device its text model runs on."""
    return PageShape.of(model.config, dtype, page_tokens_for(next(iter(layer_devices(model).values()))))


class TextDecodeStep:
    @classmethod
    def over_pool(cls, model: Any, dtype: torch.dtype, pages: int, kernel: str = "auto") -> TextDecodeStep:
        """A step over a pool of ``pages`` pages allocated now (``kernel``: the decode attention's)."""
        shape = page_shape(model, dtype)
        pool = PagePool(shape, pages, layer_devices(model))
        heads = model.config.get_text_config().num_attention_heads
        return cls(model, PagedAttention(pool, heads, shape.head_dim**-0.5, kernel))

    def __init__(self, model: Any, attention: PagedAttention) -> None:
        self.text = model.model.language_model
        self.lm_head = model.lm_head
        self.attention = attention
        self.pool = attention.pool
        config = self.text.config
        self.cross_layers = frozenset(config.cross_attention_layers)
        self.devices = layer_devices(model)
        with torch.no_grad():  # the tanh gates are constants at inference: computed once, same values
            self.gates = {
                index: (layer.cross_attn_attn_gate.tanh(), layer.cross_attn_mlp_gate.tanh())
                for index, layer in enumerate(self.text.layers)
                if index in self.cross_layers
            }

    def __call__(self, inputs: StepInputs) -> torch.Tensor:
        """``[rows, vocab]`` float32 logits for every row's next input; writes the inputs' keys/values.

        Run it under ``torch.inference_mode`` (``Worker.decode`` does), as any forward pass."""
        hidden = self.text.embed_tokens(inputs.input_ids[:, None])  # [rows, 1, hidden]
        cos, sin = self.text.rotary_emb(hidden, inputs.positions[:, None])
        here = {hidden.device: (inputs, cos, sin)}
        for index, layer in enumerate(self.text.layers):
            device = self.devices[index]
            if device not in here:  # a spread model: everything this layer reads, on its device
                moved = _moved(inputs, device)
                here[device] = (moved, cos.to(device), sin.to(device))
            step, c, s = here[device]
            hidden = hidden.to(device)
            if index in self.cross_layers:
                hidden = self._cross_layer(index, layer, hidden, step)
            else:
                hidden = self._self_layer(index, layer, hidden, c, s, step)
        hidden = self.text.norm(hidden.to(self.text.norm.weight.device))
        return self.lm_head(hidden[:, -1].to(self.lm_head.weight.device)).float()

    def _self_layer(
        self, index: int, layer: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepInputs
    ) -> torch.Tensor:
        attn = layer.self_attn
        rows = hidden.shape[0]
        x = layer.input_layernorm(hidden)
        query = attn.q_proj(x).view(rows, 1, attn.num_heads, attn.head_dim).transpose(1, 2)
        key = attn.k_proj(x).view(rows, 1, attn.num_key_value_heads, attn.head_dim).transpose(1, 2)
        value = attn.v_proj(x).view(rows, 1, attn.num_key_value_heads, attn.head_dim)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        self.pool.write(index, (step.write_pages, step.write_offsets), key[:, :, 0], value[:, 0])
        out = self.attention.self_attention(index, query[:, :, 0], step.layout)
        hidden = hidden + attn.o_proj(out[:, None])
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def _cross_layer(self, index: int, layer: Any, hidden: torch.Tensor, step: StepInputs) -> torch.Tensor:
        attn = layer.cross_attn
        rows = hidden.shape[0]
        attn_gate, mlp_gate = self.gates[index]
        query = attn.q_proj(layer.input_layernorm(hidden)).view(rows, 1, attn.num_heads, attn.head_dim).transpose(1, 2)
        query = attn.q_norm(query)
        out = self.attention.cross_attention(index, query[:, :, 0], step.layout)
        hidden = hidden + attn_gate * attn.o_proj(out[:, None])
        mlp = step.row_mask[:, None, None] * layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden + mlp_gate * mlp


def _moved(inputs: StepInputs, device: torch.device) -> StepInputs:
    layout = Layout(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(inputs.layout).items()})
    return StepInputs(
        inputs.input_ids.to(device),
        inputs.positions.to(device),
        inputs.write_pages.to(device),
        inputs.write_offsets.to(device),
        inputs.row_mask.to(device),
        layout,
    )
