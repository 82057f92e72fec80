"""The generate contract on the client's side (Triton's vLLM backend, decoupled; :mod:`vlm_demo.triton.contract`):
a request as named values, and the remote's streamed pieces into the answer's stream. No transport here.

``text_input`` (the chat-templated prompt, earlier turns included), ``image`` (base64 of a PNG: lossless, so
the remote sees exactly the pixels the local engine would), ``stream``, ``sampling_parameters`` (JSON, vLLM's
keys) and ``exclude_input_in_output`` in; ``text_output`` pieces out. The ``return_*`` flags the model lists
are set, so the final response carries the counts (and, from our server, how its engine ran the request).
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import numpy as np

from vlm_demo.backends.triton.remote import ModelInfo, short
from vlm_demo.backends.triton.stream import TritonStream, event_text, read_counts, read_event_counts, text_of
from vlm_demo.errors import GenerationError
from vlm_demo.request import ValidRequest
from vlm_demo.triton import contract
from vlm_demo.triton.contract import chat_prompt, error_from_text


def values(info: ModelInfo, request: ValidRequest) -> dict[str, Any]:
    """The request's inputs, by name (only those the model lists)."""
    sent: dict[str, Any] = {
        contract.TEXT_INPUT: chat_prompt(request.question, request.history),
        contract.IMAGE_INPUT: encode_image(request.image),
        "stream": True,
        contract.SAMPLING_PARAMETERS: json.dumps(contract.sampling_parameters(request.params)),
        "exclude_input_in_output": True,
    }
    for flag in contract.GENERATE_FLAGS[2:]:  # the return_* flags
        sent[flag] = True
    return {name: value for name, value in sent.items() if name in info.inputs}


def arrays(named: dict[str, Any]) -> dict[str, np.ndarray]:
    """The same values as tensors (gRPC): flags as BOOL, text as BYTES."""
    return {
        name: np.array([value], dtype=bool)
        if isinstance(value, bool)
        else np.array([value.encode("utf-8")], dtype=np.object_)
        for name, value in named.items()
    }


def encode_image(image: Any) -> str:
    """Base64 of a PNG file: lossless, so the remote sees exactly the pixels the local engine would."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def on_piece(stream: TritonStream, result: Any) -> None:
    """One gRPC response: the next piece of text, and any counts it carries."""
    text = result.as_numpy(contract.TEXT_OUTPUT)
    if text is not None and text.size:
        stream.push(text_of(text))
    read_counts(stream, result)


def on_event(stream: TritonStream, event: dict[str, Any]) -> None:
    """One ``generate_stream`` event (HTTP): an error may arrive mid-stream, with status 200."""
    if "error" in event:
        message = str(event["error"])
        raise error_from_text(message) or GenerationError(f"Triton model failed: {short(message)}")
    stream.push(event_text(event.get(contract.TEXT_OUTPUT, "")))
    read_event_counts(stream, event)
