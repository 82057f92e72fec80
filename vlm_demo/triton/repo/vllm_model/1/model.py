"""Triton Python-backend model: the generate contract of Triton's vLLM backend, decoupled, run by our engine.

``execute`` returns at once; each request streams from its own thread through its response sender, so many
streams run together and the engine batches them. A client that cancels (gRPC stream stop) is noticed via
``sender.is_cancelled()`` and its engine row is freed. ``triton_python_backend_utils`` is imported lazily so
tests can load this file without Triton.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any

try:  # only exists inside Triton's Python backend
    import triton_python_backend_utils as pb_utils
except ImportError:  # unit tests substitute a stand-in
    pb_utils = None

from vlm_demo.config import Config
from vlm_demo.errors import DemoError, GenerationError
from vlm_demo.request import DEFAULT_MAX_NEW_TOKENS, Limits
from vlm_demo.triton.contract import GENERATE_INPUTS, error_text
from vlm_demo.triton.handlers import (
    config_from_model_config,
    decode_generate_request,
    generate_responses,
    instance_device,
)

if TYPE_CHECKING:
    from vlm_demo.engine.batching.base import Engine

log = logging.getLogger(__name__)


def request_arrays(request: Any) -> dict[str, Any]:
    arrays = {}
    for name in GENERATE_INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            arrays[name] = tensor.as_numpy()
    return arrays


def request_parameters(request: Any) -> dict[str, Any]:
    """Request parameters (``{"parameters": {...}}`` on /generate) as a dict."""
    try:
        return json.loads(request.parameters() or "{}")
    except (AttributeError, ValueError):
        return {}


class TritonPythonModel:
    """One engine per instance; one streaming thread per request."""

    def initialize(self, args: dict[str, str]) -> None:
        from vlm_demo.engine import make_engine

        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise ValueError("vllm_model must be decoupled: model_transaction_policy { decoupled: true }")
        config = config_from_model_config(model_config)
        config.device = instance_device(args) or config.device
        self.setup(make_engine(config), config)

    def setup(self, engine: Engine, config: Config) -> None:
        """Attach a loaded engine (separate from ``initialize`` so tests can pass one in)."""
        self.engine = engine
        self.limits = Limits.from_config(config)
        self.default_tokens = min(DEFAULT_MAX_NEW_TOKENS, config.max_new_tokens)

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            threading.Thread(target=self.respond, args=(request,), daemon=True).start()
        return None

    def respond(self, request: Any) -> None:
        """Stream one request's responses, then the FINAL flag; errors go back as a Triton error."""
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        responses = None
        try:
            call = decode_generate_request(
                request_arrays(request), request_parameters(request), self.limits, self.default_tokens
            )
            responses = generate_responses(self.engine, call)
            for outputs in responses:
                if sender.is_cancelled():
                    log.info("client cancelled a generate request")
                    break
                sender.send(
                    pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in outputs.items()])
                )
            sender.send(flags=final)
        except Exception as exc:  # noqa: BLE001 - every failure must reach the client, typed
            error = exc if isinstance(exc, DemoError) else GenerationError(f"Generation failed: {exc}")
            if not isinstance(exc, DemoError):
                log.exception("generate request failed")
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(error_text(error))), flags=final)
        finally:
            if responses is not None:
                responses.close()  # frees the engine row if we stopped early

    def finalize(self) -> None:
        self.engine.shutdown()
