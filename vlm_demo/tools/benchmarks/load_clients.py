"""Load-test clients for ``vlm_demo.tools.bench`` that go over HTTP, as visitors and API users do.

Each exposes the slice of the backend interface the benchmark drives (``submit`` → a handle with
``stream()`` and ``result()``), so the same closed loop measures the engine alone, the running web app
(``/ask`` streaming and ``/ask_batch`` through ``gradio_client``) and the static-batcher baseline
(:mod:`vlm_demo.tools.baseline`), each started here as its own server process on a free loopback port.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import requests

from vlm_demo import REPO_ROOT as ROOT
from vlm_demo.backends.base import Health
from vlm_demo.request import ValidRequest
from vlm_demo.results import GenerationResult


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server command on a free loopback port, up once ``/health`` says ready; stopped with ``close``."""

    def __init__(self, args: list[str], timeout: float = 600.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1")
        self.log = tempfile.TemporaryFile(mode="w+")
        command = [sys.executable, *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{' '.join(args)} exited:\n{self.log.read()[-3000:]}")
            try:
                if requests.get(self.url + "/health", timeout=2).json().get("ready"):
                    return
            except (requests.RequestException, ValueError):
                pass
            time.sleep(0.3)
        self.close()
        raise RuntimeError(f"{' '.join(args)} not ready within {timeout:.0f} s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


class _ImageFiles:
    """Each workload image written once to a PNG file, outside the timed loop."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory()
        self._paths: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}
        self._lock = threading.Lock()  # client threads ask for files concurrently

    def path(self, valid: ValidRequest) -> str:
        key = id(valid.image)
        with self._lock:
            if key not in self._paths:
                path = os.path.join(self._dir.name, f"{key}.png")
                valid.image.save(path)
                self._paths[key] = path
            return self._paths[key]

    def data(self, valid: ValidRequest) -> bytes:
        key = id(valid.image)
        with self._lock:
            if key not in self._bytes:
                buffer = io.BytesIO()
                valid.image.save(buffer, format="PNG")
                self._bytes[key] = buffer.getvalue()
            return self._bytes[key]

    def close(self) -> None:
        self._dir.cleanup()


def _parse_status(status: str, text: str) -> GenerationResult:
    """A result from the page's status line ("Done · batch of 3 · 240 tokens · …")."""
    batch = re.search(r"batch of (\d+)", status)
    tokens = re.search(r"(\d+) tokens", status)
    return GenerationResult(
        text=text,
        finish_reason="length" if "limit" in status else "stop",
        batch_size=int(batch.group(1)) if batch else 0,
        prompt_tokens=0,
        completion_tokens=int(tokens.group(1)) if tokens else 0,
        queue_s=0.0,
        ttft_s=0.0,
        total_s=0.0,
    )


class _Done:
    """A handle whose answer is already complete (non-streaming calls)."""

    def __init__(self, result: GenerationResult) -> None:
        self._result = result

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        yield self._result.text

    def result(self, timeout: float | None = None) -> GenerationResult:
        return self._result

    def cancel(self) -> None:
        pass  # already complete


class _GradioJob:
    """A streaming ``/ask`` job: each page update counts as streamed output."""

    def __init__(self, job: Any) -> None:
        self._job = job
        self._last: Any = None

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        for update in self._job:
            self._last = update
            yield ""

    def result(self, timeout: float | None = None) -> GenerationResult:
        outputs = self._job.result(timeout=timeout)
        return _parse_status(str(outputs[5]), str(outputs[4]))

    def cancel(self) -> None:
        self._job.cancel()


class _WebApp:
    """A running web app (``python app.py``) the benchmark drives: its processes and its files."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.files = _ImageFiles()

    def add_listener(self, listener: Any) -> None:
        pass

    def health(self) -> Health:
        """The app's ``/health`` as a :class:`Health` (the fields the benchmark reads)."""
        body = requests.get(self.server.url + "/health", timeout=10).json()
        details = body.get("details", {})
        return Health(
            bool(body.get("ready")),
            int(body.get("queue_depth", 0)),
            max_batch_size=int(details.get("max_batch_size") or 0),
            engine_pid=details.get("engine_pid"),
        )

    def pids(self) -> dict[str, int]:
        """The processes serving this client: the web process and its engine process."""
        pids = {"web": self.server.proc.pid}
        engine = self.health().engine_pid
        if isinstance(engine, int):
            pids["engine"] = engine
        return pids

    def close(self) -> None:
        self.files.close()
        self.server.close()


class AppClient(_WebApp):
    """The running web app driven through ``gradio_client``, ``/ask`` or ``/ask_batch``."""

    name = "app"

    def __init__(self, server: ServerProcess, endpoint: str) -> None:
        from gradio_client import Client

        super().__init__(server)
        self.endpoint = endpoint
        self.client = Client(server.url, verbose=False)

    def submit(self, valid: ValidRequest) -> Any:
        from gradio_client import handle_file

        p = valid.params
        args = (handle_file(self.files.path(valid)), valid.question, p.max_new_tokens, p.temperature, p.top_p)
        if self.endpoint == "/ask":
            return _GradioJob(self.client.submit(*args, api_name="/ask"))
        outputs = self.client.predict(*args, api_name="/ask_batch")
        if str(outputs[5]).startswith("Error"):
            raise RuntimeError(outputs[5])
        return _Done(_parse_status(str(outputs[5]), str(outputs[4])))


class _SSEJob:
    """A ``/gradio_api/call/ask`` event read as server-sent events: each page update counts as output."""

    def __init__(self, response: requests.Response) -> None:
        self._response = response
        self._final: list[Any] | None = None

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        event = None
        with self._response:
            for line in cast(Iterator[str], self._response.iter_lines(decode_unicode=True)):  # an event stream: text
                if line.startswith("event:"):
                    event = line[len("event:") :].strip()
                elif line.startswith("data:"):
                    if event == "generating":
                        yield ""
                    elif event == "complete":
                        self._final = json.loads(line[len("data:") :])
                        return
                    elif event == "error":
                        raise RuntimeError(f"/ask failed: {line[len('data:') :].strip()[:200]}")

    def result(self, timeout: float | None = None) -> GenerationResult:
        if self._final is None:
            for _ in self.stream(timeout):
                pass
        if self._final is None:
            raise RuntimeError("/ask ended without a result")
        return _parse_status(str(self._final[5]), str(self._final[4]))

    def cancel(self) -> None:
        self._response.close()


class SSEClient(_WebApp):
    """The running web app's ``/ask`` over plain HTTP and server-sent events (Gradio's ``/call`` route),
    as ``curl`` or a browser's ``EventSource`` would use it: what the server costs, without
    ``gradio_client``'s own work (which needs as much CPU as the engine on a 2-core box)."""

    name = "app-sse"

    def __init__(self, server: ServerProcess) -> None:
        super().__init__(server)
        self._local = threading.local()

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def submit(self, valid: ValidRequest) -> _SSEJob:
        session, url, p = self._session(), self.server.url, valid.params
        with open(self.files.path(valid), "rb") as fh:  # a new visitor uploads their picture
            uploaded = session.post(f"{url}/gradio_api/upload", files={"files": fh}, timeout=60).json()[0]
        data: list[Any] = [{"path": uploaded, "meta": {"_type": "gradio.FileData"}}, valid.question]
        data += [p.max_new_tokens, p.temperature, p.top_p]
        event = session.post(f"{url}/gradio_api/call/ask", json={"data": data}, timeout=60).json()["event_id"]
        return _SSEJob(session.get(f"{url}/gradio_api/call/ask/{event}", stream=True, timeout=600))


class _ChatStream:
    """A ``/v1/chat/completions`` stream read as server-sent events: each chunk with text counts as output."""

    def __init__(self, response: requests.Response) -> None:
        self._response = response
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._usage: dict[str, int] | None = None
        self._finish = "stop"

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        with self._response:
            for line in self._response.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    return
                chunk = json.loads(line[len(b"data: ") :])
                if "error" in chunk:
                    raise RuntimeError(f"/v1/chat/completions failed: {chunk['error']['message'][:200]}")
                self._usage = chunk.get("usage") or self._usage
                for choice in chunk["choices"]:
                    self._finish = choice.get("finish_reason") or self._finish
                    delta = choice["delta"]
                    if delta.get("reasoning_content") or delta.get("content"):
                        self._reasoning.append(delta.get("reasoning_content") or "")
                        self._content.append(delta.get("content") or "")
                        yield ""

    def result(self, timeout: float | None = None) -> GenerationResult:
        if self._usage is None:
            for _ in self.stream(timeout):
                pass
        if self._usage is None:
            raise RuntimeError("/v1/chat/completions ended without its usage chunk")
        # The tagged answer again (stages, then the CONCLUSION's text in its tags), so answers are checked alike.
        text = "".join(self._reasoning) + "\n\n<CONCLUSION>" + "".join(self._content) + "</CONCLUSION>"
        tokens = self._usage["completion_tokens"]
        return GenerationResult(text, self._finish, 0, self._usage["prompt_tokens"], tokens, 0.0, 0.0, 0.0)


class OpenAIClient(_WebApp):
    """The running web app's ``/v1/chat/completions`` over plain HTTP and server-sent events, streaming with
    usage: what the API costs the server, without the ``openai`` client's own work (pydantic models per
    chunk) on the server's cores. The batch size is not part of OpenAI's answer, so it is reported as 0."""

    name = "app-openai"

    def __init__(self, server: ServerProcess) -> None:
        super().__init__(server)
        self._local = threading.local()
        self._urls: dict[int, str] = {}
        self.model = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]

    def submit(self, valid: ValidRequest) -> _ChatStream:
        session = self._local.__dict__.setdefault("session", None) or requests.Session()
        self._local.session = session
        key = id(valid.image)
        if key not in self._urls:  # encoded once, outside the timed work (a dict write is atomic)
            self._urls[key] = "data:image/png;base64," + base64.b64encode(self.files.data(valid)).decode("ascii")
        p = valid.params
        content = [
            {"type": "text", "text": valid.question},
            {"type": "image_url", "image_url": {"url": self._urls[key]}},
        ]
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": p.max_new_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        response = session.post(f"{self.server.url}/v1/chat/completions", json=body, stream=True, timeout=600)
        if response.status_code != 200:
            raise RuntimeError(f"/v1/chat/completions: HTTP {response.status_code}: {response.text[:200]}")
        return _ChatStream(response)


class StaticClient:
    """The static-batcher baseline (:mod:`vlm_demo.tools.baseline`) over plain HTTP."""

    name = "static"

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.session = requests.Session()
        self.files = _ImageFiles()

    def pids(self) -> dict[str, int]:
        return {"server": self.server.proc.pid}

    def health(self) -> Health:
        return Health(True, max_batch_size=0)  # the static batcher's batch size is its own flag

    def submit(self, valid: ValidRequest) -> _Done:
        body: dict[str, Any] = {
            "image": base64.b64encode(self.files.data(valid)).decode("ascii"),
            "question": valid.question,
            "max_new_tokens": valid.params.max_new_tokens,
            "temperature": valid.params.temperature,
        }
        response = self.session.post(self.server.url + "/v1/answer", json=body, timeout=600)
        response.raise_for_status()
        data = response.json()
        return _Done(GenerationResult(data["text"], "stop", data["batch_size"], 0, data["completion_tokens"], 0, 0, 0))

    def add_listener(self, listener: Any) -> None:
        pass

    def close(self) -> None:
        self.session.close()
        self.files.close()
        self.server.close()
