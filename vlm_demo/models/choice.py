"""Which model the server runs, and the banner that says so when it is not the real one.

Torch-free: the decision is made where the model loads (the engine process asks CUDA). The web process
foresees it without torch (:func:`planned_model`), so the loading page and ``/health`` name the model that
loads from the first second, not the 11B one a machine without a GPU never loads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

from vlm_demo.config import DEFAULT_MODEL, TINY, Config

log = logging.getLogger(__name__)

# What the tiny model can do, said wherever the page runs it (one sentence, so the banners agree).
TINY_LIMITS = (
    "It is a toy that only knows plain colours: it names the one colour of a solid-colour picture (red, green, "
    "blue, yellow, white or black), and answers follow-up questions by looking again."
)
REAL_MODEL_HINT = (
    "To run the real model, use a machine with a CUDA GPU (40 GB or more for bf16, see docs/gpu.md) and start "
    "`python app.py --model Xkev/Llama-3.2V-11B-cot`."
)


def looks_like_path(model: str) -> bool:
    """A filesystem path, never a hub id: starts with ``/``, ``.`` or ``~``, has a path separator
    other than the one ``/`` of ``org/name``, or names an existing folder."""
    separators = {sep for sep in (os.sep, os.altsep) if sep and sep != "/"}
    return (
        model.startswith(("/", ".", "~"))
        or model.count("/") > 1
        or any(sep in model for sep in separators)
        or os.path.isdir(model)
    )


def folder_problem(model: str) -> str | None:
    """What is wrong with ``--model`` as a folder (it does not exist), said at once, in the web process,
    before an engine process spends seconds importing torch to find out; ``None``: nothing (or a hub id)."""
    if model == TINY or not looks_like_path(model):
        return None
    path = os.path.expanduser(model)
    if not os.path.isdir(path):
        return f"The model folder {path} does not exist (--model takes a folder, a hub id or 'tiny')."
    return None


def no_gpu_here() -> bool:
    """Whether this machine certainly has no CUDA GPU, told without torch (which takes seconds to import): macOS,
    ``CUDA_VISIBLE_DEVICES`` that hides every GPU, or Linux without NVIDIA's device files (``/dev/nvidiactl``;
    ``/dev/dxg`` is WSL's GPU). False means "maybe": the engine process asks CUDA itself."""
    if sys.platform == "darwin":
        return True
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return True
    return sys.platform.startswith("linux") and not any(os.path.exists(d) for d in ("/dev/nvidiactl", "/dev/dxg"))


def falls_back_to_tiny(config: Config, cuda: bool) -> bool:
    """No GPU and nobody asked for a model (nor for a GPU, nor for Triton): the tiny model runs."""
    return (
        not cuda
        and not config.triton_url
        and not config.device.startswith("cuda")
        and not config.model_explicit
        and config.model != TINY
    )


def planned_model(config: Config) -> str:
    """The model a start will load, as far as the web process can tell before the engine process has asked CUDA
    (where that cannot be told, the configured one; the engine's choice replaces it as soon as it is made)."""
    return TINY if falls_back_to_tiny(config, cuda=not no_gpu_here()) else config.model


def choose_model(config: Config, cuda: bool | None = None) -> tuple[Config, str | None]:
    """Fall back to the tiny model when there is no GPU and nobody asked for a model; say so.

    Returns the config to build the engine from and the banner text for the page (``None`` when
    the real model runs). Loading 21 GB of weights on a CPU would take many minutes and then answer
    at seconds per token, so a working page with an honest banner is the better default.
    """
    if cuda is None:
        import torch  # only where the model loads

        cuda = torch.cuda.is_available()
    if config.triton_url:
        return config, None
    if not cuda and config.device.startswith("cuda"):
        return config, None  # asked for a GPU there is none of: the loader says so in one line, no fallback
    if falls_back_to_tiny(config, cuda):
        log.warning("no CUDA GPU and no --model given: serving the tiny test model instead of %s", config.model)
        notice = (
            "**⚠ No GPU found, so this page runs the tiny offline test model**, not Llama-3.2V-11B-cot. "
            f"{TINY_LIMITS} Try the colour examples.\n\n{REAL_MODEL_HINT}"
        )
        return dataclasses.replace(config, model=TINY), notice
    if config.model == TINY:
        return config, tiny_notice("`--model tiny`", REAL_MODEL_HINT)
    return config, None


def tiny_notice(how: str, hint: str) -> str:
    """The banner for the tiny model: ``how`` it came to run, ``hint`` how to run the real one."""
    return f"**⚠ This page runs the tiny offline test model** ({how}). {TINY_LIMITS}\n\n{hint}"


def remote_notice(served_model: str | None, url: str) -> str | None:
    """The banner for a remote (Triton) model that says which model it runs: the tiny one's, else none (a
    model that does not say, such as a third-party one, is taken to be the real thing)."""
    if served_model != TINY:
        return None
    hint = (
        "To run the real model, start the Triton server on a machine with a CUDA GPU (40 GB or more for bf16, "
        f"see docs/gpu.md): `python -m vlm_demo.triton.serve --model {DEFAULT_MODEL}`."
    )
    return tiny_notice(f"the Triton server at {url} runs `--model tiny`", hint)
