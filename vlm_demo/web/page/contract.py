"""The page's public contract, in one place: the API names, the inputs and outputs and their order.

``/ask`` (streaming) and ``/ask_batch`` (Gradio's batch mode) both take :data:`INPUTS` and return
:class:`Outputs`. Users' scripts call them by position and by these names (``gradio_client``,
Gradio's HTTP API), so the layout (:mod:`~vlm_demo.web.page.layout`), the handlers
(:mod:`~vlm_demo.web.page.handlers`), rendering (:mod:`~vlm_demo.web.page.render`) and the tests all take the
names and the order from here. Gradio reads an endpoint's parameter names from the handler's
signature, so :func:`check_signature` makes the page refuse to build if a handler drifts from them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

from vlm_demo.request import KNOBS, PAGE_KNOBS

ASK = "ask"  # the streaming endpoint: /ask
ASK_BATCH = "ask_batch"  # final answers only, batched by Gradio: /ask_batch
ASK_PAGE = "ask_page"  # the page's own Ask (private: not an API endpoint); the page-load bench joins it

# The picture, the question, then the sampling fields that have a page control, in their declared order
# (vlm_demo.request.SamplingParams): max_new_tokens, temperature, top_p, reasoning, beams.
INPUTS: tuple[str, ...] = ("image", "question", *PAGE_KNOBS)
# Trailing inputs a client may leave out (they arrive as None and mean "normal" and 2 candidates): clients
# written for the first five inputs keep working.
OPTIONAL_INPUTS: tuple[str, ...] = tuple(name for name in PAGE_KNOBS if KNOBS[name].optional)


class Outputs(NamedTuple):
    """Every output of one moment of an answer, as plain strings (what API clients receive, in this order)."""

    summary: str = ""
    caption: str = ""
    reasoning: str = ""
    conclusion: str = ""
    raw: str = ""  # the model's text as written, tags included
    status: str = ""  # how it is going / how it ended
    extra: str = ""  # text the model wrote outside the four stages
    stages_html: str = ""  # the stage strip above the panels (marks the active stage)
    beams_html: str = ""  # Think harder: every stage's candidates, the winner marked, the judge's words


OUTPUTS: tuple[str, ...] = Outputs._fields
PANELS: tuple[str, ...] = OUTPUTS[:4]  # the four stage panels, in the stages' order
PANEL_ELEM_IDS: tuple[str, ...] = tuple(f"p_{name}" for name in PANELS)  # their elements on the page


def check_signature(handler: Callable[..., Any]) -> None:
    """Raise if ``handler``'s leading parameters are not :data:`INPUTS` in order (Gradio names the
    endpoint's parameters after them), or if the optional ones have no default."""
    parameters = [p for p in inspect.signature(handler).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD][
        : len(INPUTS)
    ]
    names = tuple(p.name for p in parameters)
    if names != INPUTS:
        raise TypeError(f"{handler.__qualname__} takes {names}, but the page's contract is {INPUTS}")
    missing = [p.name for p in parameters if p.name in OPTIONAL_INPUTS and p.default is inspect.Parameter.empty]
    if missing:
        raise TypeError(f"{handler.__qualname__}: optional inputs {missing} need defaults")
