"""The one door every request passes: what a request is and the rules it must meet (the per-client cap is
the answer service's, :class:`~vlm_demo.web.answers.ClientSlots`).

Torch-free on purpose: the web process validates requests before they cross to the engine process (or to a
remote Triton), and importing the page must not load a deep-learning framework. There is one set of rules
and messages for all entry points: :func:`validate_request` turns loose input (an upload payload or a
picture, a question, raw numbers from an API client) into a :class:`ValidRequest`, and the engine and every
backend accept nothing else. Its sampling parameters are :class:`ValidParams`, which only validation makes:
loose :class:`SamplingParams` are checked, and an unset seed drawn, once.

Each sampling field is declared once, on :class:`SamplingParams`, with a :class:`Knob` in its metadata (as
:class:`~vlm_demo.config.Config` declares each option): its range, default and help, the page control that
sets it, its name on ``/v1``, its Triton input type and its key in vLLM's ``sampling_parameters``. The
page's controls, ``/v1``'s field names, the MCP tool's parameters and both Triton contracts are built from
it, and :func:`sampling_from` checks every door's input by it.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlm_demo.errors import InvalidRequestError
from vlm_demo.prompt import MAX_HISTORY_CHARS, MAX_HISTORY_TURNS, Turn

if TYPE_CHECKING:
    from PIL import Image

    from vlm_demo.config import Config

# Reasoning modes: "normal" writes the answer once; "stage-beam" is LLaVA-CoT's stage-level beam search
# (per stage, ``beams`` sampled candidates, the model judges them in pairs, the winner continues).
NORMAL, STAGE_BEAM = "normal", "stage-beam"


@dataclass(frozen=True)
class Knob:
    """One sampling field as every door offers it (see the module's docstring)."""

    help: str  # for people: the page control's info, the MCP parameter's description
    low: float | None = None
    high: float | None = None  # None with ``low`` set: the server's cap (``--max-new-tokens``)
    whole: bool = False  # a whole number
    choices: tuple[tuple[str, str], ...] = ()  # (label, value) when it is one of a few words
    optional: bool = False  # a caller may send null for it: the default (else null is an error)
    label: str = ""  # the page control's label; "" = not on the page
    step: float = 0.0  # the page slider's step
    page_low: float | None = None  # the slider's lowest, where ``low`` is valid only with another setting
    bench_low: float | None = None  # lower still for benchmarks (``validated`` takes it; no door offers it)
    api: str = ""  # the field's name on /v1; "" = not offered to API and MCP callers
    triton: str = ""  # the infer contract's input datatype (Triton's name); "" = not sent
    vllm: str = ""  # its key in the generate contract's sampling_parameters (vLLM's name)

    @property
    def values(self) -> tuple[str, ...]:
        return tuple(value for _, value in self.choices)

    def bounds(self, cap: int, door: bool = True) -> tuple[float, float] | None:
        """The valid range at a door (or, not ``door``, for benchmarks), with the server's cap filled in;
        ``None`` when any value of the type goes."""
        if self.low is None:
            return None
        low = self.low if door or self.bench_low is None else self.bench_low
        return low, self.high if self.high is not None else cap


def knob(default: Any, **meta: Any) -> Any:
    """A :class:`SamplingParams` field with its :class:`Knob`."""
    return field(default=default, metadata={"knob": Knob(**meta)})


@dataclass
class SamplingParams:
    """How a caller asks one request to be decoded (loose: unchecked, and ``seed`` may be left out);
    :meth:`validated` turns it into :class:`ValidParams`. ``temperature == 0`` means greedy."""

    max_new_tokens: int = knob(
        1024,  # LLaVA-CoT answers run ~300-1000 tokens
        help="The most tokens the answer may have; the four stages usually take 300 to 1000.",
        low=1,
        whole=True,
        label="Max new tokens",
        step=1,
        api="max_tokens",
        triton="INT32",
        vllm="max_tokens",
    )
    temperature: float = knob(
        0.6,  # the authors' defaults
        help="Sampling temperature; 0 is greedy: the same answer every time.",
        low=0.0,
        high=2.0,
        label="Temperature (0 = greedy)",
        step=0.05,
        api="temperature",
        triton="FP32",
        vllm="temperature",
    )
    top_p: float = knob(
        0.9,
        help="Nucleus sampling: draw from the likeliest tokens whose probabilities add up to top_p "
        "(above 0 when sampling).",
        low=0.0,
        high=1.0,
        page_low=0.05,
        label="Top-p",
        step=0.05,
        api="top_p",
        triton="FP32",
        vllm="top_p",
    )
    ignore_eos: bool = knob(False, help="Benchmarks only: write the full length.", vllm="ignore_eos")
    seed: int | None = knob(
        None,
        help="Sampled answers with the same seed are the same text; left out, each answer draws its own.",
        whole=True,
        optional=True,
        api="seed",
        triton="INT64",
        vllm="seed",
    )
    reasoning: str = knob(
        NORMAL,
        help="Think harder (stage-beam): for each stage the model writes several candidates and judges which "
        "is best (LLaVA-CoT's stage-level beam search); slower, for questions that need careful reasoning.",
        choices=(("Normal", NORMAL), ("Think harder", STAGE_BEAM)),
        optional=True,
        label="Reasoning",
        api="reasoning",
        triton="BYTES",
        vllm="reasoning",
    )
    beams: int = knob(
        2,  # the paper's default
        help="Candidates per stage with Think harder.",
        low=2,
        high=8,
        bench_low=1,  # one candidate per stage: the benchmarks' baseline
        whole=True,
        optional=True,
        label="Candidates per stage",
        step=1,
        api="beams",
        triton="INT32",
        vllm="beams",
    )

    def validated(self, max_new_tokens_cap: int) -> ValidParams:
        """Check every field against its knob, with messages a person can act on, and draw the seed the caller
        left out: the only maker of :class:`ValidParams`. One candidate per stage passes here (benchmarks
        compare it); callers' doors ask for two."""
        values = {name: getattr(self, name) for name in KNOBS}
        checked = {name: _check(name, value, max_new_tokens_cap, door=False) for name, value in values.items()}
        _check_together(checked)
        seed = checked.pop("seed")
        seeded = seed is not None
        return ValidParams(**checked, seed=seed if seeded else random.getrandbits(63), seeded=seeded, proof=_CHECKED)


class _Checked:
    """Proof that :meth:`SamplingParams.validated` made a :class:`ValidParams` (kept across pickling: the engine
    process receives them, and a search derives its candidates' with ``dataclasses.replace``)."""

    def __reduce__(self) -> str:
        return "_CHECKED"


_CHECKED = _Checked()


@dataclass(frozen=True)
class ValidParams:
    """Checked sampling parameters, with the seed drawn once (TGI's ``ValidParameters``): only
    :meth:`SamplingParams.validated` makes them, and the engine, the backends and the response cache take
    nothing else, so no code validates twice (which would take the drawn seed for the caller's)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    ignore_eos: bool
    seed: int  # the caller's, or drawn at the door
    reasoning: str
    beams: int
    seeded: bool  # the caller chose the seed: a sampled answer is then repeatable
    proof: _Checked = field(repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.proof is not _CHECKED:
            raise TypeError("ValidParams come only from SamplingParams.validated (the door checks them once).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def repeatable(self) -> bool:
        """The same request always gets the same answer: sampled with a seed the caller chose, or greedy in the
        normal mode (Think harder's candidates always sample, with seeds from this one)."""
        return self.seeded or (self.greedy and self.reasoning == NORMAL)


KNOBS: dict[str, Knob] = {f.name: f.metadata["knob"] for f in dataclasses.fields(SamplingParams) if f.metadata}
DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SamplingParams) if f.metadata}
# Where each door offers them: the page's controls (in the page's input order) and the API's and MCP's fields.
PAGE_KNOBS: tuple[str, ...] = tuple(name for name, k in KNOBS.items() if k.label)
API_KNOBS: tuple[str, ...] = tuple(name for name, k in KNOBS.items() if k.api)
REASONING_MODES = KNOBS["reasoning"].values
DEFAULT_MAX_NEW_TOKENS = DEFAULTS["max_new_tokens"]
DEFAULT_TEMPERATURE = DEFAULTS["temperature"]
DEFAULT_TOP_P = DEFAULTS["top_p"]
DEFAULT_BEAMS = DEFAULTS["beams"]
MAX_BEAMS = int(KNOBS["beams"].high or 0)


def _check(name: str, value: Any, cap: int, door: bool) -> Any:
    """One field's value checked against its knob (after any loose conversion), in its type."""
    spec = KNOBS[name]
    if spec.choices:
        if value not in spec.values:
            raise InvalidRequestError(f"{name} must be one of {', '.join(map(repr, spec.values))}.", name)
        return value
    if isinstance(DEFAULTS[name], bool):
        return bool(value)
    if value is None and DEFAULTS[name] is None:
        return None
    bounds = spec.bounds(cap, door)
    good = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    good = good and (bounds is None or bounds[0] <= value <= bounds[1]) and (not spec.whole or int(value) == value)
    if not good:
        kind = "a whole number" if spec.whole else "a number"
        span = f" from {bounds[0]:g} to {bounds[1]:g}" if bounds is not None else ""
        raise InvalidRequestError(f"{name} must be {kind}{span}.", name)
    return int(value) if spec.whole else float(value)


def _check_together(values: Mapping[str, Any]) -> None:
    """The rule no one field's knob can say."""
    if values.get("top_p", DEFAULT_TOP_P) == 0 and values.get("temperature", DEFAULT_TEMPERATURE) != 0:
        raise InvalidRequestError("top_p must be above 0 when sampling (temperature > 0).", "top_p")


def number(name: str, value: Any) -> float:
    """Accept numbers (or numeric strings from loose API clients); reject bool, None, NaN, inf."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise InvalidRequestError(f"{name} must be a number, not {value[:20]!r}.", name) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number.", name)
    return value


def choice(name: str, value: Any) -> str:
    """One of a knob's words from a loose input: ``None``/``""`` mean the default; case and ``_`` are forgiven."""
    spec = KNOBS[name]
    if value is None or (isinstance(value, str) and not value.strip()):
        return DEFAULTS[name]
    if isinstance(value, str):
        word = value.strip().lower().replace("_", "-")
        if word in spec.values:
            return word
    raise InvalidRequestError(
        f"{name} must be one of {', '.join(map(repr, spec.values))}, not {str(value)[:20]!r}.", name
    )


def sampling_from(values: Mapping[str, Any], limits: Limits) -> SamplingParams:
    """Sampling parameters from a door's loose inputs by field name (sliders, JSON numbers, numeric strings),
    converted and checked against the knobs at the door's ranges: a field left out takes its default (within
    the server's cap), and so does ``None`` for an optional one. Still loose (the seed is not drawn):
    :func:`validate_request` validates it, once."""
    given: dict[str, Any] = {}
    for name, value in values.items():
        spec = KNOBS[name]
        if value is None or value == "":
            if not spec.optional:
                number(name, value)  # raises: this door's contract has no default for it
            continue
        if spec.choices:
            value = choice(name, value)
        elif spec.low is not None:
            value = number(name, value)
        given[name] = _check(name, value, limits.max_new_tokens, door=True)
    for name, spec in KNOBS.items():
        if name not in given and spec.low is not None and spec.high is None:  # the default, within the cap
            given[name] = min(DEFAULTS[name], limits.max_new_tokens)
    _check_together(given)
    return SamplingParams(**given)


@dataclass(frozen=True)
class Limits:
    """The caps a request is checked against (from :class:`~vlm_demo.config.Config`)."""

    max_new_tokens: int = 2048
    max_question_chars: int = 2000
    max_image_pixels: int = 40_000_000
    max_image_bytes: int = 50 * 1024 * 1024

    @classmethod
    def from_config(cls, config: Config) -> Limits:
        return cls(config.max_new_tokens, config.max_question_chars, config.max_image_pixels)


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed the door: a decoded RGB picture, a clean question, checked and seeded parameters,
    and for a follow-up question the earlier turns about the same picture (oldest first)."""

    image: Image.Image
    question: str
    params: ValidParams
    image_key: str = ""  # a digest of the picture's pixels: the image-state and response caches key on it
    client: str = ""  # who asks (an address, an API key): fair share and the per-client cap count by it
    history: tuple[Turn, ...] = ()
    serial_beams: bool = False  # benchmarks only: a stage-beam search runs its candidates and judges one at a time


def validate_history(history: Any, max_question_chars: int) -> tuple[Turn, ...]:
    """Earlier turns as ``[question, answer]`` pairs, oldest first, within the caps; ``None`` is none."""
    if history is None:
        return ()
    shape = "The conversation history must be a list of [question, answer] pairs of text."
    if not isinstance(history, (list, tuple)):
        raise InvalidRequestError(shape, "history")
    turns = []
    for index, item in enumerate(history, 1):
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and all(isinstance(x, str) for x in item)):
            raise InvalidRequestError(f"{shape} Turn {index} is not.", "history")
        question, answer = item
        if not question.strip() or not answer.strip() or "\x00" in question + answer:
            raise InvalidRequestError(
                f"Turn {index} of the conversation history has an empty question or answer, or a NUL character.",
                "history",
            )
        if len(question) > max_question_chars:
            raise InvalidRequestError(
                f"Turn {index}'s question is too long ({len(question)} characters; the limit is {max_question_chars}).",
                "history",
            )
        turns.append(Turn(question.strip(), answer.strip()))
    size = sum(len(t.question) + len(t.answer) for t in turns)
    if len(turns) > MAX_HISTORY_TURNS or size > MAX_HISTORY_CHARS:
        raise InvalidRequestError(
            f"The conversation history is too long ({len(turns)} turns, {size} characters; the limits are "
            f"{MAX_HISTORY_TURNS} turns and {MAX_HISTORY_CHARS} characters): keep the newest turns.",
            "history",
        )
    return tuple(turns)


def validate_question(question: Any, max_chars: int) -> str:
    """Text, not blank, no NUL, within the cap (measured before stripping); returns it stripped."""
    if not isinstance(question, str):
        raise InvalidRequestError("The question must be text.", "question")
    if not question.strip():
        raise InvalidRequestError("Please type a question about the image.", "question")
    if len(question) > max_chars:
        raise InvalidRequestError(
            f"The question is too long ({len(question)} characters; the limit is {max_chars}).", "question"
        )
    if "\x00" in question:
        raise InvalidRequestError("The question contains a NUL character; please send plain text.", "question")
    return question.strip()


def has_image(image: Any) -> bool:
    """Whether an image was given at all (a Gradio payload without a path or URL is an empty upload)."""
    if image is None or image == "":
        return False
    if isinstance(image, dict):
        return bool(image.get("path") or image.get("url"))
    return True


def validate_request(
    image: Any,
    question: Any,
    params: SamplingParams | None = None,
    limits: Limits | None = None,
    history: Any = None,
) -> ValidRequest:
    """Check and normalise one request, cheap checks first and image decoding last.

    ``image`` may be a PIL image, a file path, bytes or a Gradio file payload; ``history`` the earlier
    turns of a follow-up question (see :func:`validate_history`). Raises :class:`InvalidRequestError` with
    a message the visitor can act on.
    """
    from vlm_demo.images import image_digest, load_image  # PIL only; kept local so the door imports fast

    limits = limits or Limits()
    if not has_image(image):
        raise InvalidRequestError("Please upload an image first.")
    question = validate_question(question, limits.max_question_chars)
    turns = validate_history(history, limits.max_question_chars)
    checked = (params or SamplingParams()).validated(limits.max_new_tokens)
    picture = load_image(image, max_pixels=limits.max_image_pixels, max_bytes=limits.max_image_bytes)
    return ValidRequest(picture, question, checked, image_digest(picture), history=turns)
