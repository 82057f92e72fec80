"""Hugging Face ZeroGPU: the demo on the shared GPUs most Spaces run on, where a GPU is lent to one decorated
function call at a time (``spaces.GPU``).

On a ZeroGPU Space the web process loads the weights at start-up (the ``spaces`` package registers them and,
in its start-up hook, packs them) but never builds an engine or touches CUDA. Every answer runs inside a GPU
call (:mod:`~vlm_demo.backends.zerogpu.backend`): the ``spaces`` package forks a worker process that gets the
GPU, moves the weights onto it and runs :mod:`~vlm_demo.backends.zerogpu.calls` there, whose engine lives on in
that worker while it stays warm; how long each call asks for is :mod:`~vlm_demo.backends.zerogpu.duration`'s.
"""

from __future__ import annotations


def enabled() -> bool:
    """ZeroGPU mode, on by itself on a ZeroGPU Space (``SPACES_ZERO_GPU`` true), as the ``spaces`` package reads it."""
    from spaces.config import Config

    return Config.zero_gpu
