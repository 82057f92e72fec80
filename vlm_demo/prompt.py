"""The conversation as the model reads it: earlier turns about the same picture, the caps on them, and the
chat-template messages the engine renders (Mllama's template puts the image in the first user turn).

Torch-free and without the door's rules (:mod:`vlm_demo.request` checks a caller's history), so the page's
conversation state and the engine's prompt share one definition of a turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

MAX_HISTORY_TURNS = 8  # earlier turns a follow-up question carries (the page keeps the newest)
MAX_HISTORY_CHARS = 24_000  # about 6k tokens of earlier turns: each costs KV cache, like the answer's own tokens


class Turn(NamedTuple):
    """An earlier question about the same image and the model's answer to it (as written, tags included)."""

    question: str
    answer: str


def chat_messages(question: str, history: Sequence[Turn] = ()) -> list[dict[str, Any]]:
    """The conversation as chat-template messages: the image in the first user turn (Mllama's template
    puts its ``<|image|>`` there), each earlier answer as the assistant's turn, the question last."""
    messages: list[dict[str, Any]] = []
    for turn in history:
        messages.append({"role": "user", "content": [{"type": "text", "text": turn.question}]})
        messages.append({"role": "assistant", "content": [{"type": "text", "text": turn.answer}]})
    messages.append({"role": "user", "content": [{"type": "text", "text": question}]})
    messages[0]["content"].insert(0, {"type": "image"})
    return messages


def recent_turns(turns: Sequence[Turn]) -> tuple[Turn, ...]:
    """The newest earlier turns that fit the history caps (what the page sends with a follow-up)."""
    kept: list[Turn] = []
    size = 0
    for turn in reversed(turns):
        size += len(turn.question) + len(turn.answer)
        if len(kept) == MAX_HISTORY_TURNS or size > MAX_HISTORY_CHARS:
            break
        kept.append(turn)
    return tuple(reversed(kept))
