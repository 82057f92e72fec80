"""``python app.py`` as a new user meets it: a fast ``--help`` that is the whole reference, one ``error:``
line for a bad flag or variable, a busy port refused before anything loads, the real port logged for
``--port 0``, and an honest message when ``--triton-url`` points at something that is not a ready Triton.

Every case runs the real ``app.py`` in a subprocess (what the user types), except the Triton readiness
messages, which talk to small fake servers on loopback ports.
"""

from __future__ import annotations

import base64
import dataclasses
import http.server
import io
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import requests
from PIL import Image
from support import ROOT, free_port, start_app, stop_app, wait_ready, wait_until

from vlm_demo.backends.triton.remote import Endpoint, check_ready
from vlm_demo.config import GROUPS, Config, env_name
from vlm_demo.errors import BackendTimeoutError, BackendUnavailableError

HEAVY = ("gradio", "torch", "transformers", "spaces")
# Runs app.py as `python app.py ...` does, then reports which heavy packages got imported (even on exit).
IMPORT_WATCH = (
    "import atexit, runpy, sys\n"
    f"atexit.register(lambda: print('imported:', [m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr))\n"
    "sys.argv = ['app.py', *sys.argv[1:]]\n"
    "runpy.run_path('app.py', run_name='__main__')\n"
)


def data_url(colour: str) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), colour).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def run_app(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VLM_") and not k.startswith("GRADIO_SERVER")}
    environ.update(GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run(
        [sys.executable, "app.py", *args], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_every_default_and_variable_and_imports_nothing_heavy() -> None:
    """``--help`` is fast because it imports none of the heavy packages (counted, not timed: a wall-clock bound
    fails on a busy machine; the packages' own import times are the speed)."""
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_WATCH, "--help"],
        cwd=ROOT,
        env=dict(os.environ, COLUMNS="100"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert "imported: []" in out.stderr, out.stderr
    # One block per option: its line and the wrapped help lines under it.
    blocks = [" ".join(block.split()) for block in re.split(r"\n(?=  -)", out.stdout)]
    for f in dataclasses.fields(Config):
        if f.metadata.get("cli") is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        block = next((b for b in blocks if b.startswith(flag + " ") or b.startswith(flag + ",")), "")
        assert f"; env {env_name(f.name)}]" in block and "[default: " in block, (flag, block)
    assert "[default: 7860; env VLM_PORT]" in out.stdout
    assert "--dtype {auto,bfloat16,float16,float32}" in out.stdout
    sections = [line for line in out.stdout.splitlines() if re.fullmatch(r"\S.*:", line)]
    assert sections == ["options:", *(f"{title}:" for title in GROUPS.values()), "examples:"], sections
    assert "tiny on a machine without a CUDA GPU" in " ".join(out.stdout.split())


def test_a_log_file_gets_no_progress_bars_request_lines_or_shutdown_traceback_with_mcp_on(tiny_dir: str) -> None:
    """Standard output to a file, as a service has it: no tqdm bar or percentages while loading, no httpx line
    per request when an MCP tool calls the page's API, and SIGTERM after that call ends without a traceback
    (uvicorn cancels the event stream Gradio's own client leaves open) or an ERROR line."""
    import asyncio

    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    port = free_port()
    proc = start_app(port, "--mcp-server", model=None)  # no --model: the tiny one is loaded, as a newcomer's is
    url = f"http://127.0.0.1:{port}"

    async def call() -> str:
        async with streamablehttp_client(url + "/mcp") as (read, write, _):
            async with ClientSession(read, write) as session:
                await session.initialize()
                arguments = {"image": data_url("red"), "question": "What colour is it?", "max_new_tokens": 200}
                result = await session.call_tool("ask", {**arguments, "temperature": 0, "top_p": 1})
                return result.content[0].text

    try:
        wait_ready(proc, url)
        answer = asyncio.run(call())
        assert "The image is red." in answer and not answer.startswith("Invalid"), answer[-2000:]
    finally:
        log = stop_app(proc)
    assert "Traceback" not in log and "ERROR" not in log, log[-4000:]
    assert "it/s]" not in log and "Loading weights" not in log and " % · " not in log, log[-4000:]
    assert "httpx" not in log and "HTTP Request:" not in log, log[-4000:]
    assert "loading tiny onto cpu" in log and "Finished server process" in log, log[-4000:]


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (
            ["--dtype", "fp16"],
            {},
            "argument --dtype: invalid choice 'fp16' (choose from auto, bfloat16, float16, float32)",
        ),
        (["--port", "70000"], {}, "argument --port: must be from 0 to 65535, not 70000"),
        (["--port", "http"], {}, "argument --port: expected a whole number, not 'http'"),
        (["--device", "gpu"], {}, "argument --device: invalid value 'gpu' (expected auto, cpu, cuda or cuda:N)"),
        (["--max-queue", "0"], {}, "argument --max-queue: must be at least 1, not 0"),
        (["--triton-timeout", "nan"], {}, "argument --triton-timeout: must be a finite number"),
        (["--auth", "alice"], {}, "--auth must look like USER:PASS"),
        (["--modle", "tiny"], {}, "unrecognized arguments: --modle"),
        ([], {"VLM_PORT": "eighty"}, "VLM_PORT='eighty': expected a whole number"),
        ([], {"VLM_BATCHING": "fast"}, "VLM_BATCHING='fast': invalid choice 'fast' (choose from continuous, dynamic)"),
        ([], {"GRADIO_SERVER_PORT": "99999"}, "GRADIO_SERVER_PORT='99999': must be from 0 to 65535"),
        ([], {"VLM_SHARE": "perhaps"}, "VLM_SHARE='perhaps': expected true or false"),
    ],
)
def test_a_bad_flag_or_variable_is_one_error_line_with_exit_code_2(args, env, expected) -> None:
    # Should a case be accepted after all, the app stops at once at a closed Triton port instead of loading a model.
    out = run_app(*args, env={"VLM_TRITON_URL": "http://127.0.0.1:9", **env}, timeout=30)
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("app.py: error: "), out.stderr
    assert expected in lines[0], lines[0]
    assert out.stdout == ""


def test_a_busy_port_is_one_error_line_before_anything_is_built() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_app(
            "--model", "tiny", "--host", "127.0.0.1", "--port", str(port), "--triton-url", "http://127.0.0.1:9"
        )
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"error: port {port} on 127.0.0.1 is already in use (another server?); "
        "choose another with --port, or --port 0 for any free one"
    ]


def test_a_missing_model_folder_is_one_line_before_gradio_or_torch_is_imported() -> None:
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_WATCH, "--model", "/nonexistent/llava-cot", "--port", "0"],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("VLM_")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[-1] == "imported: []", out.stderr  # nothing heavy: it answers in a fraction of a second
    assert lines[-2].startswith("Cannot start the model: The model folder /nonexistent/llava-cot does not exist")
    assert "engine process" not in out.stderr and "serving on" not in out.stderr


@contextmanager
def silent_server() -> Iterator[int]:
    """A port that accepts connections and never answers: "nothing there" as a timeout sees it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock.getsockname()[1]


def test_port_0_logs_the_real_port_before_the_build_and_a_silent_triton_is_a_timeout() -> None:
    with silent_server() as triton_port:
        out = run_app("--port", "0", "--triton-url", f"http://127.0.0.1:{triton_port}", "--triton-timeout", "1")
    assert out.returncode == 1, out.stderr
    announced = re.search(r"serving on http://127\.0\.0\.1:(\d+): a loading page until the model is ready", out.stderr)
    assert announced and int(announced.group(1)) > 0, out.stderr
    assert ":0 " not in out.stderr and "ready: serving" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last == f"Cannot use Triton: Triton at http://127.0.0.1:{triton_port} did not answer within 1 s.", last
    assert "Traceback" not in out.stderr


class _Answer(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(self.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def answering(status: int) -> Iterator[int]:
    """An HTTP server that answers every request with ``status`` (a gateway, some other server, or Triton)."""
    handler = type("Handler", (_Answer,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_while_the_backend_starts_the_port_already_answers_with_what_is_happening() -> None:
    """Triton that never answers keeps the start-up in its "connecting" phase for the whole timeout: the
    health check, the page and the API say so (503) meanwhile, then the server ends with the reason."""
    with silent_server() as triton_port:
        port = free_port()
        proc = start_app(port, "--triton-url", f"http://127.0.0.1:{triton_port}", "--triton-timeout", "8")
        url = f"http://127.0.0.1:{port}"
        try:

            def answered() -> list[requests.Response]:  # in a list: a 503 response is false
                assert proc.poll() is None, "the app exited before its port answered"
                try:
                    health = requests.get(url + "/health", timeout=2)
                except requests.RequestException:
                    return []
                # "starting" comes first, while the backend's module imports (a loaded machine: seconds)
                return [] if health.json().get("loading", {}).get("phase") == "starting" else [health]

            (health,) = wait_until(answered, 30, every=0.1, what="the port to answer past its first phase")
            assert health.status_code == 503 and health.headers["Retry-After"] == "5"
            body = health.json()
            assert body["ready"] is False and body["status"] == "loading", body
            assert body["loading"]["phase"] == f"connecting to Triton at http://127.0.0.1:{triton_port}", body
            assert "s so far" in body["loading"]["message"]
            page = requests.get(url + "/", timeout=5)
            assert page.status_code == 503 and "getting ready" in page.text and "connecting to Triton" in page.text
            api = requests.get(url + "/v1/models", timeout=5)
            assert api.status_code == 503 and api.json()["error"]["code"] == "loading"
            assert proc.wait(timeout=60) == 1
        finally:
            out = stop_app(proc)
    last = out.strip().splitlines()[-1]
    assert last == f"Cannot use Triton: Triton at http://127.0.0.1:{triton_port} did not answer within 8 s.", out
    assert "Traceback" not in out


@pytest.mark.parametrize(
    ("status", "error", "message"),
    [
        (504, BackendTimeoutError, "did not answer within 2 s (a gateway answered HTTP 504)"),
        (404, BackendUnavailableError, "is unreachable: /v2/health/live answered HTTP 404"),
        (502, BackendUnavailableError, "is unreachable: /v2/health/live answered HTTP 502"),
        (400, BackendUnavailableError, "is up but not ready"),  # Triton's own "no"
    ],
)
def test_triton_readiness_says_up_but_not_ready_only_when_triton_said_so(status, error, message) -> None:
    with answering(status) as port:
        with pytest.raises(error, match=re.escape(message)):
            check_ready(Endpoint.parse(f"http://127.0.0.1:{port}"), "m", 2.0)


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_triton_with_nothing_answering_is_a_timeout_not_up_but_not_ready(scheme: str) -> None:
    with silent_server() as port:
        with pytest.raises(BackendTimeoutError, match="did not answer within 1 s"):
            check_ready(Endpoint.parse(f"{scheme}://127.0.0.1:{port}"), "m", 1.0)


@pytest.mark.slow
def test_a_fresh_clone_serves_the_shipped_tiny_model_without_building_it(tmp_path) -> None:
    """``python app.py`` as a newcomer runs it (no GPU, no options, an empty home directory): the page is
    healthy on the tiny model shipped with the package, and no model was built into the home directory.
    (How long it took is printed; docs/BENCHMARKS.md has the measured figure.)"""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLM_")}
    env.update(HOME=str(tmp_path), GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    started = time.monotonic()
    proc = start_app(port, env=env, model=None)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, timeout=120)
        took = time.monotonic() - started
        health = requests.get(url + "/health", timeout=10).json()
    finally:
        log = stop_app(proc)
    print(f"fresh start: healthy after {took:.1f} s")
    assert health["ready"] and health["model"] == "tiny" and health["tiny_notice"], health
    assert not (tmp_path / ".cache" / "vlm_demo" / "tiny").exists(), "the tiny model was built instead of loaded"
    assert "building the tiny model" not in log and "Traceback" not in log.split("Shutting down")[0], log[-3000:]


def test_a_hub_retry_is_one_log_line(caplog) -> None:
    """huggingface_hub logs each retry as two records, and once more through a handler of its own: one line."""
    import logging

    from vlm_demo import logs

    hub = logging.getLogger("huggingface_hub")
    hub.addHandler(logging.StreamHandler())  # what importing transformers gives it
    logs.quiet_hub_retries()
    assert hub.handlers == [] and hub.propagate
    http = logging.getLogger("huggingface_hub.utils._http")
    with caplog.at_level(logging.WARNING, logger="huggingface_hub.utils._http"):
        for attempt in (1, 2):
            http.warning(
                "'%s' thrown while requesting HEAD %s", "[Errno -2] Name or service not known", "https://hf.co/x"
            )
            http.warning("Retrying in %ds [Retry %d/5].", attempt, attempt)
    assert [r.getMessage() for r in caplog.records] == [
        f"'[Errno -2] Name or service not known' thrown while requesting HEAD https://hf.co/x; retrying in {n}s "
        f"[Retry {n}/5]."
        for n in (1, 2)
    ]


def test_a_start_without_triton_does_not_log_torchaos_no_triton_warning() -> None:
    """On a machine without a GPU (the CPU build of torch brings no ``triton``) torchao warned "Detected no triton"
    on every start: nothing a user can act on. The log setup of every process that may import torchao (the web
    process, the engine process, the Triton command) drops that one record, and only it."""
    code = (
        "import sys, logging; sys.modules['triton'] = None  # as on a machine without it\n"
        "from vlm_demo import logs; {setup}\n"
        "import torchao.kernel.intmm\n"
        "logging.getLogger('torchao.kernel.intmm').warning('another warning of that logger')\n"
    )
    said = {}
    for name, setup in (("bare", "logging.basicConfig()"), ("ours", "logs.setup()")):
        done = subprocess.run(
            [sys.executable, "-c", code.format(setup=setup)], cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-2000:]
        said[name] = done.stderr
    assert "Detected no triton" in said["bare"]  # the warning the setup drops (torchao still logs it)
    assert "Detected no triton" not in said["ours"] and "another warning of that logger" in said["ours"], said["ours"]
