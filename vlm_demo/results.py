"""What comes back: a finished answer's result, a stage-beam search's view, an engine's report on itself,
and how a model load is going.

Plain torch-free data shared by the engine, every backend and every door; the engine process sends these
across its pipe, the Triton client rebuilds a result from what the remote reported.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    cached_token_slots: int = 0  # continuous mode: text tokens the rows hold
    cached_bytes: int = 0
    row_limit: int = 0  # continuous mode: rows allowed now (lowered after an out-of-memory step)
    steps_run: int = 0
    prefills_run: int = 0
    beam_searches: int = 0  # stage-beam searches in progress
    preemptions: int = 0  # rows handed back to a waiting client's fair share (resumed later)
    vision_encodes: int = 0  # images run through the vision tower
    vision_tiles: int = 0  # tiles those images ran through it (their real ones with --vision-tiles real)
    image_cache_hits: int = 0  # prefills whose image states came from the image-state cache
    image_cache_misses: int = 0
    image_cache_bytes: int = 0
    image_cache_entries: int = 0
    kv_pages: int = 0  # continuous mode: pages in the pool (text and image states alike)
    kv_pages_free: int = 0
    kv_page_bytes: int = 0
    kv_bytes_per_tile: int = 0  # one tile's image states (a picture holds only the tiles it shows)
    picture_states_bytes: int = 0  # pages holding pictures' cross-attention states (a shared picture once)
    pictures_shared: int = 0  # newcomers whose picture's states other rows already held (no pages, no writes)
    decode_attention: str = ""  # continuous mode: "flash", "triton" or "reference" (engine/attention)
    kv_cache_dtype: str = ""  # continuous mode: how the pool stores keys/values: "auto" (the model's) or "fp8"
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
    model: str | None = None  # the model being loaded, once chosen (the tiny one on a machine without a GPU)
