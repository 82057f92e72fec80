"""How our commands log: one line format, and a log file without a terminal's decorations.

A progress bar, or a line per percent, is for a person watching a terminal; in a log file (a service, a
container, CI) it is noise. So when standard error is not a terminal the libraries' progress bars are off
(``HF_HUB_DISABLE_PROGRESS_BARS``, read by huggingface_hub and transformers, and inherited by the engine
process and Triton's model processes), libraries that log a line per HTTP request (httpx, which Gradio's MCP
tools use to call the server itself) speak only for warnings, and an ordinary stop leaves no traceback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CHATTY = ("httpx", "httpcore", "mcp.server.lowlevel.server", "mcp.server.streamable_http")  # a line per request


def interactive() -> bool:
    """Whether a person is watching: standard error is a terminal."""
    return sys.stderr.isatty()


def setup() -> None:
    """Call first, before transformers or Gradio are imported (the variable is read at import)."""
    if not interactive():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(level=logging.INFO, format=FORMAT)
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("uvicorn.error").addFilter(ordinary_shutdown)
    quiet_hub_retries()
    quiet_torchao_without_triton()


def quiet_hub_retries() -> None:
    """One line per Hugging Face Hub retry: huggingface_hub's logger has a handler of its own (each line came out
    twice, once unformatted) and says each retry in two records (what failed, then "Retrying in 1s"), joined
    here into one. Safe to call in every process, more than once."""
    hub = logging.getLogger("huggingface_hub")
    for handler in list(hub.handlers):
        hub.removeHandler(handler)
    hub.propagate = True
    http = logging.getLogger("huggingface_hub.utils._http")
    if not any(isinstance(f, _HubRetries) for f in http.filters):
        http.addFilter(_HubRetries())


TORCHAO_NO_TRITON = "Warning: Detected no triton"  # torchao.kernel.intmm, logged at import where triton is absent


def quiet_torchao_without_triton() -> None:
    """Drop torchao's "Detected no triton, on systems without Triton certain kernels will not work", logged on every
    start on a machine without a GPU (the CPU build of torch brings no ``triton``): nothing there needs those
    kernels and nothing a user can do about it. Only that record: the logger's other warnings still show. Call
    before torchao is imported; safe in every process, more than once."""
    intmm = logging.getLogger("torchao.kernel.intmm")
    if not any(isinstance(f, _DropNoTriton) for f in intmm.filters):
        intmm.addFilter(_DropNoTriton())


class _DropNoTriton(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TORCHAO_NO_TRITON)


class _HubRetries(logging.Filter):
    """Holds a "… thrown while requesting …" record and puts it in front of the "Retrying in …" that follows (the
    last one, after which nothing is retried, is dropped: the load's own error says why it failed)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if " thrown while requesting " in message:
            self.held = message
            return False
        if message.startswith("Retrying in") and self.held is not None:
            record.msg, record.args = f"{self.held}; {message[0].lower()}{message[1:]}", ()
            self.held = None
        return True


def ordinary_shutdown(record: logging.LogRecord) -> bool:
    """uvicorn's words for a stop that went as designed: after the grace period it cancels the connections
    still open (an answer still streaming, or an event stream nobody closes, such as the heartbeat of Gradio's
    own client behind an MCP tool call). Its "Cancel N running task(s)" line is information, not an error, and
    the "Exception in ASGI application" traceback of each cancelled connection says nothing more: dropped."""
    error = record.exc_info[1] if record.exc_info else None
    if isinstance(error, asyncio.CancelledError) and "shutdown" in str(error):
        return False
    if record.levelno == logging.ERROR and "graceful shutdown exceeded" in record.getMessage():
        record.levelno, record.levelname = logging.INFO, "INFO"
    return True
