"""One configuration dataclass for every entry point.

Each field is a CLI flag (``--max-batch-size``) and an environment variable (``VLM_MAX_BATCH_SIZE``);
the command line wins over the environment, the environment over the default. Keeping them in one
place means the web demo, the Triton launcher and the benchmark cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

DEFAULT_MODEL = "Xkev/Llama-3.2V-11B-cot"
TINY = "tiny"


@dataclass
class Config:
    """Everything a user can set. ``help`` and ``group`` metadata make ``--help`` and docs/configuration.md's tables."""

    model: str = field(
        default=DEFAULT_MODEL,
        metadata={
            "group": "engine",
            "help": "HF model id, local folder, or 'tiny' (offline test model).",
            "app_default": f"{DEFAULT_MODEL}, or {TINY} on a machine without a CUDA GPU",
        },
    )
    device: str = field(
        default="auto",
        metadata={"group": "engine", "help": "auto, cpu, cuda or cuda:N", "pattern": r"auto|cpu|cuda(:\d+)?"},
    )
    dtype: str = field(
        default="auto",
        metadata={
            "group": "engine",
            "help": "auto (bf16 on GPU, fp32 on CPU), bfloat16, float16 or float32",
            "choices": ("auto", "bfloat16", "float16", "float32"),
        },
    )
    quantize: str = field(
        default="auto",
        metadata={
            "group": "engine",
            "help": "The language model's linear weights as loaded: none (the model dtype), fp8 (GPUs of compute "
            "capability 8.9+), int8 or int4 (torchao, quantized while loading); auto = on CUDA the most precise that "
            "leaves room for 8 rows of 1,024 tokens, none on CPU. See docs/quantization.md.",
            "choices": ("none", "fp8", "int8", "int4", "auto"),
        },
    )
    cpu_threads: int = field(
        default=1,
        metadata={
            "group": "engine",
            "help": "torch threads when running on CPU (1 is fastest for the tiny model on a busy box).",
            "min": 1,
        },
    )
    host: str = field(
        default="127.0.0.1", metadata={"group": "page", "help": "Bind address (also GRADIO_SERVER_NAME)."}
    )
    port: int = field(
        default=7860, metadata={"group": "page", "help": "Port (also GRADIO_SERVER_PORT).", "min": 0, "max": 65535}
    )
    batching: str = field(
        default="continuous",
        metadata={
            "group": "engine",
            "help": "continuous (rows join/leave every step) or dynamic (request-level batches).",
            "choices": ("continuous", "dynamic"),
        },
    )
    engine_process: bool = field(
        default=True,
        metadata={
            "group": "engine",
            "help": "Run the engine in its own process, supervised and restarted if it dies (off: in the web process).",
        },
    )
    max_batch_size: int = field(
        default=0,
        metadata={
            "group": "engine",
            "help": "Most requests merged into one batch; 0 = sized from memory: on CUDA the rows of "
            "--max-new-tokens tokens that fit in the GPU memory free after loading (at most 256), 8 on CPU.",
            "min": 0,
        },
    )
    batch_window_ms: float = field(
        default=50.0,
        metadata={
            "group": "engine",
            "help": "How long a short batch waits for more requests (dynamic mode).",
            "min": 0,
        },
    )
    stream_every_ms: float = field(
        default=20.0,
        metadata={
            "group": "engine",
            "help": "The engine hands its clients new text at most this often (a request's first words and its end "
            "at once); 0: every step. Each hand-over wakes every client with news.",
            "min": 0,
        },
    )
    max_queue: int = field(
        default=128, metadata={"group": "engine", "help": "Waiting requests beyond this get 'server busy'.", "min": 1}
    )
    max_new_tokens: int = field(
        default=2048, metadata={"group": "engine", "help": "Cap on tokens a request may ask for.", "min": 1}
    )
    max_per_client: int = field(
        default=8,
        metadata={
            "group": "page",
            "help": "Answers one client (an address; on /v1 the request's user field, else the address) may have "
            "waiting or running at once; more are refused at once (HTTP 429 on /v1); 0 = no cap.",
            "min": 0,
        },
    )
    response_cache_mb: float = field(
        default=64.0,
        metadata={
            "group": "page",
            "help": "MB of finished answers kept to replay a repeated deterministic request (greedy, or seeded); "
            "0 = off.",
            "min": 0,
        },
    )
    image_cache_mb: float = field(
        default=2048.0,
        metadata={
            "group": "engine",
            "help": "Continuous mode: MB of vision-tower output kept per image for repeated images, follow-up "
            "questions and Think harder's judges (counted in the KV budget, emptied before a request waits); 0 = off.",
            "min": 0,
        },
    )
    kv_token_budget: int = field(
        default=0,
        metadata={
            "group": "engine",
            "help": "Continuous mode: most cached tokens over running rows (0 = no limit).",
            "min": 0,
        },
    )
    kv_budget_gb: float = field(
        default=0.0,
        metadata={
            "group": "engine",
            "help": "Continuous mode: GiB of the page pool that holds every row's keys/values and the image states of "
            "the tiles it sees, allocated once at start; 0 = on CUDA the memory free after loading minus a reserve, "
            "on CPU room for every row at full length.",
            "min": 0,
        },
    )
    decode_attention: str = field(
        default="auto",
        metadata={
            "group": "engine",
            "help": "Continuous mode's decode attention over the page pool: flash (FlashAttention's paged kernel in "
            "torch >= 2.12, CUDA, 16-bit), triton (our paged Triton kernel, CUDA with any torch; on a CPU only under "
            "TRITON_INTERPRET=1, for tests), reference (torch operations, any device) or auto (on CUDA flash where "
            "it passes a probe of random steps at start, else triton, else reference; on a CPU reference). The log "
            "says which ran and why the faster ones did not.",
            "choices": ("auto", "flash", "triton", "reference"),
        },
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "group": "engine",
            "help": "Continuous mode: how the page pool stores keys/values (text and picture): auto (the model's dtype) "
            "or fp8 (float8 e4m3 with one float32 scale per token and KV head: ~1.94x more tokens in the same memory, "
            "3 mantissa bits; the flash decode attention cannot read it, auto takes triton on CUDA).",
            "choices": ("auto", "fp8"),
        },
    )
    cuda_graphs: str = field(
        default="auto",
        metadata={
            "group": "engine",
            "help": "Continuous mode: replay the decode step from CUDA graphs captured at start, one per bucket of rows "
            "(one launch per step instead of hundreds; a little GPU memory per bucket): on, off, or auto (on with "
            "CUDA and the flash or triton decode attention; the log says why when off).",
            "choices": ("auto", "on", "off"),
        },
    )
    prefill_batch_size: int = field(
        default=8,
        metadata={
            "group": "engine",
            "help": "Continuous mode: most newcomers prefilled together in one forward pass.",
            "min": 1,
        },
    )
    prefill_share: float = field(
        default=1.0,
        metadata={
            "group": "engine",
            "help": "Continuous mode: while rows are decoding, the newcomers' prefill work a step may do (vision "
            "tower layers for waiting pictures, then prompts), as a multiple of one decode step's measured time: "
            "a running answer's next token then waits at most about (1 + this) steps' time. 0 = prefill newcomers "
            "at once, however long the running rows wait. A lone request is always prefilled at once.",
            "min": 0,
        },
    )
    vision_tiles: str = field(
        default="real",
        metadata={
            "group": "engine",
            "help": "Continuous mode: real = the vision tower, the projector and the cross-attention run each "
            "picture's real tiles only (a 1-tile picture costs a quarter of a 4-tile one; 4-tile pictures are "
            "bit-identical, smaller ones differ from the stock forward, which lets real tiles attend to "
            "the padding ones); all = the stock computation on every tile the processor packs.",
            "choices": ("real", "all"),
        },
    )
    structured_stages: bool = field(
        default=True,
        metadata={
            "group": "engine",
            "help": "Keep LLaVA-CoT's four stages while decoding (tags forced or redrawn where sampling would break "
            "them; a reserve keeps room for the CONCLUSION); off for models that do not answer in the format.",
        },
    )
    max_image_pixels: int = field(
        default=40_000_000, metadata={"group": "page", "help": "Reject larger images (bombs).", "min": 1}
    )
    max_question_chars: int = field(
        default=2000, metadata={"group": "page", "help": "Reject longer questions.", "min": 1}
    )
    forwarded_allow_ips: str = field(
        default="",
        metadata={
            "group": "page",
            "help": "Proxies trusted to name the visitor in X-Forwarded-For (fair share counts by visitor): "
            "comma-separated addresses or '*'; empty = uvicorn's default (127.0.0.1), '*' on Hugging Face Spaces.",
        },
    )
    share: bool = field(default=False, metadata={"group": "page", "help": "Ask Gradio for a public share link."})
    auth: str = field(
        default="", metadata={"group": "api", "help": "USER:PASS for the page (recommended with --share)."}
    )
    api_key: str = field(
        default="",
        metadata={
            "group": "api",
            "help": "Key the OpenAI-compatible API (/v1/*) requires as 'Authorization: Bearer KEY'; with --auth "
            "and no key, /v1 is closed.",
        },
    )
    metrics_token: str = field(
        default="",
        metadata={
            "group": "api",
            "help": "Token for /metrics and the full /health as 'Authorization: Bearer TOKEN' (for a scraper); "
            "with it or --auth, /metrics refuses anonymous callers and anonymous /health says only ready or not.",
        },
    )
    api_remote_images: bool = field(
        default=False,
        metadata={
            "group": "api",
            "help": "Let /v1/chat/completions fetch http(s) image URLs (public addresses only, size and time "
            "limits); off: data: URLs only.",
        },
    )
    mcp_server: bool = field(
        default=False,
        metadata={
            "group": "api",
            "help": "Also serve an MCP tool, ask, at /mcp (streamable HTTP; with --api-key it needs the key).",
        },
    )
    triton_url: str = field(
        default="",
        metadata={"group": "triton", "help": "Forward to Triton instead of a local model: http://h:p or grpc://h:p."},
    )
    triton_model: str = field(
        default="llama_3_2v_11b_cot_ensemble", metadata={"group": "triton", "help": "Triton model name."}
    )
    triton_protocol: str = field(
        default="auto",
        metadata={
            "group": "triton",
            "help": "auto (from the model metadata), infer or generate",
            "choices": ("auto", "infer", "generate"),
        },
    )
    triton_timeout: float = field(
        default=120.0, metadata={"group": "triton", "help": "Seconds before a Triton call gives up.", "min": 0.1}
    )
    zerogpu_tokens_per_s: float = field(
        default=25.0,
        metadata={
            "group": "zerogpu",
            "help": "The decode speed of one answer a ZeroGPU call's duration is reckoned with: a call asks for "
            "--zerogpu-start-s plus max_new_tokens / this seconds (more with Think harder's candidates); ZeroGPU "
            "refuses a call longer than the visitor's tier allows and schedules shorter ones sooner.",
            "min": 0.1,
        },
    )
    zerogpu_start_s: float = field(
        default=30.0,
        metadata={
            "group": "zerogpu",
            "help": "Seconds every ZeroGPU call asks for on top of the answer's own: a new GPU worker first moves the "
            "weights onto its GPU and builds the engine.",
            "min": 0,
        },
    )
    tiny_dir: str = field(
        default="",
        metadata={
            "group": "engine",
            "help": "A folder for the tiny model, built there on first use (default: the copy shipped with the "
            "package).",
        },
    )
    model_explicit: bool = field(default=False, metadata={"cli": False})


# ``--help``'s sections, in order: a field's ``group`` metadata names one (a new option picks one here).
GROUPS = {
    "page": "the page and its server",
    "engine": "the model and the batching engine",
    "api": "API and security",
    "triton": "a remote Triton instead of a local model",
    "zerogpu": "Hugging Face ZeroGPU (only where SPACES_ZERO_GPU is true)",
}
EXAMPLES = """examples:
  python app.py                                   the demo on http://127.0.0.1:7860 (tiny without a GPU)
  python app.py --model tiny --port 8080          the offline test model, another port
  python app.py --host 0.0.0.0 --auth alice:s3cret --api-key KEY
                                                  reachable on the network; page and /v1 need credentials
  python app.py --triton-url grpc://HOST:8001 --triton-model vllm_model
                                                  answers from a Triton server instead of a local model
  VLM_MAX_BATCH_SIZE=16 python app.py             every option is also a VLM_* variable

more: docs/configuration.md (every option, health, metrics, sharing)"""

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
KIND_NAMES = {int: "a whole number", float: "a number"}


class ConfigError(SystemExit):
    """A bad setting, said in one line that names the flag or the variable.

    A ``SystemExit``, so an entry point that does not catch it still ends with that line and no
    traceback; :func:`load_config` turns it into argparse's ``error:`` line and exit code 2.
    """


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``app.py: error: …``), not the usage block and then it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}. See {self.prog} --help.\n")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return "VLM_" + name.upper()


def settings() -> list[dataclasses.Field]:
    """The fields a user sets (flags and ``VLM_*`` variables)."""
    return [f for f in dataclasses.fields(Config) if f.metadata.get("cli") is not False]


def check_value(f: dataclasses.Field, value: Any) -> None:
    """Raise ``ValueError`` saying what is wrong with one setting's value: choices, pattern, range."""
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ValueError(f"invalid choice {value!r} (choose from {', '.join(choices)})")
    pattern = f.metadata.get("pattern")
    if pattern and not re.fullmatch(pattern, value):
        raise ValueError(f"invalid value {value!r} (expected {f.metadata.get('help', pattern)})")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be a finite number, not {value}")
    low, high = f.metadata.get("min"), f.metadata.get("max")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise ValueError(f"must be {bounds}, not {value}")


def parse_value(f: dataclasses.Field, raw: str) -> Any:
    """One setting from text (a flag or an environment variable), checked; ``ValueError`` says why not."""
    kind: type = type(f.default)
    if kind is bool:
        word = raw.strip().lower()
        if word in TRUE_WORDS + FALSE_WORDS:
            return word in TRUE_WORDS
        raise ValueError(f"expected true or false, not {raw!r}")
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"expected {KIND_NAMES.get(kind, 'text')}, not {raw!r}") from None
    check_value(f, value)
    return value


def _argument_type(f: dataclasses.Field) -> Callable[[str], Any]:
    def convert(raw: str) -> Any:
        try:
            return parse_value(f, raw)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return convert


def _env_defaults(environ: dict[str, str]) -> dict[str, Any]:
    """Values from ``VLM_*`` (and Gradio's own server variables, which Spaces sets)."""
    by_name = {f.name: f for f in settings()}
    sources = [(name, env_name(name)) for name in by_name]
    sources += [("host", "GRADIO_SERVER_NAME"), ("port", "GRADIO_SERVER_PORT")]  # used only without VLM_*
    values: dict[str, Any] = {}
    for name, variable in sources:
        raw = environ.get(variable)
        if not raw or (name in values and not variable.startswith("VLM_")):
            continue
        try:
            values[name] = parse_value(by_name[name], raw)
        except ValueError as err:
            raise ConfigError(f"{variable}={raw!r}: {err}") from None
    return values


def _help(f: dataclasses.Field, app: bool) -> str:
    """The field's help plus its default and variable, so ``--help`` is the whole reference (``app``: the
    default as ``app.py`` applies it, e.g. the tiny model on a machine without a GPU)."""
    default = f.default if f.default != "" else "(empty)"
    default = f.metadata.get("app_default", default) if app else default
    if isinstance(default, bool):
        default = "on" if default else "off"
    text = f"{f.metadata.get('help', '')} [default: {default}; env {env_name(f.name)}]"
    return text.replace("%", "%%")  # argparse %-formats help strings


def build_parser(
    description: str, only: Sequence[str] | None = None, prog: str | None = None
) -> argparse.ArgumentParser:
    """An argparse parser with one flag per config field (or just those named in ``only``: another command's
    settings, without ``app.py``'s grouping, examples and defaults), grouped as :data:`GROUPS` says.

    Values are converted and checked here (type, choices, range), so a bad flag ends in one
    ``error:`` line naming it, before the caller imports anything heavy.
    """
    app = only is None
    parser = OneLineParser(
        prog=prog,
        usage="%(prog)s [options]" if app else None,  # the groups below list them; 25 lines of flags helped nobody
        description=description,
        epilog=EXAMPLES if app else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sections = {name: parser.add_argument_group(title) for name, title in GROUPS.items()} if app else {}
    for f in settings():
        if only is not None and f.name not in only:
            continue
        section = sections.get(f.metadata["group"], parser)
        if isinstance(f.default, bool):
            action: dict[str, Any] = {"action": argparse.BooleanOptionalAction}
        else:
            choices = f.metadata.get("choices")
            action = {"type": _argument_type(f), "metavar": "{" + ",".join(choices) + "}" if choices else None}
        section.add_argument(_flag(f.name), dest=f.name, default=None, help=_help(f, app), **action)
    return parser


def config_from_namespace(ns: argparse.Namespace, environ: dict[str, str] | None = None) -> Config:
    """Merge defaults < environment < command line into a validated :class:`Config` (or raise :class:`ConfigError`)."""
    values = _env_defaults(dict(os.environ if environ is None else environ))
    for f in settings():
        given = getattr(ns, f.name, None)
        if given is not None:
            values[f.name] = given
    values["model_explicit"] = "model" in values
    config = Config(**values)
    validate(config)
    return config


def load_config(
    argv: Sequence[str] | None = None, description: str = "LLaVA-CoT demo", environ: dict[str, str] | None = None
) -> Config:
    """Flags and ``VLM_*`` variables; a bad value ends the program with one ``error:`` line and exit code 2."""
    parser = build_parser(description)
    namespace = parser.parse_args(argv)
    try:
        return config_from_namespace(namespace, environ)
    except ConfigError as err:
        parser.error(str(err))


def validate(config: Config) -> None:
    """Fail at start-up, with the flag's name, rather than deep inside a request.

    Flags are already checked by the parser; this covers values set in code or in a model
    repository's ``config.pbtxt``, and rules that span fields.
    """
    problems = []
    for f in settings():
        try:
            check_value(f, getattr(config, f.name))
        except ValueError as err:
            problems.append(f"{_flag(f.name)}: {err}")
    if config.auth and ":" not in config.auth:
        problems.append("--auth must look like USER:PASS")
    if config.mcp_server and config.auth and not config.api_key:  # as /v1: the page's password is not an agent's
        problems.append("--mcp-server with --auth needs --api-key: MCP clients send 'Authorization: Bearer KEY'")
    if config.triton_url and config.quantize not in ("auto", "none"):  # the remote side holds the weights
        problems.append(
            "--quantize applies to a local model; with --triton-url set it where the model is served "
            "(python -m vlm_demo.triton.serve --quantize ...)"
        )
    if problems:
        raise ConfigError("invalid configuration: " + "; ".join(problems))
