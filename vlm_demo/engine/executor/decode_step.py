"""One decode step of Mllama's text model over the page pool: a token for every running row.

The stock forward keeps its cache in per-layer tensors of shape ``[rows, heads, length, dim]``: rows
joining or leaving copy every row, and a padded batch reads every row at the longest length. This step
runs the same arithmetic on the same weights, but each self-attention layer writes the rows' new
keys/values into their pages and attends over each row's own tokens, and each cross-attention layer
attends over the tiles each row sees (:mod:`~vlm_demo.engine.executor.attention`).

It also launches about half the operations of the stock forward, which matters where each one is a GPU
kernel launched from Python: RMSNorm is ``torch.nn.functional.rms_norm`` (one fused kernel on CUDA); the
rotary embedding is computed once per step for all layers, as one rotation per row that each layer
applies to its queries and keys together in one matrix product; queries, keys and values come from one
merged projection, the MLP's gate and up projections from another (the modules' weights become views of
the merged ones: no extra memory, and the stock forward that prefills uses the same numbers); the
residual additions ride on the output projections (``addmm``). Quantized projections
(:class:`~vlm_demo.engine.weights.packed.PackedLinear`) merge the same way and take the same shape of step: one
``vlm_demo::weight_only_linear`` per product, the residual added inside it. Token-identical to the stock
forward in fp32 (the tests check it); its inputs are :class:`~vlm_demo.engine.batching.rows.StepInputs`, tensors only.

A model spread over several devices (``device_map``) runs here too: the hidden states move to each
layer's device, as accelerate's hooks would move them, and each device holds its layers' pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vlm_demo.engine.batching.rows import StepInputs
from vlm_demo.engine.executor.attention import PagedAttention, choose, moved
from vlm_demo.engine.kv.pages import PagePool, PageShape, page_tokens_for
from vlm_demo.engine.weights.packed import PackedLinear, PackedWeight
from vlm_demo.engine.weights.packed import merge as merge_packed


def layer_devices(model: Any) -> dict[int, torch.device]:
    """Each text layer's device (where its pages must live)."""
    return {i: next(layer.parameters()).device for i, layer in enumerate(model.model.language_model.layers)}


def pageable(model: Any) -> bool:
    """Whether every text layer's weights sit on a device (offloaded weights, on ``meta``, are moved in by
    accelerate's hooks on the whole text model, which this step does not call)."""
    return all(d.type != "meta" for d in layer_devices(model).values())


def page_shape(model: Any, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> PageShape:
    """The pages this model's cache takes, on the device its text model runs on (``kv_dtype``: how the pool
    stores keys/values; ``None``: in ``dtype``)."""
    return PageShape.of(model.config, dtype, page_tokens_for(next(iter(layer_devices(model).values()))), kv_dtype)


def attention_geometry(model: Any, dtype: torch.dtype,
                       kv_dtype: torch.dtype | None = None) -> tuple[PageShape, int, torch.device]:  # fmt: skip
    """What choosing a decode attention takes: the pages, the query heads, the device of the first text layer."""
    heads = model.config.get_text_config().num_attention_heads
    return page_shape(model, dtype, kv_dtype), heads, next(iter(layer_devices(model).values()))


def merge(linears: list[torch.nn.Module]) -> torch.Tensor | PackedWeight | None:
    """One weight for several projections of the same input: the modules' weights become views of it (the
    memory stays the same, and every other user of the modules sees the same values); packed ones merge their
    values and scales (:func:`~vlm_demo.engine.weights.packed.merge`). ``None`` where the weights are neither plain
    tensors of one dtype and device nor packed alike."""
    if any(isinstance(linear, PackedLinear) for linear in linears):
        return merge_packed(linears)
    weights: list[Any] = [linear.weight for linear in linears]
    if any(linear.bias is not None for linear in linears) or any(type(w.data) is not torch.Tensor for w in weights):
        return None
    if len({(w.dtype, w.device) for w in weights}) != 1:
        return None
    merged = torch.cat([w.detach() for w in weights])
    start = 0
    for linear, weight in zip(linears, weights, strict=True):
        rows = weight.shape[0]
        linear.weight = torch.nn.Parameter(merged[start : start + rows], requires_grad=False)
        start += rows
    return merged


Projection = torch.Tensor | PackedWeight | torch.nn.Module  # a plain weight (transposed for ``addmm``), a
# packed one (never transposed: the operator takes it as stored), or another layer, which runs itself


def projection(linear: torch.nn.Module, transposed: bool = False) -> Projection:
    """What the step multiplies by: the weight itself where it is a plain tensor (resolved once, not looked up
    through the module every step), a packed layer's :class:`PackedWeight`, else the module, which runs its own
    kernel."""
    if isinstance(linear, PackedLinear):
        return linear.packed()
    weight = linear.weight
    if linear.bias is not None or type(weight.data) is not torch.Tensor:
        return linear
    return weight.detach().t() if transposed else weight.detach()


@dataclass
class Layer:
    """One decoder layer as the step runs it: its weights and constants, resolved once."""

    index: int
    cross: bool
    device: torch.device
    # (weight, eps) of its norms: the input's, the post-attention one's, and a cross layer's query norm
    norms: tuple[tuple[torch.Tensor, float], ...]
    qkv: Projection | tuple[Projection, ...]  # self layers: [q; k; v] merged, or the three. Cross layers: (q,)
    output: Projection  # the attention's output projection (transposed weight)
    gate_up: Projection | tuple[Projection, Projection]
    down: Projection  # transposed weight
    gates: tuple[float, float] = (1.0, 1.0)  # tanh of a cross-attention layer's attention and MLP gates


def _norm_of(module: Any) -> tuple[torch.Tensor, float]:
    return module.weight.detach(), module.variance_epsilon


def _layer(index: int, module: Any, cross: bool, device: torch.device) -> Layer:
    """A decoder layer's weights for the step (merging q/k/v and gate/up where the weights allow)."""
    mlp = module.mlp
    merged = merge([mlp.gate_proj, mlp.up_proj])
    gate_up = merged if merged is not None else (projection(mlp.gate_proj), projection(mlp.up_proj))
    norms = [_norm_of(module.input_layernorm), _norm_of(module.post_attention_layernorm)]
    if cross:
        attn = module.cross_attn
        gates = (_number(module.cross_attn_attn_gate.tanh()), _number(module.cross_attn_mlp_gate.tanh()))
        norms.append(_norm_of(attn.q_norm))
        qkv: Projection | tuple[Projection, ...] = (projection(attn.q_proj),)
    else:
        attn = module.self_attn
        gates = (1.0, 1.0)
        both = merge([attn.q_proj, attn.k_proj, attn.v_proj])
        qkv = both if both is not None else tuple(projection(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    return Layer(index, cross, device, tuple(norms), qkv, projection(attn.o_proj, True), gate_up,
                 projection(mlp.down_proj, True), gates)  # fmt: skip


def _apply(weight: Projection, x: torch.Tensor) -> torch.Tensor:
    """``x`` through a projection that is not transposed (a merged or a query weight)."""
    return F.linear(x, weight) if isinstance(weight, torch.Tensor) else weight(x)


class TextDecodeStep:
    @classmethod
    def over_pool(cls, model: Any, dtype: torch.dtype, pages: int, kernel: str | type[PagedAttention] = "auto",
                  kv_dtype: torch.dtype | None = None) -> TextDecodeStep:  # fmt: skip
        """A step over a pool of ``pages`` pages allocated now (``kernel``: the decode attention, or a
        ``--decode-attention`` choice to make now; ``kv_dtype``: how the pool stores keys/values, ``None``: in
        ``dtype``)."""
        shape, heads, device = attention_geometry(model, dtype, kv_dtype)
        if isinstance(kernel, str):
            kernel = choose(shape, heads, device, kernel)
        pool = PagePool(shape, pages, layer_devices(model))
        return cls(model, kernel(pool, heads, shape.head_dim**-0.5))

    def __init__(self, model: Any, attention: PagedAttention) -> None:
        self.text = model.model.language_model
        self.lm_head = model.lm_head
        self.attention = attention
        self.pool = attention.pool
        config = self.text.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attention.shape.head_dim
        self.eps = config.rms_norm_eps
        devices = layer_devices(model)
        cross = frozenset(config.cross_attention_layers)
        with torch.no_grad():
            self.layers = [_layer(i, module, i in cross, devices[i]) for i, module in enumerate(self.text.layers)]
            self.final_norm = _norm_of(self.text.norm)
        half = self.head_dim // 2
        partner = torch.arange(self.head_dim).roll(half)  # where rotate_half takes each element from
        sign = torch.cat([-torch.ones(half), torch.ones(self.head_dim - half)])
        # x @ R = x·cos + rotate_half(x)·sin, with R = cos on the diagonal + sin·sign at (partner[j], j)
        self._diagonal = torch.eye(self.head_dim)
        self._turn = torch.zeros(self.head_dim, self.head_dim)
        self._turn[partner, torch.arange(self.head_dim)] = sign

    def __call__(self, inputs: StepInputs) -> torch.Tensor:
        """``[rows, vocab]`` float32 logits for every row's next input; writes the inputs' keys/values.

        Run it under ``torch.inference_mode`` (``Worker.decode`` does), as any forward pass."""
        hidden = self.text.embed_tokens(inputs.input_ids)  # [rows, hidden]
        rotation = self._rotation(hidden, inputs.positions)
        here = {hidden.device: (inputs, rotation)}
        for layer in self.layers:
            if layer.device not in here:  # a spread model: everything this layer reads, on its device
                here[layer.device] = (_moved(inputs, layer.device), rotation.to(layer.device))
            step, rotate = here[layer.device]
            hidden = hidden.to(layer.device)
            hidden = self._cross(layer, hidden, step) if layer.cross else self._self(layer, hidden, rotate, step)
        if inputs.layout.restore is not None:  # the step ran its rows in another order: back to the engine's
            hidden = hidden.index_select(0, inputs.layout.restore.to(hidden.device))
        norm = self.final_norm
        hidden = _norm(hidden.to(norm[0].device), norm)
        return self.lm_head(hidden.to(self.lm_head.weight.device)).float()

    def _rotation(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Every row's rotary embedding as a ``[rows, dim, dim]`` matrix (``x @ R = x·cos + rotate_half(x)·sin``):
        computed once per step, applied by each layer in one matrix product."""
        cos, sin = self.text.rotary_emb(hidden[:, None], positions[:, None])  # [rows, 1, dim]
        if self._diagonal.device != cos.device or self._diagonal.dtype != cos.dtype:
            self._diagonal, self._turn = self._diagonal.to(cos), self._turn.to(cos)
        return torch.addcmul(cos * self._diagonal, sin, self._turn)  # [rows, 1, dim] over [dim, dim]

    def _self(self, layer: Layer, hidden: torch.Tensor, rotation: torch.Tensor, step: StepInputs) -> torch.Tensor:
        rows, dim = hidden.shape[0], self.head_dim
        x = _norm(hidden, layer.norms[0])
        if isinstance(layer.qkv, tuple):
            qkv = torch.cat([_apply(p, x) for p in layer.qkv], dim=-1)
        else:
            qkv = _apply(layer.qkv, x)
        heads = self.heads + self.kv_heads
        qk = torch.matmul(qkv[:, : heads * dim].view(rows, heads, dim), rotation)  # rotary, queries and keys at once
        value = qkv[:, heads * dim :].view(rows, self.kv_heads, dim)
        self.attention.write(layer.index, step.write_pages, step.write_offsets, qk[:, self.heads :], value, step.layout)
        out = self.attention.self_attention(layer.index, qk[:, : self.heads], step.layout)
        return self._mlp(layer, _add_projected(hidden, layer.output, out))

    def _cross(self, layer: Layer, hidden: torch.Tensor, step: StepInputs) -> torch.Tensor:
        rows = hidden.shape[0]
        x = _norm(hidden, layer.norms[0])
        query = _norm(_apply(layer.qkv[0], x).view(rows, self.heads, self.head_dim), layer.norms[2])  # type: ignore[index]
        out = self.attention.cross_attention(layer.index, query, step.layout)
        hidden = _add_projected(hidden, layer.output, out, layer.gates[0])
        return self._mlp(layer, hidden, step.row_mask)

    def _mlp(self, layer: Layer, hidden: torch.Tensor, row_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's MLP added to ``hidden`` (a cross-attention layer's scaled by its gate, and zero for a row
        that sees no tile)."""
        x = _norm(hidden, layer.norms[1])
        if isinstance(layer.gate_up, tuple):
            gate, up = (_apply(p, x) for p in layer.gate_up)
        else:
            gate, up = _apply(layer.gate_up, x).chunk(2, dim=-1)
        inner = F.silu(gate) * up
        if row_mask is None:
            return _add_projected(hidden, layer.down, inner)
        down = inner @ layer.down if isinstance(layer.down, torch.Tensor) else layer.down(inner)
        return torch.addcmul(hidden, down, row_mask[:, None], value=layer.gates[1])


def _norm(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), norm[0], norm[1])


def _add_projected(hidden: torch.Tensor, weight: Projection, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``hidden + scale · x @ weight``: one ``addmm`` for a plain (transposed) weight, one packed product with the
    residual inside for a packed one; another layer runs its own module."""
    if isinstance(weight, torch.Tensor):
        return torch.addmm(hidden, x, weight, alpha=scale)
    if isinstance(weight, PackedWeight):
        return weight(x, hidden, scale)
    return hidden + scale * weight(x) if scale != 1.0 else hidden + weight(x)


def _number(value: torch.Tensor) -> float:
    """A constant of the model as a Python number (the kernel-count tool's shapes-only model has no values)."""
    return 1.0 if value.device.type == "meta" else float(value)


def _moved(inputs: StepInputs, device: torch.device) -> StepInputs:
    layout = moved(inputs.layout, device)
    return StepInputs(
        inputs.input_ids.to(device),
        inputs.positions.to(device),
        inputs.write_pages.to(device),
        inputs.write_offsets.to(device),
        inputs.row_mask.to(device),
        layout,
    )
