"""Loading a model into a :class:`~vlm_demo.engine.executor.worker.Worker`: where it comes from and where it goes.

Everything is checked before any weights are read, so a wrong setting fails in a second with one
sentence (:class:`~vlm_demo.errors.ModelLoadError`): ``--device cuda`` without CUDA, a ``--quantize``
format the GPU cannot run (FP8 on an A10G), a missing folder, an unreachable hub id, a checkpoint that is
not Mllama, a model the GPU cannot hold (:mod:`~vlm_demo.engine.weights.placement` decides where the weights go on
CUDA, :mod:`~vlm_demo.engine.weights.quantize` how they are stored). Running the model is the worker's business.
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

import vlm_demo.engine.weights.placement as placement
import vlm_demo.engine.weights.quantize as quantization
from vlm_demo.config import Config
from vlm_demo.engine.executor.worker import Worker
from vlm_demo.engine.kv.memory import AUTO_ROWS, AUTO_TOKENS, KVShape, most_precise_that_fits
from vlm_demo.engine.kv.pages import kv_dtype_for
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
    paged = config.batching == "continuous"  # the dynamic engine keeps the stock cache, in the model's dtype
    return load(
        config.model, config.device, config.dtype, config.tiny_dir, config.cpu_threads, progress, config.quantize,
        config.kv_cache_dtype if paged else "auto",
    )  # fmt: skip


def target_gpus(device: str) -> list[placement.Gpu]:
    """The GPUs the weights may go to: ``cuda:N``'s one, or every visible GPU for ``cuda``."""
    gpus = placement.visible_gpus()
    if device == "cuda":
        return gpus
    index = int(device.split(":", 1)[1])
    return [g for g in gpus if g.index == index]


def check_quantize(kind: str, device: str, gpus: list[placement.Gpu], dtype: torch.dtype) -> None:
    """Refuse a format a GPU the weights may go to cannot run, before anything is read (one sentence)."""
    if kind not in quantization.CHOICES:
        raise ModelLoadError(f"--quantize {kind} is not supported; use {', '.join(quantization.CHOICES)}.")
    cpu = quantization.problem(kind, False, None, "", dtype)  # what every device needs (torchao)
    if cpu:
        raise ModelLoadError(cpu)
    for gpu in gpus if device.startswith("cuda") else []:
        problem = quantization.problem(kind, True, gpu.capability, f"GPU {gpu.index} ({gpu.name})", dtype)
        if problem:
            raise ModelLoadError(problem)


def choose_quantize(kind: str, config: Any, device: str, gpus: list[placement.Gpu], dtype: torch.dtype,
                    kv_dtype: torch.dtype | None = None) -> str:  # fmt: skip
    """``auto``: none on CPU (no memory to save); on CUDA the most precise format the GPU runs that leaves room
    for ``AUTO_ROWS`` rows of ``AUTO_TOKENS`` tokens on the GPU with the most free memory."""
    if kind != "auto":
        return kind
    if not device.startswith("cuda") or not gpus:
        return "none"
    gpu = max(gpus, key=lambda g: g.free)
    kinds = quantization.usable(True, gpu.capability, dtype)
    meta = placement.meta_model(config)
    weights = {k: quantization.weight_bytes(meta, dtype, k, cuda=True) for k in kinds}
    chosen, rows = most_precise_that_fits(weights, KVShape.of(config, dtype, kv_dtype), gpu.free, gpu.total)
    if rows == 0:
        smallest = min(weights.values())
        raise ModelLoadError(
            f"--quantize auto: nothing GPU {gpu.index} ({gpu.name}, {gpu.free / placement.GiB:.1f} GiB free) runs "
            f"leaves room for one answer: even {min(weights, key=weights.__getitem__)} weights take "
            f"{smallest / placement.GiB:.1f} GiB; use a bigger GPU (python -m vlm_demo.tools.fit --gpu-memory SIZE)."
        )
    log.info(
        "--quantize auto: %s weights (%.1f GiB) on GPU %d (%s, %.1f GiB free) leave room for %d rows of %d tokens%s",
        chosen,
        weights[chosen] / placement.GiB,
        gpu.index,
        gpu.name,
        gpu.free / placement.GiB,
        rows,
        AUTO_TOKENS,
        "" if rows >= AUTO_ROWS else f" (fewer than {AUTO_ROWS}: no format this GPU runs leaves more)",
    )
    return chosen


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


def from_pretrained_kwargs(config: Any, dev: str, dtype: torch.dtype, kind: str) -> dict[str, Any]:
    """``from_pretrained``'s dtype, placement on the GPUs and quantization for this device and format."""
    cuda = dev.startswith("cuda")
    kwargs: dict[str, Any] = {"dtype": dtype}
    if cuda:
        weights = placement.weight_bytes(config, dtype, kind)
        kwargs.update(placement.load_kwargs(dev, weights, placement.visible_gpus(), dtype))
    if kind != "none":
        kwargs["quantization_config"] = quantization.load_config(placement.meta_model(config), kind, cuda)
        if not cuda and kind == "fp8":
            log.info("--quantize fp8 on CPU: FP8 weights, activations in %s (dynamic FP8 needs a GPU)", dtype)
    return kwargs


def load(
    model: str,
    device: str = "auto",
    dtype: str = "auto",
    tiny_dir: str | None = None,
    cpu_threads: int = 1,
    progress: Progress | None = None,
    quantize: str = "none",
    kv_cache_dtype: str = "auto",
) -> Worker:
    """Load weights and processor from a hub id or folder (``tiny`` builds the test model), the language
    model's linear layers quantized as ``quantize`` says and packed for its decode step
    (:mod:`~vlm_demo.engine.weights.quantize`; ``--quantize auto`` sizes the rows it leaves room for by
    ``kv_cache_dtype``'s pages).

    Raises :class:`ModelLoadError` (one sentence, no traceback needed) for ``--device cuda`` without CUDA,
    a format the GPU cannot run, a missing folder, an unreachable hub id, a checkpoint that is not Mllama,
    or a model that does not fit the GPU.
    """
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    cuda = dev.startswith("cuda")
    gpus = target_gpus(dev) if cuda else []
    check_quantize(quantize, dev, gpus, torch_dtype)
    if progress is not None:
        phase = "preparing the tiny test model" if model == "tiny" else f"finding {model}"
        progress(LoadProgress(phase, model=model))  # the loading page names the model chosen
    path = resolve_model_path(model, tiny_dir)
    config = load_model_config(path, model)
    kind = choose_quantize(quantize, config, dev, gpus, torch_dtype, kv_dtype_for(kv_cache_dtype, torch_dtype))
    if dev == "cpu" and cpu_threads > 0:
        # Small matmuls gain nothing from threads, and OpenMP threads that spin-wait for a
        # descheduled sibling make every step many times slower on a shared machine.
        torch.set_num_threads(cpu_threads)
    kwargs = from_pretrained_kwargs(config, dev, torch_dtype, kind)
    where = f"{dev}" if kind == "none" else f"{dev} as {kind} weights"
    ticker = _Ticker(progress, f"loading {model} onto {where}", last_load_seconds(model, where))
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
    if cuda:
        placement.check_on_gpus(net)
    else:
        net.to(dev)  # type: ignore[arg-type]  # transformers' typing of its wrapped to() takes no device
    quantization.pack(net, kind, cuda)  # the language model's layers into the layout its decode step reads
    net.eval()
    places = sorted({str(p.device) for p in net.parameters()})
    weights_as = quantization.weights_label(net)
    log.info("loaded %s on %s (%s, %s weights) in %.1f s", model, ", ".join(places), torch_dtype, weights_as, seconds)
    _remember_load_seconds(model, where, seconds)
    return Worker(net, processor, model)
