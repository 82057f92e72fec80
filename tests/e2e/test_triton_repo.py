"""The classic model repository (``vlm_demo/triton/repo``): its ``model.py`` glue and a real tritonserver on it.

``model.py`` needs ``triton_python_backend_utils``, which exists only inside Triton; ``StandInPbUtils`` below
stands in for that module (not a fault injection) so ``execute`` runs here with the real engine. The slow
test then serves the repository itself with PyTriton's bundled tritonserver (GPU instance groups moved to the
CPU) and calls it through the demo's Triton backend.
"""

from __future__ import annotations

import importlib.util
import json
import re
import types
from pathlib import Path

import numpy as np
import pytest
from support import door, start_triton, stop_triton

from vlm_demo.backends.triton.backend import TritonBackend
from vlm_demo.backends.triton.generate import encode_image
from vlm_demo.config import Config
from vlm_demo.engine.batching.base import Engine as BaseEngine
from vlm_demo.engine.batching.dynamic import DynamicEngine
from vlm_demo.errors import InvalidRequestError
from vlm_demo.models.tiny import solid_image
from vlm_demo.request import SamplingParams
from vlm_demo.triton.contract import ENSEMBLE_MODEL, GENERATE_MODEL, chat_prompt, error_from_text
from vlm_demo.triton.serve import local_copy_of_repository

REPO = Path(__file__).resolve().parents[2] / "vlm_demo" / "triton" / "repo"
GREEDY = SamplingParams(max_new_tokens=160, temperature=0.0)
FINAL = 1


class StandInPbUtils(types.SimpleNamespace):
    """The few parts of ``triton_python_backend_utils`` that model.py uses, over plain numpy."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL

    class Tensor:
        def __init__(self, name: str, array: np.ndarray) -> None:
            self.name, self.array = name, array

        def as_numpy(self) -> np.ndarray:
            return self.array

    class InferenceResponse:
        def __init__(self, output_tensors=None, error=None) -> None:
            self.outputs = {t.name: t.array for t in output_tensors or []}
            self.error = error

    class TritonError(str):
        pass

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return StandInPbUtils.Tensor(name, request.arrays[name]) if name in request.arrays else None

    @staticmethod
    def using_decoupled_model_transaction_policy(model_config) -> bool:
        return bool(model_config.get("model_transaction_policy", {}).get("decoupled"))


class StandInRequest:
    def __init__(self, arrays: dict[str, np.ndarray], cancel_after: int | None = None) -> None:
        self.arrays = arrays
        self.sent: list[tuple[object, int]] = []
        self.cancel_after = cancel_after

    def parameters(self) -> str:
        return "{}"

    def get_response_sender(self):
        return self

    def send(self, response=None, flags: int = 0) -> None:
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.sent) >= self.cancel_after


def load_model_py(model: str, engine: BaseEngine):
    """Import ``model.py`` from the repository and give its ``TritonPythonModel`` our engine."""
    spec = importlib.util.spec_from_file_location(f"repo_{model}", REPO / model / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.pb_utils is None  # imported outside Triton without failing
    module.pb_utils = StandInPbUtils()
    instance = module.TritonPythonModel()
    return module, instance


@pytest.fixture(scope="module")
def engine(worker):
    eng = DynamicEngine(worker, Config(stream_every_ms=0)).start()  # every token on its own: model.py streams it so
    yield eng
    eng.shutdown()


def _model_config(model: str) -> dict:
    """The handful of config.pbtxt fields model.py reads, as Triton passes them (JSON)."""
    text = (REPO / model / "config.pbtxt").read_text()
    decoupled = "decoupled: true" in text
    batch = int(text.split("max_batch_size:")[1].split()[0])
    return {"max_batch_size": batch, "model_transaction_policy": {"decoupled": decoupled}, "parameters": {}}


def test_ensemble_model_py_answers_a_batch_and_isolates_a_bad_request(engine):
    module, model = load_model_py(ENSEMBLE_MODEL, engine)
    model.setup(engine, Config(max_image_pixels=10_000, max_new_tokens=160))
    good = [("red", "What colour?"), ("yellow", "Which colour is this?")]
    requests = [
        StandInRequest({"IMAGE": np.asarray(solid_image(c, 24, 24))[None], "QUESTION": np.array([[q.encode()]], dtype=object),
                        "temperature": np.array([[0.0]], np.float32), "max_new_tokens": np.array([[160]], np.int32)})
        for c, q in good
    ]  # fmt: skip
    requests.insert(
        1,
        StandInRequest(
            {"IMAGE": np.zeros((1, 200, 200, 3), np.uint8), "QUESTION": np.array([[b"big?"]], dtype=object)}
        ),
    )
    responses = model.execute(requests)
    assert len(responses) == 3
    assert isinstance(error_from_text(responses[1].outputs["ERROR"][0, 0].decode()), InvalidRequestError)
    for (colour, question), response in zip(good, [responses[0], responses[2]], strict=True):
        expected = engine.generate(door(solid_image(colour, 24, 24), question, GREEDY)).text
        assert response.outputs["ANSWER"][0, 0].decode() == expected and response.outputs["ERROR"][0, 0] == b""
        assert response.outputs["BATCH_SIZE"][0, 0] == 2 and response.outputs["DECODE_S"][0, 0] > 0


def _generate_request(question: str, **extra) -> dict[str, np.ndarray]:
    sampling = json.dumps({"temperature": 0, "max_tokens": 160})
    return {
        "text_input": np.array([chat_prompt(question).encode()], dtype=object),
        "image": np.array([encode_image(solid_image("green", 30, 20)).encode()], dtype=object),
        "sampling_parameters": np.array([sampling.encode()], dtype=object),
        "stream": np.array([True]),
        "exclude_input_in_output": np.array([True]),
        **extra,
    }


def test_generate_model_py_streams_stops_on_cancel_and_reports_errors(engine):
    module, model = load_model_py(GENERATE_MODEL, engine)
    model.setup(engine, Config(max_image_pixels=10_000, max_new_tokens=160))
    expected = engine.generate(door(solid_image("green", 30, 20), "Colour?", GREEDY)).text

    full = StandInRequest(_generate_request("Colour?", return_finish_reason=np.array([True])))
    model.respond(full)
    pieces = [r.outputs["text_output"][0].decode() for r, _ in full.sent if r is not None]
    assert "".join(pieces) == expected and len(pieces) > 10
    assert full.sent[-2][0].outputs["finish_reason"][0] == b"stop"
    assert full.sent[-1] == (None, FINAL)

    cancelled = StandInRequest(_generate_request("Colour?"), cancel_after=3)
    model.respond(cancelled)
    assert len(cancelled.sent) == 4 and cancelled.sent[-1] == (None, FINAL)
    assert engine.stats().queue_depth == 0

    bad = StandInRequest({**_generate_request("Colour?"), "image": np.array([b"not base64!"], dtype=object)})
    model.respond(bad)
    ((response, flags),) = bad.sent
    assert flags == FINAL and isinstance(error_from_text(response.error), InvalidRequestError)


def test_the_local_copy_names_the_model_and_moves_gpu_instances_to_the_cpu(tmp_path):
    copy = Path(local_copy_of_repository(str(REPO), str(tmp_path), "tiny", cpu=True))
    for model in (ENSEMBLE_MODEL, GENERATE_MODEL):
        text = (copy / model / "config.pbtxt").read_text()
        assert 'key: "model" value: { string_value: "tiny" }' in text and "Xkev" not in text
        assert not re.search(r"^\s*(kind: KIND_GPU|gpus:)", text, re.M) and "kind: KIND_CPU" in text
    kept = Path(local_copy_of_repository(str(REPO), str(tmp_path / "as_is"), None, cpu=False))
    assert (kept / ENSEMBLE_MODEL / "config.pbtxt").read_text() == (REPO / ENSEMBLE_MODEL / "config.pbtxt").read_text()


@pytest.mark.slow
def test_real_tritonserver_serves_the_repository(tiny_dir, tmp_path, engine):
    """The shipped config.pbtxt files load in a real tritonserver and both contracts answer like the engine."""
    args = ["--model", "tiny", "--tiny-dir", tiny_dir, "--model-repository", str(REPO)]
    proc, http, grpc = start_triton(args, [ENSEMBLE_MODEL, GENERATE_MODEL], tmp_path / "repo.log")
    try:
        image = solid_image("white", 40, 64)
        expected = engine.generate(door(image, "What colour is it?", GREEDY)).text
        for url, model in ((f"http://127.0.0.1:{http}", ENSEMBLE_MODEL), (f"grpc://127.0.0.1:{grpc}", GENERATE_MODEL)):
            backend = TritonBackend.from_config(Config(triton_url=url, triton_model=model, triton_timeout=60))
            result = backend.submit(door(image, "What colour is it?", GREEDY)).result(90)
            assert result.text == expected and result.batch_size == 1 and result.decode_s > 0
            assert "`--model tiny`" in (backend.notice or "")  # --model reached the config's model parameter
    finally:
        stop_triton(proc, http)
