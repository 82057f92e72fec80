"""The Triton wire contract, in one place: the client (:mod:`vlm_demo.backends.triton`), the PyTriton
server (:mod:`vlm_demo.triton.serve`) and the repository's ``model.py`` files all import it.

Two contracts:

* **infer** (``llama_3_2v_11b_cot_ensemble``): ``IMAGE`` UINT8 ``[H,W,3]`` (plus a batch dimension when
  the model batches) and ``QUESTION`` BYTES in, ``ANSWER`` BYTES out; optional sampling inputs and
  optional outputs (finish reason, token counts, how the engine ran it, a per-request ``ERROR``).
* **generate** (Triton's vLLM backend, decoupled): ``text_input`` (the chat-templated prompt), ``image``
  (base64 of an image file), ``sampling_parameters`` (JSON) and flags → ``text_output`` pieces; the
  ``return_*`` flags ask for the final counts (vLLM's) and how the engine ran it (ours).

Every addition is optional on both sides: a client asks only for what the model's metadata lists, and a
server sends the extras only when asked, so older clients and servers (and third-party models) still work.
Our servers also say which model they run in the model config's ``parameters`` (:data:`MODEL_PARAMETER`).

Servers in this package report a request's typed error as ``vlm_demo[code]: message`` (inside Triton's
error text or the ``ERROR`` output), so the client raises the same error class the engine did (each class
carries its code: :mod:`vlm_demo.errors`). The sampling inputs come from the sampling fields' knobs
(:mod:`vlm_demo.request`), as do the generate contract's ``sampling_parameters`` keys.
Torch-free: the web process imports it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from vlm_demo.errors import DemoError, by_code
from vlm_demo.request import KNOBS, STAGE_BEAM, ValidParams

ENSEMBLE_MODEL = "llama_3_2v_11b_cot_ensemble"
GENERATE_MODEL = "vllm_model"
# The model-config parameter naming the model the engine runs (``parameters { key: "model" ... }``, as the
# repository's config.pbtxt files set it): "tiny" makes the page show the tiny model's banner and examples.
MODEL_PARAMETER = "model"

# ---- infer contract ----------------------------------------------------------------------------------
IMAGE, QUESTION, ANSWER, ERROR = "IMAGE", "QUESTION", "ANSWER", "ERROR"
DTYPES: dict[str, type] = {"INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "BYTES": np.object_}
# Optional inputs, one value per request (shape [1]): the sampling fields whose knob names a Triton type, under
# the field's own name (vlm_demo.request.SamplingParams), e.g. max_new_tokens INT32, reasoning BYTES.
SAMPLING_INPUTS: dict[str, type] = {name: DTYPES[knob.triton] for name, knob in KNOBS.items() if knob.triton}
# Optional: a follow-up question's earlier turns, JSON ``[[question, answer], ...]`` oldest first (one per request).
HISTORY = "HISTORY"
INFER_INPUTS = (IMAGE, QUESTION, HISTORY, *SAMPLING_INPUTS)
# Outputs: name -> numpy dtype; all but ANSWER are optional for a client (used when the model lists them).
# BATCH_SIZE, QUEUE_S and DECODE_S say how the engine ran the request (the page's status line): the most rows
# it shared a batch with, seconds in the engine's queue, and seconds decoding after its first token, the
# span its tokens/s is measured over (a client's own clock sees the whole answer arrive at once).
INFER_OUTPUT_TYPES: dict[str, type] = {
    ANSWER: np.object_,
    "FINISH_REASON": np.object_,
    "PROMPT_TOKENS": np.int32,
    "COMPLETION_TOKENS": np.int32,
    "BATCH_SIZE": np.int32,
    "QUEUE_S": np.float32,
    "DECODE_S": np.float32,
    ERROR: np.object_,
}
INFER_OUTPUTS = tuple(INFER_OUTPUT_TYPES)

# ---- generate contract (Triton's vLLM backend) -------------------------------------------------------
TEXT_INPUT, IMAGE_INPUT, SAMPLING_PARAMETERS, TEXT_OUTPUT = "text_input", "image", "sampling_parameters", "text_output"
GENERATE_FLAGS = (
    "stream",
    "exclude_input_in_output",
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_run_stats",  # ours, not vLLM's: batch_size, queue_s and decode_s, as the infer outputs above
)
GENERATE_INPUTS = (TEXT_INPUT, IMAGE_INPUT, SAMPLING_PARAMETERS, *GENERATE_FLAGS)
GENERATE_OUTPUT_TYPES: dict[str, type] = {
    TEXT_OUTPUT: np.object_,
    "finish_reason": np.object_,
    "num_input_tokens": np.uint32,
    "num_output_tokens": np.uint32,
    "batch_size": np.uint32,
    "queue_s": np.float32,
    "decode_s": np.float32,
}
GENERATE_OUTPUTS = tuple(GENERATE_OUTPUT_TYPES)
# sampling_parameters keys (vLLM's names) -> the sampling field each sets.
SAMPLING_KEYS: dict[str, str] = {knob.vllm: name for name, knob in KNOBS.items() if knob.vllm}


def sampling_parameters(params: ValidParams) -> dict[str, object]:
    """The ``sampling_parameters`` JSON for ``params``: vLLM's keys as vLLM takes them; the seed only when
    sampling, ``ignore_eos`` only when set, and our reasoning keys only in stage-beam mode (a stock vLLM
    model refuses keys it does not know)."""
    sent: dict[str, object] = {}
    for key, name in SAMPLING_KEYS.items():
        value = getattr(params, name)
        if name == "seed" and params.greedy:
            continue
        if name == "ignore_eos" and not value:
            continue
        if name in ("reasoning", "beams") and params.reasoning != STAGE_BEAM:
            continue
        sent[key] = value
    return sent


# Llama 3.2 Vision's chat format (what its chat template renders, and what vLLM expects as ``text_input``:
# it finds the image by the ``<|image|>`` token, in the first user turn).
PROMPT_HEAD = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n<|image|>"
PROMPT_TAIL = "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
NEXT_USER = "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
_TURN = re.compile(r"<\|start_header_id\|>(user|assistant)<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>", re.S)


def chat_prompt(question: str, history: Sequence[tuple[str, str]] = ()) -> str:
    """The chat-templated prompt for ``text_input``: the image and the first question, each earlier answer
    and the next question, then the assistant's turn (one user turn when there is no history)."""
    parts = [PROMPT_HEAD]
    for earlier, answer in history:
        parts += [earlier, PROMPT_TAIL, answer, NEXT_USER]
    parts += [question, PROMPT_TAIL]
    return "".join(parts)


def conversation_from_prompt(prompt: str) -> tuple[str, list[list[str]]]:
    """The question and the earlier ``[question, answer]`` turns inside a chat-templated prompt; a prompt
    without chat markup is the question itself."""
    turns = [(role, text.replace("<|image|>", "").strip()) for role, text in _TURN.findall(prompt)]
    users = [text for role, text in turns if role == "user"]
    if not users:
        return prompt.replace("<|image|>", "").strip(), []
    history, asked = [], None
    for role, text in turns:
        if role == "user":
            asked = text
        elif asked is not None:
            history.append([asked, text])
            asked = None
    return users[-1], history


# ---- typed errors across the wire ---------------------------------------------------------------------
_MARKER = re.compile(r"vlm_demo\[(\w+)\]: ([^\n]*)")


def error_text(error: DemoError) -> str:
    """How a server in this package reports ``error`` so that :func:`error_from_text` restores its class."""
    return f"vlm_demo[{error.code}]: {error}"


def error_from_text(text: str) -> DemoError | None:
    """The typed error encoded in ``text`` by :func:`error_text`, if any."""
    match = _MARKER.search(text)
    if not match:
        return None
    return by_code(match.group(1))(match.group(2))
