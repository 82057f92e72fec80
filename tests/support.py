"""Small helpers shared by the test modules (importable because pytest puts ``tests/`` on the path)."""

from __future__ import annotations

from typing import Any

from vlm_demo.schema import Limits, SamplingParams, ValidRequest, validate_request

TEST_LIMITS = Limits(max_new_tokens=10_000)  # long forced answers in the engine tests


def door(image: Any, question: Any, params: SamplingParams | None = None) -> ValidRequest:
    """The shared door with generous limits: what every backend's caller does before submitting."""
    return validate_request(image, question, params, TEST_LIMITS)
