"""The judge of stage-level beam search: the prompt that asks the model to pick one of two candidates.

LLaVA-CoT's paper lets the model judge its own candidates stage by stage. The rubric here is ours: each
stage is judged on what that stage is for. The answer format follows the paper's ("Since [reason], I
choose response [1/2].") so the real model's habit carries over; :func:`parse_choice` reads it leniently
and never raises, because a judge is a sampled text like any other.
"""

from __future__ import annotations

import re

# What makes one candidate of a stage better than another (stage names as in ``vlm_demo.cot.stages.STAGES``).
RUBRIC: dict[str, str] = {
    "summary": "plans more clearly how to answer the question",
    "caption": "describes what the image shows more accurately",
    "reasoning": "reasons more correctly from the image to the answer",
    "conclusion": "gives the correct final answer to the question",
}

# The choice. The judge's answer ends at its first match (the engine stops the row there).
CHOICE = re.compile(r"choose\s+(?:the\s+)?response\s*\[?\s*([12])\b", re.IGNORECASE)


def judge_question(stage: str, question: str, first: str, second: str) -> str:
    """The judge's user turn (the image goes before it, as in the answer's own prompt).

    The instruction comes first and the candidates last, so the answer starts right after response 2.
    """
    name = stage.upper()
    return (
        f"You are a judge. Two responses give the {name} stage of an answer to the question below. "
        f"Choose the better one: the one that {RUBRIC[stage]}. "
        "Answer in the form: Since [reason], I choose response [1/2].\n"
        f"Question: {question}\n"
        f"Response 1: {first}\n"
        f"Response 2: {second}"
    )


def parse_choice(text: str) -> int | None:
    """0 for response 1, 1 for response 2, ``None`` when the judge named neither (the caller keeps the first)."""
    matches = CHOICE.findall(text)
    return int(matches[-1]) - 1 if matches else None
