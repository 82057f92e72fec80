"""Serve our engine from a real Triton Inference Server (PyTriton), speaking the two contracts the demo calls.

* ``llama_3_2v_11b_cot_ensemble`` — ``IMAGE`` UINT8 ``[H,W,3]`` + ``QUESTION`` BYTES → ``ANSWER`` BYTES, with
  Triton's dynamic batcher in front: each batch Triton forms is handed whole to the engine, so it becomes one
  engine batch. Optional inputs carry sampling parameters; optional outputs carry the finish reason, token
  counts and a per-request ``ERROR`` (one bad request must not fail the batch it was grouped into).
* ``vllm_model`` — the generate contract of Triton's vLLM backend, decoupled (streaming): ``text_input``
  (chat-templated prompt), ``image`` (base64 of an image file), ``stream``, ``sampling_parameters`` (JSON),
  ``exclude_input_in_output`` → ``text_output`` pieces.

The request decoding and response building below work on plain numpy, so the classic model repository's
``model.py`` (``vlm_demo/triton_repo``) reuses them, and tests call them without any server.

Run ``python -m vlm_demo.triton_serve --model tiny``. The bundled ``tritonserver`` needs
``LD_LIBRARY_PATH`` to include this Python's ``LIBDIR`` (see the README); without it the Python backend
stub loads the system libpython and fails at start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import dataclasses
import json
import logging
import os
import sys
import sysconfig
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from vlm_demo.backends.triton import ENSEMBLE_MODEL, GENERATE_MODEL, error_text, question_from_prompt
from vlm_demo.config import Config, build_parser, config_from_namespace
from vlm_demo.errors import DemoError, InvalidRequestError
from vlm_demo.schema import (
    DEFAULT_BEAMS,
    DEFAULT_MAX_NEW_TOKENS,
    GenerationResult,
    Limits,
    SamplingParams,
    ValidRequest,
    reasoning_mode,
    validate_request,
)

log = logging.getLogger(__name__)

# Optional infer-contract inputs: name -> (numpy dtype, SamplingParams field).
SAMPLING_INPUTS = {
    "max_new_tokens": (np.int32, "max_new_tokens"),
    "temperature": (np.float32, "temperature"),
    "top_p": (np.float32, "top_p"),
    "seed": (np.int64, "seed"),
    "reasoning": (np.object_, "reasoning"),  # "normal" or "stage-beam" (bytes)
    "beams": (np.int32, "beams"),
}
INFER_OUTPUTS = ("ANSWER", "FINISH_REASON", "PROMPT_TOKENS", "COMPLETION_TOKENS", "ERROR")
GENERATE_FLAGS = (
    "stream",
    "exclude_input_in_output",
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
)


def _bytes_item(value: Any) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


# ---- the infer (ensemble) contract -------------------------------------------------------------------


def decode_infer_request(
    inputs: dict[str, np.ndarray], limits: Limits, default_max_tokens: int
) -> list[ValidRequest | DemoError]:
    """One entry per batch row of a (batched) infer request; a bad row becomes its error, not an exception."""
    image = inputs.get("IMAGE")
    question = inputs.get("QUESTION")
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
    for name, (_, field_name) in SAMPLING_INPUTS.items():
        if name in inputs:
            value = np.ravel(inputs[name])[row] if inputs[name].ndim > 1 else np.ravel(inputs[name])[0]
            values[field_name] = reasoning_mode(_bytes_item(value)) if name == "reasoning" else value.item()
    return validate_request(image, text, SamplingParams(**values), limits)


def infer_outputs(results: Sequence[GenerationResult | DemoError]) -> dict[str, np.ndarray]:
    """The outputs for a request's rows, each ``[rows, 1]``; failed rows get an empty ANSWER and an ERROR."""
    answers, reasons, prompt, completion, errors = [], [], [], [], []
    for result in results:
        if isinstance(result, DemoError):
            answers.append(b"")
            reasons.append(result.code.encode())
            prompt.append(0)
            completion.append(0)
            errors.append(error_text(result).encode("utf-8"))
        else:
            answers.append(result.text.encode("utf-8"))
            reasons.append(result.finish_reason.encode())
            prompt.append(result.prompt_tokens)
            completion.append(result.completion_tokens)
            errors.append(b"")
    column = (len(results), 1)
    return {
        "ANSWER": np.array(answers, dtype=np.object_).reshape(column),
        "FINISH_REASON": np.array(reasons, dtype=np.object_).reshape(column),
        "PROMPT_TOKENS": np.array(prompt, dtype=np.int32).reshape(column),
        "COMPLETION_TOKENS": np.array(completion, dtype=np.int32).reshape(column),
        "ERROR": np.array(errors, dtype=np.object_).reshape(column),
    }


class EnsembleHandler:
    """Runs one Triton batch (a list of requests, each maybe several rows) as one engine batch."""

    def __init__(self, engine: Any, limits: Limits, default_max_tokens: int) -> None:
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
    if "text_input" not in inputs or not np.ravel(inputs["text_input"]).size:
        raise InvalidRequestError("text_input is required.")
    prompt = _bytes_item(np.ravel(inputs["text_input"])[0])
    question = question_from_prompt(prompt)
    images = [v for v in np.ravel(inputs["image"])] if "image" in inputs else []
    if len(images) != 1:
        raise InvalidRequestError(f"Send exactly one image (base64 of an image file); got {len(images)}.")
    raw = images[0]
    try:
        data = base64.b64decode(raw if isinstance(raw, (bytes, np.bytes_)) else str(raw), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("image is not valid base64.") from None
    sampling: dict[str, Any] = {}
    if "sampling_parameters" in inputs:
        text = _bytes_item(np.ravel(inputs["sampling_parameters"])[0])
        try:
            sampling = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"sampling_parameters is not valid JSON: {exc}") from None
        if not isinstance(sampling, dict):
            raise InvalidRequestError("sampling_parameters must be a JSON object.")
    for key in ("temperature", "top_p", "max_tokens", "seed"):
        if key not in sampling and key in parameters:
            sampling[key] = parameters[key]
    params = SamplingParams(
        max_new_tokens=sampling.get("max_tokens", default_max_tokens),
        temperature=sampling.get("temperature", SamplingParams.temperature),
        top_p=sampling.get("top_p", SamplingParams.top_p),
        ignore_eos=bool(sampling.get("ignore_eos", False)),
        seed=sampling.get("seed"),
        reasoning=reasoning_mode(sampling.get("reasoning")),
        beams=sampling.get("beams", DEFAULT_BEAMS),
    )
    stream = _flag(inputs, parameters, "stream")
    exclude = _flag(inputs, parameters, "exclude_input_in_output")
    return GenerateCall(
        request=validate_request(data, question, params, limits),
        prompt=prompt,
        stream=bool(stream),
        # vLLM's rule: the prompt is prepended unless excluded, and never when streaming by default.
        prepend_prompt=(not exclude) if exclude is not None else not stream,
        return_finish_reason=bool(_flag(inputs, parameters, "return_finish_reason")),
        return_num_input_tokens=bool(_flag(inputs, parameters, "return_num_input_tokens")),
        return_num_output_tokens=bool(_flag(inputs, parameters, "return_num_output_tokens")),
    )


def _text_output(text: str) -> dict[str, np.ndarray]:
    return {"text_output": np.array([text.encode("utf-8")], dtype=np.object_)}


def generate_responses(engine: Any, call: GenerateCall) -> Iterator[dict[str, np.ndarray]]:
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
        kind = type(fields[key].default)
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


# ---- PyTriton wiring ----------------------------------------------------------------------------------


class _GenerateModel:
    """PyTriton's decoupled infer function: an async generator, so many streams run at once.

    PyTriton runs infer functions on one asyncio loop; a blocking generator would serialise every stream
    (and the engine could never batch them). Each request's engine stream is read by a thread that hands
    pieces to the loop.
    """

    def __init__(self, engine: Any, limits: Limits, default_max_tokens: int) -> None:
        self.engine = engine
        self.limits = limits
        self.default_max_tokens = default_max_tokens

    async def __call__(self, requests: list[Any]) -> Any:
        loop = asyncio.get_running_loop()
        for request in requests:  # Triton sends one request at a time to a model without batching
            pieces: asyncio.Queue = asyncio.Queue()
            stop = threading.Event()
            thread = threading.Thread(target=self._pump, args=(request, loop, pieces, stop), daemon=True)
            thread.start()
            try:
                while True:
                    kind, payload = await pieces.get()
                    if kind == "error":
                        raise RuntimeError(error_text(payload) if isinstance(payload, DemoError) else str(payload))
                    if kind == "end":
                        break
                    yield [payload]
            finally:
                stop.set()

    def _pump(
        self, request: Any, loop: asyncio.AbstractEventLoop, pieces: asyncio.Queue, stop: threading.Event
    ) -> None:
        def put(kind: str, payload: Any) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, (kind, payload))

        responses: Iterator[dict[str, np.ndarray]] | None = None
        try:
            call = decode_generate_request(dict(request), request.parameters, self.limits, self.default_max_tokens)
            responses = generate_responses(self.engine, call)
            for response in responses:
                if stop.is_set():
                    break
                put("data", response)
            put("end", None)
        except DemoError as exc:
            put("error", exc)
        except Exception as exc:  # noqa: BLE001 - reported to the client as a Triton error
            log.exception("generate request failed")
            put("error", exc)
        finally:
            if responses is not None:
                responses.close()


def _ensemble_fn(handler: EnsembleHandler) -> Any:
    """Run the blocking engine batch off PyTriton's event loop."""

    async def infer(requests: list[Any]) -> list[dict[str, np.ndarray]]:
        return await asyncio.get_running_loop().run_in_executor(None, handler, requests)

    return infer


def bind_models(triton: Any, engine: Any, config: Config) -> None:
    """Bind both contracts to a PyTriton ``Triton`` instance."""
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

    default_tokens = min(DEFAULT_MAX_NEW_TOKENS, config.max_new_tokens)
    handler = EnsembleHandler(engine, Limits.from_config(config), default_tokens)
    triton.bind(
        model_name=ENSEMBLE_MODEL,
        infer_func=_ensemble_fn(handler),
        inputs=[
            Tensor(name="IMAGE", dtype=np.uint8, shape=(-1, -1, 3)),
            Tensor(name="QUESTION", dtype=bytes, shape=(1,)),
            *[
                Tensor(name=n, dtype=bytes if t is np.object_ else t, shape=(1,), optional=True)
                for n, (t, _) in SAMPLING_INPUTS.items()
            ],
        ],
        outputs=[
            Tensor(name="ANSWER", dtype=bytes, shape=(1,)),
            Tensor(name="FINISH_REASON", dtype=bytes, shape=(1,)),
            Tensor(name="PROMPT_TOKENS", dtype=np.int32, shape=(1,)),
            Tensor(name="COMPLETION_TOKENS", dtype=np.int32, shape=(1,)),
            Tensor(name="ERROR", dtype=bytes, shape=(1,)),
        ],
        config=ModelConfig(
            max_batch_size=engine.max_batch_size,  # the engine sizes it (from memory when 0)
            # A short delay lets concurrent requests meet; a lone request waits at most this long.
            batcher=DynamicBatcher(max_queue_delay_microseconds=int(config.batch_window_ms * 1000)),
        ),
        strict=True,
    )
    triton.bind(
        model_name=GENERATE_MODEL,
        infer_func=_GenerateModel(engine, Limits.from_config(config), default_tokens),
        inputs=[
            Tensor(name="text_input", dtype=bytes, shape=(1,)),
            Tensor(name="image", dtype=bytes, shape=(-1,), optional=True),
            Tensor(name="sampling_parameters", dtype=bytes, shape=(1,), optional=True),
            *[Tensor(name=n, dtype=np.bool_, shape=(1,), optional=True) for n in GENERATE_FLAGS],
        ],
        outputs=[
            Tensor(name="text_output", dtype=bytes, shape=(-1,)),
            Tensor(name="finish_reason", dtype=bytes, shape=(-1,)),
            Tensor(name="num_input_tokens", dtype=np.uint32, shape=(-1,)),
            Tensor(name="num_output_tokens", dtype=np.uint32, shape=(-1,)),
        ],
        config=ModelConfig(batching=False, decoupled=True),
    )


def libdir_on_path() -> bool:
    """Whether this Python's LIBDIR is on ``LD_LIBRARY_PATH`` (the Python backend stub needs it)."""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    return libdir in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)


def _security() -> Any:
    """PyTriton token-protects statistics by default; they show Triton's batch sizes, so leave them readable
    and keep protecting the endpoints that change the server."""
    from pytriton.triton import TritonSecurityConfig

    return TritonSecurityConfig(restricted_endpoints=["shared-memory", "model-repository", "trace", "logging"])


def serve(config: Config, http_port: int, grpc_port: int, metrics_port: int, host: str) -> None:
    """Load the engine, start Triton with both models bound, and block until SIGTERM/SIGINT."""
    from pytriton.triton import Triton, TritonConfig

    from vlm_demo.engine import Engine

    engine = Engine.from_config(config)
    triton_config = TritonConfig(
        http_address=host, grpc_address=host, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port
    )
    try:
        with Triton(config=triton_config, security_config=_security()) as triton:
            bind_models(triton, engine, config)
            log.info(
                "Triton serving %s and %s on http://%s:%d and grpc://%s:%d",
                ENSEMBLE_MODEL,
                GENERATE_MODEL,
                host,
                http_port,
                host,
                grpc_port,
            )
            triton.serve()
    finally:
        engine.shutdown()


def cpu_copy_of_repository(repository: str, into: str) -> str:
    """A copy of ``repository`` whose GPU instance groups run on the CPU (for machines without a GPU)."""
    import re
    import shutil

    target = os.path.join(into, "model_repository")
    shutil.copytree(repository, target, ignore=shutil.ignore_patterns("__pycache__", "*.md"))
    for name in os.listdir(target):
        path = os.path.join(target, name, "config.pbtxt")
        if os.path.exists(path):
            with open(path) as f:
                text = f.read()
            text = re.sub(r"kind:\s*KIND_GPU", "kind: KIND_CPU", text)
            text = re.sub(r"\n\s*gpus:\s*\[[^\]]*\]", "", text)
            with open(path, "w") as f:
                f.write(text)
    return target


def serve_repository(
    repository: str, config: Config, http_port: int, grpc_port: int, metrics_port: int, host: str
) -> None:
    """Serve a classic model repository (``vlm_demo/triton_repo``) with the bundled tritonserver, no Docker.

    The Python-backend stubs inherit this environment: ``PYTHONPATH`` gets this package, and an explicit
    ``--model`` reaches ``model.py`` as ``VLM_MODEL`` (overriding ``config.pbtxt``).
    """
    import tempfile

    import torch
    from pytriton.triton import Triton, TritonConfig

    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH", "")) if p)
    if config.model_explicit:
        os.environ["VLM_MODEL"] = config.model
    if config.tiny_dir:
        os.environ["VLM_TINY_DIR"] = config.tiny_dir
    with tempfile.TemporaryDirectory() as scratch:
        if not torch.cuda.is_available():
            log.warning("no GPU: running the repository's KIND_GPU instances on the CPU")
            repository = cpu_copy_of_repository(repository, scratch)
        triton_config = TritonConfig(
            model_repository=repository,
            http_address=host,
            grpc_address=host,
            http_port=http_port,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
        )
        with Triton(config=triton_config, security_config=_security()) as triton:
            log.info("Triton serving %s on http://%s:%d and grpc://%s:%d", repository, host, http_port, host, grpc_port)
            triton.serve()


def build_arg_parser() -> argparse.ArgumentParser:
    parser = build_parser(
        "Serve the engine from Triton Inference Server (PyTriton): the ensemble and generate contracts.",
        only=[
            "model",
            "device",
            "dtype",
            "max_batch_size",
            "batch_window_ms",
            "max_queue",
            "max_new_tokens",
            "max_image_pixels",
            "max_question_chars",
            "batching",
            "tiny_dir",
        ],
    )
    parser.add_argument("--host", default="127.0.0.1", help="Bind address for HTTP and gRPC (default loopback).")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument(
        "--model-repository",
        default="",
        help="Serve this classic model repository (e.g. vlm_demo/triton_repo) instead of binding the engine in-process.",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not libdir_on_path():
        log.warning(
            "LD_LIBRARY_PATH lacks %s; Triton's Python backend may fail to start. Run: "
            "export LD_LIBRARY_PATH=$(python -c 'import sysconfig;print(sysconfig.get_config_var(\"LIBDIR\"))')",
            sysconfig.get_config_var("LIBDIR"),
        )
    config = config_from_namespace(args)
    ports = (args.http_port, args.grpc_port, args.metrics_port, args.host)
    if args.model_repository:
        serve_repository(args.model_repository, config, *ports)
    else:
        serve(config, *ports)


if __name__ == "__main__":
    main(sys.argv[1:])
