"""Loading fails with one sentence saying what is wrong and what to do, through the real loading code."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from vlm_demo.config import Config
from vlm_demo.engine import make_engine
from vlm_demo.engine.executor.decode_step import pageable
from vlm_demo.engine.executor.worker import Worker
from vlm_demo.engine.weights.loader import load
from vlm_demo.errors import ModelLoadError
from vlm_demo.models.choice import looks_like_path


def load_error(model: str, **kwargs) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        load(model, **kwargs)
    error = info.value
    assert error.code == "model_load_failed"
    assert "\n" not in str(error) and "Traceback" not in str(error)
    return error


@pytest.mark.parametrize("model", ["/nonexistent/folder", "./not-here", "~/no/such/model", "a/b/c"])
def test_a_missing_folder_is_named_and_never_tried_as_a_hub_id(model) -> None:
    message = str(load_error(model, device="cpu"))
    assert "does not exist" in message and "Hub" not in message


def test_path_or_hub_id() -> None:
    assert (
        looks_like_path("/models/x") and looks_like_path("~/x") and looks_like_path("./x") and looks_like_path("a/b/c")
    )
    assert not looks_like_path("Xkev/Llama-3.2V-11B-cot") and not looks_like_path("gpt2")


def test_an_unreachable_hub_id_says_offline_and_suggests_a_folder_or_tiny(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # conftest sets it too; huggingface_hub read it at import
    message = str(load_error("Xkev/Llama-3.2V-11B-cot", device="cpu"))
    assert "Could not download Xkev/Llama-3.2V-11B-cot" in message
    assert "--model /path/to/folder" in message and "--model tiny" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_fails_instead_of_running_on_cpu(tiny_dir, device) -> None:
    message = str(load_error(tiny_dir, device=device))
    assert f"--device {device}" in message and "no CUDA GPU" in message and "--device cpu" in message


def test_a_folder_with_another_architecture_is_refused(tmp_path) -> None:
    LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(
        tmp_path
    )
    message = str(load_error(str(tmp_path), device="cpu"))
    assert "'llama' checkpoint, not Mllama" in message


def test_a_folder_without_a_config_is_refused(tmp_path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0")
    assert "has no config.json" in str(load_error(str(tmp_path), device="cpu"))


def test_the_engine_reports_the_same_error(tmp_path) -> None:
    """``Engine.from_config`` (what the engine process runs) raises the error, for a one-line ``Fatal``."""
    with pytest.raises(ModelLoadError, match="does not exist"):
        make_engine(Config(model=str(tmp_path / "missing"), device="cpu"))


def test_the_tiny_model_still_loads(tiny_dir) -> None:
    worker = load(tiny_dir, device="cpu")
    assert worker.device == torch.device("cpu") and worker.dtype == torch.float32


def test_inputs_go_where_the_embedding_is_not_where_the_first_weight_is(tiny_dir, tmp_path) -> None:
    """A model spread by ``device_map``: here the vision tower is offloaded (its weights on ``meta``),
    so the first parameter is not where the text model runs; inputs follow the token embedding."""
    from transformers import AutoProcessor, MllamaForConditionalGeneration

    spread = {"model.vision_model": "disk", "model.multi_modal_projector": "cpu", "model.language_model": "cpu"}
    model = MllamaForConditionalGeneration.from_pretrained(
        tiny_dir, device_map={**spread, "lm_head": "cpu"}, offload_folder=str(tmp_path)
    )
    assert next(model.parameters()).device.type == "meta"
    worker = Worker(model, AutoProcessor.from_pretrained(tiny_dir), "spread")
    assert worker.device == torch.device("cpu")
    assert pageable(model)  # the text layers sit on a device: the engine's paged step runs them (vision offloaded)
