"""One configuration dataclass for every entry point.

Each field is a CLI flag (``--max-batch-size``) and an environment variable (``VLM_MAX_BATCH_SIZE``);
the command line wins over the environment, the environment over the default. Keeping them in one
place means the web demo, the Triton launcher and the benchmark cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL = "Xkev/Llama-3.2V-11B-cot"
TINY = "tiny"


@dataclass
class Config:
    """Everything a user can set. ``help`` metadata doubles as the README's options table."""

    model: str = field(
        default=DEFAULT_MODEL,
        metadata={"help": "HF model id, local folder, or 'tiny' (offline test model)."},
    )
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda or cuda:N"})
    dtype: str = field(
        default="auto", metadata={"help": "auto (bf16 on GPU, fp32 on CPU), bfloat16, float16 or float32"}
    )
    cpu_threads: int = field(
        default=1,
        metadata={"help": "torch threads when running on CPU (1 is fastest for the tiny model on a busy box)."},
    )
    host: str = field(default="127.0.0.1", metadata={"help": "Bind address (also GRADIO_SERVER_NAME)."})
    port: int = field(default=7860, metadata={"help": "Port (also GRADIO_SERVER_PORT)."})
    batching: str = field(
        default="continuous",
        metadata={"help": "continuous (rows join/leave every step) or dynamic (request-level batches)."},
    )
    max_batch_size: int = field(default=4, metadata={"help": "Most requests merged into one GPU batch."})
    batch_window_ms: float = field(
        default=50.0, metadata={"help": "How long a short batch waits for more requests (dynamic mode)."}
    )
    max_queue: int = field(default=128, metadata={"help": "Waiting requests beyond this get 'server busy'."})
    max_new_tokens: int = field(default=2048, metadata={"help": "Cap on tokens a request may ask for."})
    kv_token_budget: int = field(
        default=0, metadata={"help": "Continuous mode: most cached tokens over running rows (0 = no limit)."}
    )
    max_image_pixels: int = field(default=40_000_000, metadata={"help": "Reject larger images (bombs)."})
    max_question_chars: int = field(default=2000, metadata={"help": "Reject longer questions."})
    share: bool = field(default=False, metadata={"help": "Ask Gradio for a public share link."})
    auth: str = field(default="", metadata={"help": "USER:PASS for the page (recommended with --share)."})
    triton_url: str = field(
        default="", metadata={"help": "Forward to Triton instead of a local model: http://h:p or grpc://h:p."}
    )
    triton_model: str = field(default="llama_3_2v_11b_cot_ensemble", metadata={"help": "Triton model name."})
    triton_protocol: str = field(default="auto", metadata={"help": "auto (from the model metadata), infer or generate"})
    triton_timeout: float = field(default=120.0, metadata={"help": "Seconds before a Triton call gives up."})
    tiny_dir: str = field(
        default="", metadata={"help": "Where the tiny model is built/cached (default ~/.cache/vlm_demo/tiny)."}
    )
    model_explicit: bool = field(default=False, metadata={"cli": False})

    def resolved_tiny_dir(self) -> str:
        return self.tiny_dir or os.path.join(os.path.expanduser("~"), ".cache", "vlm_demo", "tiny")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_bool(text: str) -> bool:
    return text.strip().lower() in {"1", "true", "yes", "on"}


def _convert(f: dataclasses.Field, raw: str) -> Any:
    kind = type(f.default)
    if kind is bool:
        return _parse_bool(raw)
    return kind(raw)


def _env_defaults(environ: dict[str, str]) -> dict[str, Any]:
    """Values from ``VLM_*`` (and Gradio's own server variables, which Spaces sets)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Config):
        if f.metadata.get("cli") is False:
            continue
        raw = environ.get("VLM_" + f.name.upper())
        if raw is not None and raw != "":
            values[f.name] = _convert(f, raw)
    if "host" not in values and environ.get("GRADIO_SERVER_NAME"):
        values["host"] = environ["GRADIO_SERVER_NAME"]
    if "port" not in values and environ.get("GRADIO_SERVER_PORT"):
        values["port"] = int(environ["GRADIO_SERVER_PORT"])
    return values


def build_parser(description: str, only: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one flag per config field (or just those named in ``only``)."""
    parser = argparse.ArgumentParser(description=description)
    for f in dataclasses.fields(Config):
        if f.metadata.get("cli") is False or (only is not None and f.name not in only):
            continue
        if isinstance(f.default, bool):
            parser.add_argument(
                _flag(f.name),
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f.metadata.get("help"),
            )
        else:
            parser.add_argument(
                _flag(f.name), dest=f.name, type=type(f.default), default=None, help=f.metadata.get("help")
            )
    return parser


def config_from_namespace(ns: argparse.Namespace, environ: dict[str, str] | None = None) -> Config:
    """Merge defaults < environment < command line into a validated :class:`Config`."""
    values = _env_defaults(dict(os.environ if environ is None else environ))
    for f in dataclasses.fields(Config):
        given = getattr(ns, f.name, None)
        if given is not None:
            values[f.name] = given
    values["model_explicit"] = "model" in values
    config = Config(**values)
    validate(config)
    return config


def load_config(argv: Sequence[str] | None = None, description: str = "LLaVA-CoT demo") -> Config:
    parser = build_parser(description)
    return config_from_namespace(parser.parse_args(argv))


def validate(config: Config) -> None:
    """Fail at start-up, with the flag's name, rather than deep inside a request."""
    problems = []
    if config.max_batch_size < 1:
        problems.append("--max-batch-size must be >= 1")
    if config.batch_window_ms < 0:
        problems.append("--batch-window-ms must be >= 0")
    if config.max_queue < 1:
        problems.append("--max-queue must be >= 1")
    if config.max_new_tokens < 1:
        problems.append("--max-new-tokens must be >= 1")
    if config.batching not in {"dynamic", "continuous"}:
        problems.append("--batching must be 'dynamic' or 'continuous'")
    if config.triton_protocol not in {"auto", "infer", "generate"}:
        problems.append("--triton-protocol must be auto, infer or generate")
    if config.auth and ":" not in config.auth:
        problems.append("--auth must look like USER:PASS")
    if problems:
        raise SystemExit("Invalid configuration: " + "; ".join(problems))
