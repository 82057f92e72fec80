"""The one door every request passes: the shared vocabulary of the UI, the backends and the engine.

Everything here is torch-free on purpose: the web process validates requests before they cross to
the engine process (or to a remote Triton), and importing the page must not load a deep-learning
framework. There is one set of rules and messages for all entry points: :func:`validate_request`
turns loose input (an upload payload or a picture, a question, raw numbers from an API client) into a
:class:`ValidRequest`, and the engine and both backends accept nothing else.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from vlm_demo.errors import InvalidRequestError, TooManyRequestsError

if TYPE_CHECKING:
    from PIL import Image

    from vlm_demo.config import Config

DEFAULT_MAX_NEW_TOKENS = 1024  # LLaVA-CoT answers run ~300-1000 tokens
DEFAULT_TEMPERATURE = 0.6  # the authors' defaults
DEFAULT_TOP_P = 0.9
MAX_TEMPERATURE = 2.0

# Reasoning modes: "normal" writes the answer once; "stage-beam" is LLaVA-CoT's stage-level beam search
# (per stage, ``beams`` sampled candidates, the model judges them in pairs, the winner continues).
NORMAL, STAGE_BEAM = "normal", "stage-beam"
REASONING_MODES = (NORMAL, STAGE_BEAM)
DEFAULT_BEAMS = 2  # the paper's default
MAX_BEAMS = 8


@dataclass
class SamplingParams:
    """How one request is decoded. ``temperature == 0`` means greedy."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    ignore_eos: bool = False  # benchmarks only: force the full length
    seed: int | None = None  # sampled rows draw from their own generator: same seed, same text
    reasoning: str = NORMAL  # or STAGE_BEAM
    beams: int = DEFAULT_BEAMS  # candidates per stage in stage-beam mode (1 only for benchmarks)
    beam_serial: bool = False  # benchmarks only: run the candidates and judges one at a time
    seeded: bool = False  # the caller chose the seed (set by ``validated``): a sampled answer is then repeatable

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def deterministic(self) -> bool:
        """The same request always gets the same answer (greedy, or sampled with a seed the caller chose)."""
        return self.greedy or self.seeded

    def validated(self, max_new_tokens_cap: int) -> SamplingParams:
        """Check ranges with messages a person can act on; returns a copy with a seed set."""
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, (int, float)):
            raise InvalidRequestError("max_new_tokens must be a whole number.", "max_new_tokens")
        if int(self.max_new_tokens) != self.max_new_tokens or not 1 <= self.max_new_tokens <= max_new_tokens_cap:
            raise InvalidRequestError(
                f"max_new_tokens must be a whole number from 1 to {max_new_tokens_cap}.", "max_new_tokens"
            )
        for name, value, low, high in (
            ("temperature", self.temperature, 0.0, MAX_TEMPERATURE),
            ("top_p", self.top_p, 0.0, 1.0),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise InvalidRequestError(f"{name} must be a number from {low:g} to {high:g}.", name)
        if self.top_p == 0 and self.temperature != 0:
            raise InvalidRequestError("top_p must be above 0 when sampling (temperature > 0).", "top_p")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError("seed must be a whole number.", "seed")
        if self.reasoning not in REASONING_MODES:
            raise InvalidRequestError(f"reasoning must be one of {', '.join(map(repr, REASONING_MODES))}.", "reasoning")
        check_beams(self.beams, low=1)
        seed = self.seed if self.seed is not None else random.getrandbits(63)
        return SamplingParams(
            int(self.max_new_tokens),
            float(self.temperature),
            float(self.top_p),
            bool(self.ignore_eos),
            seed,
            self.reasoning,
            int(self.beams),
            bool(self.beam_serial),
            self.seeded or self.seed is not None,
        )


def check_beams(beams: Any, low: int = 2) -> int:
    """``beams`` as a whole number from ``low`` to :data:`MAX_BEAMS` (the API allows 2 and up; one
    candidate per stage exists for benchmarks only)."""
    whole = not isinstance(beams, bool) and isinstance(beams, (int, float)) and int(beams) == beams
    if not whole or not low <= beams <= MAX_BEAMS:
        raise InvalidRequestError(f"beams must be a whole number from {low} to {MAX_BEAMS}.", "beams")
    return int(beams)


@dataclass(frozen=True)
class StageChoice:
    """One stage of a stage-beam search: its candidates' texts (inside the tags), then the judged winner."""

    stage: str  # "summary" … "conclusion"
    candidates: tuple[str, ...]
    winner: int | None = None  # index into ``candidates`` once decided
    judgements: tuple[str, ...] = ()  # the judge's answers, in the order they were given
    closed: tuple[bool, ...] = ()  # per candidate: it reached the stage's closing tag (others are dropped)


@dataclass(frozen=True)
class BeamView:
    """Where a stage-beam search stands, for the page: the decided stages, then the running one last."""

    stages: tuple[StageChoice, ...]
    phase: str  # "writing" (candidates streaming), "judging", or "done"
    beams: int
    judge_calls: int = 0


@dataclass
class GenerationResult:
    """What a finished request reports besides its text."""

    text: str
    finish_reason: str  # "stop" (end of turn or </CONCLUSION>), "length", or "cancelled"
    batch_size: int  # largest number of rows it shared the model with (0: unknown, remote)
    prompt_tokens: int
    completion_tokens: int
    queue_s: float  # submit -> first forward pass that included it
    ttft_s: float  # submit -> first streamed token
    total_s: float  # submit -> finished
    beam: BeamView | None = None  # a stage-beam search's candidates and winners, stage by stage
    cut_stage: str | None = None  # the stage cut short to leave room for the CONCLUSION (finish "length")
    cached: bool = False  # replayed from the response cache (the same deterministic request ran before)
    # Seconds spent decoding after the first token, where the engine that measured them is not the one that
    # set ttft_s and total_s (a remote one: its own figure, 0 when it did not report one); None: total - ttft.
    decode_s: float | None = None

    @property
    def tokens_per_s(self) -> float:
        """Decoding speed after the first token; 0.0 when there is none to tell (one token, or not reported)."""
        decode = self.total_s - self.ttft_s if self.decode_s is None else self.decode_s
        return (self.completion_tokens - 1) / decode if decode > 0 and self.completion_tokens > 1 else 0.0


@dataclass(frozen=True)
class EngineStats:
    """What an engine reports about itself, in one shape for both batching modes: ``/health`` shows it,
    ``/metrics`` reads the queue depth from it, the engine process sends it with every step message."""

    ready: bool
    batching: str  # "dynamic" or "continuous"
    queue_depth: int  # requests waiting to be admitted
    running: int  # requests (rows) in the running batch
    batches_run: int  # dynamic batches, or continuous decode steps
    device: str
    max_batch_size: int
    kv_budget_bytes: int  # 0 = no limit
    kv_bytes_per_token: int
    kv_bytes_per_row: int
    memory_plan: str  # where the numbers came from
    weights: str = ""  # how the language model's linear weights are stored: fp8, int8, int4, or the dtype (bf16)
    cached_token_slots: int = 0  # continuous mode: KV columns held, padding included
    cached_bytes: int = 0
    row_limit: int = 0  # continuous mode: rows allowed now (lowered after an out-of-memory step)
    steps_run: int = 0
    prefills_run: int = 0
    beam_searches: int = 0  # stage-beam searches in progress
    preemptions: int = 0  # rows handed back to a waiting client's fair share (resumed later)
    vision_encodes: int = 0  # images run through the vision tower
    image_cache_hits: int = 0  # prefills whose image states came from the image-state cache
    image_cache_misses: int = 0
    image_cache_bytes: int = 0
    image_cache_entries: int = 0
    kv_pages: int = 0  # continuous mode: pages in the pool (text and image states alike)
    kv_pages_free: int = 0
    kv_page_bytes: int = 0
    kv_bytes_per_tile: int = 0  # one tile's image states (a picture holds only the tiles it shows)
    decode_attention: str = ""  # continuous mode: "flash" (FlashAttention's paged kernel) or "reference"
    cuda_graphs: int = 0  # decode graphs captured (0: the step runs eagerly)
    graph_pool_bytes: int = 0  # GPU memory the captured graphs hold
    # Running totals (the Prometheus counters of the same names, with ``vlm_`` and ``_total``).
    kv_copied_bytes: int = 0  # keys/values and image states moved because rows joined, left or were preempted
    kv_written_bytes: int = 0  # keys/values written for generated tokens
    attention_read_bytes: int = 0  # keys/values and image states the decode steps' attention read
    attention_live_bytes: int = 0  # the rows' own tokens and tiles among those


@dataclass(frozen=True)
class LoadProgress:
    """Where a model load stands (the web process shows it on ``/health`` and the loading page)."""

    phase: str  # what is happening, for a person ("loading Xkev/Llama-3.2V-11B-cot on cuda")
    fraction: float | None = None  # how far along, 0..1, when known
    eta_s: float | None = None  # seconds left, when known (a build's steps, the last load's duration)


class ClientSlots:
    """Answers in progress per client, against ``--max-per-client``: one client (an address, an API user)
    cannot hold more, so one script cannot take a public demo from everyone. Anonymous callers (the
    engine's own tools, benchmarks) are not counted. Thread-safe."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.held: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, client: str) -> None:
        """Count one more for ``client``, or raise :class:`TooManyRequestsError` saying why not."""
        with self._lock:
            held = self.held.get(client, 0)
            if self.cap and client and held >= self.cap:
                raise TooManyRequestsError(
                    f"You already have {held} answer{'s' if held != 1 else ''} in progress; wait for one to finish "
                    f"(at most {self.cap} at a time per visitor), then ask again."
                )
            self.held[client] = held + 1

    def give_back(self, client: str) -> None:
        with self._lock:
            left = self.held.get(client, 1) - 1
            if left > 0:
                self.held[client] = left
            else:
                self.held.pop(client, None)


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


class Turn(NamedTuple):
    """An earlier question about the same image and the model's answer to it (as written, tags included)."""

    question: str
    answer: str


MAX_HISTORY_TURNS = 8  # earlier turns a follow-up question carries (the page keeps the newest)
MAX_HISTORY_CHARS = 24_000  # about 6k tokens of earlier turns: each costs KV cache, like the answer's own tokens


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed the door: a decoded RGB picture, a clean question, checked and seeded parameters,
    and for a follow-up question the earlier turns about the same picture (oldest first)."""

    image: Image.Image
    question: str
    params: SamplingParams
    image_key: str = ""  # a digest of the picture's pixels: the image-state and response caches key on it
    client: str = ""  # who asks (an address, an API key): fair share and the per-client cap count by it
    history: tuple[Turn, ...] = ()


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


def reasoning_mode(value: Any) -> str:
    """The reasoning mode from a loose input: ``None``/``""`` mean normal; case and ``_`` are forgiven."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return NORMAL
    if isinstance(value, str):
        mode = value.strip().lower().replace("_", "-")
        if mode in REASONING_MODES:
            return mode
    raise InvalidRequestError(
        f"reasoning must be one of {', '.join(map(repr, REASONING_MODES))}, not {str(value)[:20]!r}.", "reasoning"
    )


def params_from_inputs(
    max_new_tokens: Any,
    temperature: Any,
    top_p: Any,
    limits: Limits,
    reasoning: Any = None,
    beams: Any = None,
    seed: Any = None,
) -> SamplingParams:
    """Sampling parameters from loose inputs (sliders, JSON numbers, numeric strings), checked.

    ``reasoning`` and ``beams`` are the API's optional inputs: left out (``None``) they mean the normal
    mode and the default number of beams. ``seed`` (the OpenAI API's) left out draws a random one.
    """
    mode = reasoning_mode(reasoning)
    count = DEFAULT_BEAMS if beams is None or beams == "" else check_beams(number("beams", beams))
    return SamplingParams(
        max_new_tokens=number("max_new_tokens", max_new_tokens),  # type: ignore[arg-type]
        temperature=number("temperature", temperature),
        top_p=number("top_p", top_p),
        reasoning=mode,
        beams=count,
        seed=seed,
    ).validated(limits.max_new_tokens)


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
    from vlm_demo.images import image_digest, load_image  # PIL only; kept local so the vocabulary imports fast

    limits = limits or Limits()
    if not has_image(image):
        raise InvalidRequestError("Please upload an image first.")
    question = validate_question(question, limits.max_question_chars)
    turns = validate_history(history, limits.max_question_chars)
    params = (params or SamplingParams()).validated(limits.max_new_tokens)
    picture = load_image(image, max_pixels=limits.max_image_pixels, max_bytes=limits.max_image_bytes)
    return ValidRequest(picture, question, params, image_digest(picture), history=turns)
