"""Loading a model into a :class:`~vlm_demo.engine.worker.Worker`: where it comes from and where it goes.

Everything is checked before any weights are read, so a wrong setting fails in a second with one
sentence (:class:`~vlm_demo.errors.ModelLoadError`): a missing folder, an unreachable hub id,
``--device cuda`` without CUDA, a checkpoint that is not Mllama, a model the GPU cannot hold
(:mod:`~vlm_demo.engine.placement` decides where the weights go on CUDA). Running the model is the
worker's business.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoConfig, AutoProcessor, MllamaForConditionalGeneration

import vlm_demo.engine.placement as placement
from vlm_demo.config import Config
from vlm_demo.engine.worker import Worker
from vlm_demo.errors import ModelLoadError
from vlm_demo.models.choice import folder_problem, looks_like_path
from vlm_demo.results import LoadProgress

log = logging.getLogger(__name__)

DTYPES = ("bfloat16", "float16", "float32")


def resolve_device(device: str) -> str:
    """``auto`` picks CUDA when present; an explicit ``cuda``/``cuda:N`` without CUDA is an error, not
    a silent CPU run."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ModelLoadError(
                f"--device {device} was given but PyTorch sees no CUDA GPU (torch {torch.__version__}, "
                f"CUDA build {torch.version.cuda or 'none'}); use --device cpu or --device auto."
            )
        if device != "cuda":
            index = device.split(":", 1)[1]
            if not index.isdigit() or int(index) >= torch.cuda.device_count():
                raise ModelLoadError(f"--device {device}: there is no such GPU ({torch.cuda.device_count()} visible).")
    elif device != "cpu":
        raise ModelLoadError(f"--device {device} is not supported; use auto, cpu, cuda or cuda:N.")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """bf16 on GPU (the checkpoint's dtype), fp32 on CPU (bf16 matmuls are slow and lossy there)."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"--dtype {dtype} is not supported; use auto, {', '.join(DTYPES)}.")
    return getattr(torch, dtype)


def resolve_model_path(model: str, tiny_dir: str | None = None) -> str:
    """``tiny`` means the offline test model, built once into its cache folder; a path must exist."""
    if model == "tiny":
        from vlm_demo.models.tiny import ensure_tiny

        return ensure_tiny(tiny_dir or None)
    problem = folder_problem(model)
    if problem:
        raise ModelLoadError(problem)
    return os.path.expanduser(model) if looks_like_path(model) else model


def hub_error(model: str, exc: Exception) -> ModelLoadError:
    """One sentence for a hub id that could not be fetched (offline, unknown, gated)."""
    text = str(exc)
    if "connect" in text or "offline" in text.lower():
        return ModelLoadError(
            f"Could not download {model} from the Hugging Face Hub: no network (or HF_HUB_OFFLINE is set) and it is "
            f"not in the local cache; pass a local copy with --model /path/to/folder, or --model tiny for the "
            f"offline test model."
        )
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return ModelLoadError(f"Could not load {model} from the Hugging Face Hub ({first}).")


def load_model_config(path: str, model: str) -> Any:
    """The checkpoint's config, read before any weights so a wrong ``--model`` fails in a second."""
    local = os.path.isdir(path)
    if local and not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"{path} is not a model folder: it has no config.json.")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        if local:
            raise ModelLoadError(f"Could not read the model config in {path}: {exc}") from exc
        raise hub_error(model, exc) from exc
    if config.model_type != "mllama":
        raise ModelLoadError(
            f"{model} is a '{config.model_type}' checkpoint, not Mllama (Llama-3.2-Vision, which "
            f"Llama-3.2V-11B-cot is); this demo serves Mllama checkpoints only."
        )
    return config


Progress = Callable[[LoadProgress], None]
LOAD_TIMES = os.path.join(os.path.expanduser("~"), ".cache", "vlm_demo", "load_seconds.json")


def load_worker(config: Config, progress: Progress | None = None) -> Worker:
    """The worker for ``config``'s model, device and dtype (``--model tiny`` builds the test model)."""
    return load(config.model, config.device, config.dtype, config.tiny_dir, config.cpu_threads, progress)


def last_load_seconds(model: str, device: str) -> float | None:
    """How long this model took to load on this kind of device last time (for an ETA), if it ever loaded."""
    try:
        with open(LOAD_TIMES) as fh:
            return float(json.load(fh)[f"{model} on {device}"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remember_load_seconds(model: str, device: str, seconds: float) -> None:
    try:
        with open(LOAD_TIMES) as fh:
            times = json.load(fh)
    except (OSError, ValueError):
        times = {}
    times[f"{model} on {device}"] = round(seconds, 1)
    try:
        os.makedirs(os.path.dirname(LOAD_TIMES), exist_ok=True)
        with open(LOAD_TIMES, "w") as fh:
            json.dump(times, fh)
    except OSError:  # a read-only home: no ETA next time, nothing worse
        log.debug("could not remember the load time", exc_info=True)


class _Ticker:
    """Reports a long phase every few seconds while it runs, its ETA from the last time it ran."""

    def __init__(self, progress: Progress | None, phase: str, expected: float | None, every: float = 2.0) -> None:
        self.progress, self.phase, self.expected, self.every = progress, phase, expected, every
        self.started = time.monotonic()
        self._done = threading.Event()
        self._tick()
        if progress is not None:
            threading.Thread(target=self._run, name="vlm-load-progress", daemon=True).start()

    def _tick(self) -> None:
        if self.progress is None:
            return
        elapsed = time.monotonic() - self.started
        eta = max(0.0, self.expected - elapsed) if self.expected else None
        fraction = min(0.99, elapsed / self.expected) if self.expected else None
        self.progress(LoadProgress(self.phase, fraction, eta))

    def _run(self) -> None:
        while not self._done.wait(self.every):
            self._tick()

    def stop(self) -> float:
        self._done.set()
        return time.monotonic() - self.started


def load(
    model: str,
    device: str = "auto",
    dtype: str = "auto",
    tiny_dir: str | None = None,
    cpu_threads: int = 1,
    progress: Progress | None = None,
) -> Worker:
    """Load weights and processor from a hub id or folder (``tiny`` builds the test model).

    Raises :class:`ModelLoadError` (one sentence, no traceback needed) for a missing folder, an
    unreachable hub id, ``--device cuda`` without CUDA, a checkpoint that is not Mllama, or a
    model that does not fit the GPU.
    """
    if progress is not None:
        progress(LoadProgress("preparing the tiny test model" if model == "tiny" else f"finding {model}"))
    path = resolve_model_path(model, tiny_dir)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    config = load_model_config(path, model)
    if dev == "cpu" and cpu_threads > 0:
        # Small matmuls gain nothing from threads, and OpenMP threads that spin-wait for a
        # descheduled sibling make every step many times slower on a shared machine.
        torch.set_num_threads(cpu_threads)
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if dev.startswith("cuda"):
        weights = placement.weight_bytes(config, torch_dtype)
        kwargs.update(placement.load_kwargs(dev, weights, placement.visible_gpus(), torch_dtype))
    ticker = _Ticker(progress, f"loading {model} onto {dev}", last_load_seconds(model, dev))
    try:
        net = MllamaForConditionalGeneration.from_pretrained(path, config=config, **kwargs)
        processor = AutoProcessor.from_pretrained(path)
    except torch.OutOfMemoryError as exc:
        raise ModelLoadError(f"The GPU ran out of memory while loading {model}: {str(exc).splitlines()[0]}") from exc
    except (OSError, ValueError) as exc:  # unreadable files; accelerate refusing a placement
        if os.path.isdir(path):
            raise ModelLoadError(f"Could not load the model in {path}: {str(exc).splitlines()[0]}") from exc
        raise hub_error(model, exc) from exc
    finally:
        seconds = ticker.stop()
    if dev.startswith("cuda"):
        placement.check_on_gpus(net)
    else:
        net.to(dev)
    net.eval()
    where = sorted({str(p.device) for p in net.parameters()})
    log.info("loaded %s on %s (%s) in %.1f s", model, ", ".join(where), torch_dtype, seconds)
    _remember_load_seconds(model, dev, seconds)
    return Worker(net, processor, model)
