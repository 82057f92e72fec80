"""What our Triton models do with a request, on plain numpy: both the PyTriton server
(:mod:`vlm_demo.triton.serve`) and the classic repository's ``model.py`` files run these, and tests call
them without any server.

* infer: a Triton batch (a list of requests, each maybe several rows) becomes one engine batch; a bad
  row gets its own ``ERROR`` output and never fails the batch it was grouped into.
* generate: decoded as Triton's vLLM backend does (the question is read back out of the chat-templated
  prompt), answered with text pieces when streaming.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import dataclasses
import json
import logging
import os
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from vlm_demo.config import Config, config_from_namespace
from vlm_demo.errors import DemoError, InvalidRequestError
from vlm_demo.request import KNOBS, Limits, SamplingParams, ValidRequest, choice, validate_request
from vlm_demo.results import GenerationResult
from vlm_demo.triton import contract
from vlm_demo.triton.contract import HISTORY, SAMPLING_INPUTS, SAMPLING_KEYS, conversation_from_prompt, error_text

if TYPE_CHECKING:  # the engine (and torch) load where the model does
    from vlm_demo.engine.batching.base import Engine

log = logging.getLogger(__name__)


def _bytes_item(value: Any) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


# ---- the infer (ensemble) contract -------------------------------------------------------------------


def decode_infer_request(
    inputs: dict[str, np.ndarray], limits: Limits, default_max_tokens: int
) -> list[ValidRequest | DemoError]:
    """One entry per batch row of a (batched) infer request; a bad row becomes its error, not an exception."""
    image = inputs.get(contract.IMAGE)
    question = inputs.get(contract.QUESTION)
    if image is None or question is None:
        return [InvalidRequestError("IMAGE and QUESTION are both required.")]
    if image.ndim == 3:  # a model without batching: add the batch dimension back
        image = image[None]
        question = question.reshape(1, -1)
    rows = image.shape[0]
    items: list[ValidRequest | DemoError] = []
    for row in range(rows):
        try:
            items.append(_decode_infer_row(inputs, image[row], question[row], row, limits, default_max_tokens))
        except DemoError as exc:
            items.append(exc)
    return items


def _decode_infer_row(
    inputs: dict[str, np.ndarray],
    pixels: np.ndarray,
    question: np.ndarray,
    row: int,
    limits: Limits,
    default_max_tokens: int,
) -> ValidRequest:
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[-1] != 3:
        raise InvalidRequestError(f"IMAGE must be UINT8 [H,W,3]; got {pixels.dtype} {list(pixels.shape)}.")
    image = Image.fromarray(np.ascontiguousarray(pixels), mode="RGB")
    text = " ".join(_bytes_item(v) for v in np.ravel(question))
    values: dict[str, Any] = {"max_new_tokens": default_max_tokens}
    for name in SAMPLING_INPUTS:
        if name in inputs:
            value = np.ravel(inputs[name])[row] if inputs[name].ndim > 1 else np.ravel(inputs[name])[0]
            values[name] = choice(name, _bytes_item(value)) if KNOBS[name].choices else value.item()
    return validate_request(image, text, SamplingParams(**values), limits, _history(inputs, row))


def _history(inputs: dict[str, np.ndarray], row: int) -> Any:
    """The row's ``HISTORY`` (JSON) as the door takes it; none when the input is absent or empty."""
    if HISTORY not in inputs:
        return None
    values = np.ravel(inputs[HISTORY])
    text = _bytes_item(values[row] if inputs[HISTORY].ndim > 1 else values[0]).strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"HISTORY is not valid JSON: {exc}") from None


def run_stats(result: GenerationResult) -> tuple[int, float, float]:
    """How the engine ran a request: the batch size, its queue seconds and its decoding seconds."""
    return result.batch_size, result.queue_s, max(0.0, result.total_s - result.ttft_s)


def infer_outputs(results: Sequence[GenerationResult | DemoError]) -> dict[str, np.ndarray]:
    """The outputs for a request's rows, each ``[rows, 1]``; failed rows get an empty ANSWER and an ERROR."""
    columns: dict[str, list[Any]] = {name: [] for name in contract.INFER_OUTPUTS}
    for result in results:
        if isinstance(result, DemoError):
            answer, reason, prompt, completion, error = "", result.code, 0, 0, error_text(result)
            batch, queue_s, decode_s = 0, 0.0, 0.0
        else:
            answer, reason, prompt, completion, error = (
                result.text,
                result.finish_reason,
                result.prompt_tokens,
                result.completion_tokens,
                "",
            )
            batch, queue_s, decode_s = run_stats(result)
        row = {
            contract.ANSWER: answer.encode("utf-8"),
            "FINISH_REASON": reason.encode(),
            "PROMPT_TOKENS": prompt,
            "COMPLETION_TOKENS": completion,
            "BATCH_SIZE": batch,
            "QUEUE_S": queue_s,
            "DECODE_S": decode_s,
            contract.ERROR: error.encode("utf-8"),
        }
        for name, value in row.items():
            columns[name].append(value)
    shape = (len(results), 1)
    return {
        name: np.array(values, dtype=contract.INFER_OUTPUT_TYPES[name]).reshape(shape)
        for name, values in columns.items()
    }


class EnsembleHandler:
    """Runs one Triton batch (a list of requests, each maybe several rows) as one engine batch."""

    def __init__(self, engine: Engine, limits: Limits, default_max_tokens: int) -> None:
        self.engine = engine
        self.limits = limits
        self.default_max_tokens = default_max_tokens

    def __call__(self, requests: Sequence[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        decoded = [decode_infer_request(dict(r), self.limits, self.default_max_tokens) for r in requests]
        runnable = [item for rows in decoded for item in rows if isinstance(item, ValidRequest)]
        outcomes = iter(self.engine.run_batch(runnable) if runnable else [])
        responses = []
        for rows in decoded:
            results = [next(outcomes) if isinstance(item, ValidRequest) else item for item in rows]
            responses.append(infer_outputs(results))
        log.debug("ran a Triton batch of %d request(s), %d row(s)", len(requests), len(runnable))
        return responses


# ---- the generate (vLLM) contract -------------------------------------------------------------------


@dataclass
class GenerateCall:
    """A decoded generate-contract request."""

    request: ValidRequest
    prompt: str
    stream: bool
    prepend_prompt: bool
    return_finish_reason: bool
    return_num_input_tokens: bool
    return_num_output_tokens: bool
    return_run_stats: bool


def _flag(inputs: dict[str, np.ndarray], parameters: dict[str, Any], name: str) -> bool | None:
    if name in inputs:
        return bool(np.ravel(inputs[name])[0])
    if name in parameters:
        value = parameters[name]
        return value if isinstance(value, bool) else str(value).lower() in {"1", "true", "yes"}
    return None


def decode_generate_request(
    inputs: dict[str, np.ndarray], parameters: dict[str, Any] | None, limits: Limits, default_max_tokens: int
) -> GenerateCall:
    """Decode as Triton's vLLM backend does; the question is read back out of the chat-templated prompt.

    Sampling settings come from ``sampling_parameters`` (JSON, vLLM names), or from request parameters such
    as ``{"parameters": {"temperature": 0}}`` on ``/generate``.
    """
    parameters = dict(parameters or {})
    if contract.TEXT_INPUT not in inputs or not np.ravel(inputs[contract.TEXT_INPUT]).size:
        raise InvalidRequestError("text_input is required.")
    prompt = _bytes_item(np.ravel(inputs[contract.TEXT_INPUT])[0])
    question, history = conversation_from_prompt(prompt)
    images = list(np.ravel(inputs[contract.IMAGE_INPUT])) if contract.IMAGE_INPUT in inputs else []
    if len(images) != 1:
        raise InvalidRequestError(f"Send exactly one image (base64 of an image file); got {len(images)}.")
    raw = images[0]
    try:
        data = base64.b64decode(raw if isinstance(raw, (bytes, np.bytes_)) else str(raw), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("image is not valid base64.") from None
    sampling: dict[str, Any] = {}
    if contract.SAMPLING_PARAMETERS in inputs:
        text = _bytes_item(np.ravel(inputs[contract.SAMPLING_PARAMETERS])[0])
        try:
            sampling = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"sampling_parameters is not valid JSON: {exc}") from None
        if not isinstance(sampling, dict):
            raise InvalidRequestError("sampling_parameters must be a JSON object.")
    for key in SAMPLING_KEYS:
        if key not in sampling and key in parameters:
            sampling[key] = parameters[key]
    values = {name: sampling[key] for key, name in SAMPLING_KEYS.items() if key in sampling}
    values.setdefault("max_new_tokens", default_max_tokens)
    for name, value in values.items():
        if KNOBS[name].choices:
            values[name] = choice(name, value)
    params = SamplingParams(**values)
    stream = _flag(inputs, parameters, "stream")
    exclude = _flag(inputs, parameters, "exclude_input_in_output")
    return GenerateCall(
        request=validate_request(data, question, params, limits, history),
        prompt=prompt,
        stream=bool(stream),
        # vLLM's rule: the prompt is prepended unless excluded, and never when streaming by default.
        prepend_prompt=(not exclude) if exclude is not None else not stream,
        return_finish_reason=bool(_flag(inputs, parameters, "return_finish_reason")),
        return_num_input_tokens=bool(_flag(inputs, parameters, "return_num_input_tokens")),
        return_num_output_tokens=bool(_flag(inputs, parameters, "return_num_output_tokens")),
        return_run_stats=bool(_flag(inputs, parameters, "return_run_stats")),
    )


def _text_output(text: str) -> dict[str, np.ndarray]:
    return {contract.TEXT_OUTPUT: np.array([text.encode("utf-8")], dtype=np.object_)}


def generate_responses(engine: Engine, call: GenerateCall) -> Generator[dict[str, np.ndarray], None, None]:
    """The responses for one generate request: text pieces when streaming, else one full text; then counts.

    Closing the iterator early (client gone) cancels the engine request so its batch row is freed.
    """
    request = engine.submit(call.request)
    try:
        if call.stream:
            first = True
            for delta in request.stream():
                yield _text_output((call.prompt + delta) if first and call.prepend_prompt else delta)
                first = False
            result = request.result()
        else:
            result = request.result()
            yield _text_output((call.prompt if call.prepend_prompt else "") + result.text)
    finally:
        if not request.done:
            request.cancel()
    final: dict[str, np.ndarray] = {}
    if call.return_finish_reason:
        final["finish_reason"] = np.array([result.finish_reason.encode()], dtype=np.object_)
    if call.return_num_input_tokens:
        final["num_input_tokens"] = np.array([result.prompt_tokens], dtype=np.uint32)
    if call.return_num_output_tokens:
        final["num_output_tokens"] = np.array([result.completion_tokens], dtype=np.uint32)
    if call.return_run_stats:
        for name, value in zip(("batch_size", "queue_s", "decode_s"), run_stats(result), strict=True):
            final[name] = np.array([value], dtype=contract.GENERATE_OUTPUT_TYPES[name])
    if final:
        final.update(_text_output(""))
        yield final


# ---- configuration inside a model repository -----------------------------------------------------------


def config_from_model_config(model_config: dict[str, Any], environ: dict[str, str] | None = None) -> Config:
    """The engine's :class:`Config` for a Python-backend model: defaults < ``config.pbtxt`` parameters < ``VLM_*``.

    ``parameters { key: "model" value: { string_value: "..." } }`` names any ``Config`` field; the model's
    ``max_batch_size`` (when > 0) is also the engine's, so Triton's batch becomes one engine batch.
    """
    environ = dict(os.environ if environ is None else environ)
    fields = {f.name: f for f in dataclasses.fields(Config) if f.metadata.get("cli") is not False}
    namespace = argparse.Namespace()
    for key, value in (model_config.get("parameters") or {}).items():
        raw = value.get("string_value", "") if isinstance(value, dict) else str(value)
        if key not in fields:
            raise ValueError(f"config.pbtxt parameter {key!r} is not a setting; known: {sorted(fields)}")
        if raw == "" or environ.get("VLM_" + key.upper()):
            continue
        kind: type = type(fields[key].default)
        setattr(namespace, key, raw.strip().lower() in {"1", "true", "yes"} if kind is bool else kind(raw))
    batch = int(model_config.get("max_batch_size") or 0)
    if batch > 0 and not environ.get("VLM_MAX_BATCH_SIZE"):
        namespace.max_batch_size = batch
    return config_from_namespace(namespace, environ)


def instance_device(args: dict[str, str]) -> str | None:
    """``cuda:N`` for a KIND_GPU instance (Triton says which GPU), ``cpu`` for KIND_CPU, else no opinion."""
    kind = args.get("model_instance_kind", "")
    if kind == "GPU":
        return f"cuda:{args.get('model_instance_device_id', '0')}"
    if kind == "CPU":
        return "cpu"
    return None
