"""Which model the server runs, and the banner that says so when it is not the real one.

Torch-free: the decision is made where the model loads (the engine process asks CUDA), and the web
process only shows the outcome.
"""

from __future__ import annotations

import dataclasses
import logging

from vlm_demo.config import TINY, Config

log = logging.getLogger(__name__)

REAL_MODEL_HINT = (
    "To run the real model, use a machine with a CUDA GPU (40 GB or more for bf16, see the README) and start "
    "`python app.py --model Xkev/Llama-3.2V-11B-cot`."
)


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
    if not cuda and not config.model_explicit and config.model != TINY:
        log.warning("no CUDA GPU and no --model given: serving the tiny test model instead of %s", config.model)
        notice = (
            "**⚠ No GPU found, so this page runs the tiny offline test model**, not Llama-3.2V-11B-cot. "
            "It only knows solid-colour images (try the colour examples). " + REAL_MODEL_HINT
        )
        return dataclasses.replace(config, model=TINY), notice
    if config.model == TINY:
        return config, (
            "**⚠ This page runs the tiny offline test model** (`--model tiny`): it only knows solid-colour "
            "images. " + REAL_MODEL_HINT
        )
    return config, None
