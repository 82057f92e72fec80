"""Triton Python-backend model: the ensemble contract (IMAGE + QUESTION -> ANSWER) run by our batching engine.

Each ``execute`` call receives the batch Triton's dynamic batcher formed; it becomes one engine batch. Needs
the ``vlm_demo`` package importable in the container (``pip install -r requirements.txt`` and
``PYTHONPATH=/app``). All decoding and response building is plain numpy in ``vlm_demo.triton.handlers``; this
file is only the glue to ``triton_python_backend_utils``, imported lazily so tests can load it without Triton.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

try:  # only exists inside Triton's Python backend
    import triton_python_backend_utils as pb_utils
except ImportError:  # unit tests substitute a stand-in
    pb_utils = None

from vlm_demo.config import Config
from vlm_demo.request import DEFAULT_MAX_NEW_TOKENS, Limits
from vlm_demo.triton.contract import INFER_INPUTS, INFER_OUTPUTS
from vlm_demo.triton.handlers import EnsembleHandler, config_from_model_config, instance_device

if TYPE_CHECKING:
    from vlm_demo.engine.batching.base import Engine

log = logging.getLogger(__name__)


def request_arrays(request: Any) -> dict[str, Any]:
    """The numpy inputs present in one Triton request (optional ones may be missing)."""
    arrays = {}
    for name in INFER_INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            arrays[name] = tensor.as_numpy()
    return arrays


class TritonPythonModel:
    """Loads one engine per instance and answers each Triton batch with one engine batch."""

    def initialize(self, args: dict[str, str]) -> None:
        from vlm_demo.engine import make_engine

        model_config = json.loads(args["model_config"])
        config = config_from_model_config(model_config)
        config.device = instance_device(args) or config.device
        log.info("loading %s on %s for %s", config.model, config.device, args.get("model_instance_name"))
        self.setup(make_engine(config), config)

    def setup(self, engine: Engine, config: Config) -> None:
        """Attach a loaded engine (separate from ``initialize`` so tests can pass one in)."""
        self.engine = engine
        self.handler = EnsembleHandler(
            engine, Limits.from_config(config), min(DEFAULT_MAX_NEW_TOKENS, config.max_new_tokens)
        )

    def execute(self, requests: list[Any]) -> list[Any]:
        outputs = self.handler([request_arrays(r) for r in requests])
        return [
            pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, out[name]) for name in INFER_OUTPUTS])
            for out in outputs
        ]

    def finalize(self) -> None:
        self.engine.shutdown()
