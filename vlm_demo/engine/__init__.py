"""Our batching engine for Mllama: request -> scheduler -> worker (+ per-row streamer/sampler)."""

from vlm_demo.engine.engine import Engine
from vlm_demo.engine.request import GenerationResult, Request, SamplingParams, ValidRequest

__all__ = ["Engine", "GenerationResult", "Request", "SamplingParams", "ValidRequest"]
