"""The infer contract on the client's side (``llama_3_2v_11b_cot_ensemble``, :mod:`vlm_demo.triton.contract`):
a request as named arrays, and the remote's responses into the answer's stream. No transport here.

``IMAGE`` UINT8 ``[H,W,3]`` (plus a batch dimension when the model batches) and ``QUESTION`` BYTES in,
``ANSWER`` BYTES out. The optional inputs (the sampling fields, ``HISTORY``) and outputs (finish reason,
counts, how the remote engine ran it, a per-request ``ERROR``) are used only when the model lists them, so
any server with the bare contract works.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from vlm_demo.backends.triton.remote import ModelInfo
from vlm_demo.backends.triton.stream import TritonStream, read_counts, text_of
from vlm_demo.errors import GenerationError, UnsupportedError
from vlm_demo.request import STAGE_BEAM, ValidRequest
from vlm_demo.triton import contract
from vlm_demo.triton.contract import error_from_text


def arrays(info: ModelInfo, model: str, request: ValidRequest) -> dict[str, np.ndarray]:
    """The request's inputs, by name, as the model takes them (what it does not list is left out)."""
    params = request.params
    if params.reasoning == STAGE_BEAM and "reasoning" not in info.inputs:
        raise UnsupportedError(
            f"The Triton model '{model}' has no 'reasoning' input, so it cannot think harder (stage beam search); "
            "ask in the normal mode."
        )
    lead = [1] if info.batched else []
    pixels = np.ascontiguousarray(np.asarray(request.image.convert("RGB"), dtype=np.uint8))
    out = {
        contract.IMAGE: pixels.reshape(lead + list(pixels.shape)),
        contract.QUESTION: np.array([request.question.encode("utf-8")], dtype=np.object_).reshape(lead + [1]),
    }
    if request.history:  # only a follow-up sends it: a model without the input still takes every first question
        text = json.dumps([list(turn) for turn in request.history], ensure_ascii=False)
        out[contract.HISTORY] = np.array([text.encode("utf-8")], dtype=np.object_).reshape(lead + [1])
    for name, dtype in contract.SAMPLING_INPUTS.items():
        if name in info.inputs:
            out[name] = np.array([_wire_value(request, name)], dtype=dtype).reshape(lead + [1])
    return out


def _wire_value(request: ValidRequest, name: str) -> Any:
    """A sampling field as the infer contract sends it: text as bytes, a greedy request's seed as 0 (so
    Triton's response cache sees one key for it)."""
    value = getattr(request.params, name)
    if name == "seed":
        return 0 if request.params.greedy else value
    return value.encode("utf-8") if isinstance(value, str) else value


def outputs(info: ModelInfo) -> list[str]:
    """The outputs to ask for: the contract's, where the model lists them."""
    return [name for name in contract.INFER_OUTPUTS if name in info.outputs]


def finish(stream: TritonStream, result: Any, info: ModelInfo, model: str) -> None:
    """A (non-streaming) response: the whole answer, or the row's typed error."""
    error = result.as_numpy(contract.ERROR) if contract.ERROR in info.outputs else None
    if error is not None and error.size and text_of(error):
        message = text_of(error)
        stream.fail(error_from_text(message) or GenerationError(f"Triton model failed: {message}"))
        return
    answer = result.as_numpy(contract.ANSWER)
    if answer is None:
        raise GenerationError(f"Triton model '{model}' returned no ANSWER.")
    read_counts(stream, result)
    stream.push(text_of(answer))
    reason = result.as_numpy("FINISH_REASON")
    stream.finish(text_of(reason) if reason is not None and reason.size else "stop")


def on_piece(stream: TritonStream, result: Any) -> None:
    """One response of a decoupled (streaming) model: ANSWER holds the next piece of text."""
    answer = result.as_numpy(contract.ANSWER)
    if answer is not None and answer.size:
        stream.push(text_of(answer))
    read_counts(stream, result)
