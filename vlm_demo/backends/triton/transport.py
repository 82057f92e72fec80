"""How requests reach Triton: HTTP or gRPC, with the asynchronous clients, on one event loop per backend.

No thread per request: every call is a task on the backend's loop (:class:`Loop`), and one connection pool
serves them all (an aiohttp session over HTTP, one channel over gRPC). Three calls cover both contracts:

* :meth:`infer` — one request, one response (the infer contract's non-decoupled model);
* :meth:`stream` — one request, responses until Triton's final flag (a decoupled model over gRPC: the
  generate contract, or a streaming infer model);
* :meth:`generate_stream` — the generate contract over HTTP: ``/generate_stream``'s server-sent events.

A transport failure is raised as it comes (the backend turns it into a typed error); the caller's deadline
and cancellation cancel the task, which closes the HTTP response or the gRPC call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from vlm_demo.backends.triton.remote import Endpoint
from vlm_demo.errors import GenerationError
from vlm_demo.triton.contract import error_from_text

STREAM_END_WAIT_S = 2.0  # how long a stream whose final response came may take the server to end it


class Response(Protocol):
    """A Triton response, as both clients' ``InferResult`` read it."""

    def as_numpy(self, name: str) -> np.ndarray | None: ...


class Transport(Protocol):
    async def infer(self, model: str, arrays: dict[str, np.ndarray], outputs: list[str]) -> Response: ...

    def stream(self, model: str, arrays: dict[str, np.ndarray], outputs: list[str]) -> AsyncIterator[Response]: ...

    def generate_stream(self, model: str, values: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...

    async def close(self) -> None: ...


class Loop:
    """One event loop on a thread of its own, where a backend's calls run as tasks."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, work: Coroutine[Any, Any, Any]) -> Future:
        """Start ``work`` on the loop from any thread; cancelling the returned future cancels it."""
        return asyncio.run_coroutine_threadsafe(work, self.loop)

    def close(self, last: Coroutine[Any, Any, Any] | None = None) -> None:
        """Run ``last`` (closing the connections), then stop the loop."""
        if last is not None:
            try:
                self.run(last).result(5)
            except Exception:  # closing is best effort: the process may be on its way out
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)


def connect(endpoint: Endpoint, timeout: float, connections: int) -> Transport:
    """The transport for ``endpoint``'s scheme; call on the loop that will use it."""
    return HttpTransport(endpoint, timeout, connections) if endpoint.scheme == "http" else GrpcTransport(endpoint)


class HttpTransport:
    """Triton's HTTP/REST protocol: ``tritonclient.http.aio`` for infer, aiohttp for ``/generate_stream``."""

    def __init__(self, endpoint: Endpoint, timeout: float, connections: int) -> None:
        import aiohttp
        import tritonclient.http.aio as client

        self.endpoint = endpoint
        self.client = client.InferenceServerClient(endpoint.address, conn_limit=connections, conn_timeout=timeout)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(timeout, 10.0)),
        )

    async def infer(self, model: str, arrays: dict[str, np.ndarray], outputs: list[str]) -> Response:
        import tritonclient.http as http

        inputs = []
        for name, array in arrays.items():
            item = http.InferInput(name, list(array.shape), _datatype(array))
            item.set_data_from_numpy(array, binary_data=True)
            inputs.append(item)
        wanted = [http.InferRequestedOutput(name, binary_data=True) for name in outputs]
        return await self.client.infer(model, inputs, outputs=wanted)

    async def stream(self, model: str, arrays: dict[str, np.ndarray], outputs: list[str]) -> AsyncIterator[Response]:
        raise GenerationError(f"Triton streams model '{model}' only over gRPC: use --triton-url grpc://...")
        yield  # pragma: no cover - makes this an async generator

    async def generate_stream(self, model: str, values: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        url = f"http://{self.endpoint.address}/v2/models/{model}/generate_stream"
        async with self.session.post(url, json=values) as response:
            if response.status != 200:
                message = http_error(response.status, await response.text())
                raise error_from_text(message) or GenerationError(message)
            async for raw in response.content:
                line = raw.decode("utf-8", "replace").strip()
                if line.startswith("data:"):
                    yield json.loads(line[5:].strip())

    async def close(self) -> None:
        await self.client.close()
        await self.session.close()


class GrpcTransport:
    """Triton's gRPC protocol over one ``grpc.aio`` channel, both unary and streaming calls.

    Requests are built with ``tritonclient``'s own request builder. A stream asks for Triton's empty final
    response (``triton_enable_empty_final_response``), the only reliable end of one request's responses on a
    decoupled model; ``tritonclient.grpc.aio``'s ``stream_infer`` cannot ask for it, so the call goes to the
    service stub directly.
    """

    def __init__(self, endpoint: Endpoint) -> None:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        self.channel = grpc.aio.insecure_channel(
            endpoint.address, options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        )
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    async def infer(self, model: str, arrays: dict[str, np.ndarray], outputs: list[str]) -> Response:
        from tritonclient.grpc import InferResult

        with _grpc_errors():
            return InferResult(await self.stub.ModelInfer(_request(model, arrays, outputs)))

    async def stream(self, model: str, arrays: dict[str, np.ndarray], outputs: list[str]) -> AsyncIterator[Response]:
        from tritonclient.grpc import InferResult
        from tritonclient.utils import InferenceServerException

        request = _request(model, arrays, outputs)
        request.parameters["triton_enable_empty_final_response"].bool_param = True

        async def one() -> AsyncIterator[Any]:
            yield request

        call = self.stub.ModelStreamInfer(one())
        try:
            with _grpc_errors():
                async for response in call:
                    if response.error_message:
                        raise InferenceServerException(msg=response.error_message)
                    yield InferResult(response.infer_response)
                    final = response.infer_response.parameters.get("triton_final_response")
                    if final is not None and final.bool_param:
                        await _finished(call)
                        return
        finally:
            call.cancel()  # no-op once it ended; stops the remote work when the caller gave up

    async def generate_stream(self, model: str, values: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        raise GenerationError("the generate contract's server-sent events are HTTP's; over gRPC it streams")
        yield  # pragma: no cover - makes this an async generator

    async def close(self) -> None:
        await self.channel.close()


async def _finished(call: Any) -> None:
    """Let the server end a stream whose last response came, rather than cancel it: a cancellation that
    reaches tritonserver before 2.57 (PyTriton 0.7 ships 2.51) between its final response and the end of
    the call leaks the stream's state, and with it a reference to the model, which then never unloads
    (triton-inference-server/server#8078; seen here as ``Waiting for the callback to retrieve cancellation
    ... step CANCELLATION_ISSUED`` in its verbose log, then a stop that hangs). A server that does not end
    it within ``STREAM_END_WAIT_S`` is cancelled as before."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(call.code(), STREAM_END_WAIT_S)


def _request(model: str, arrays: dict[str, np.ndarray], outputs: list[str]) -> Any:
    """A gRPC ``ModelInferRequest`` for named arrays (``tritonclient``'s builder, as its own clients use it)."""
    import tritonclient.grpc as grpc_client
    from tritonclient.grpc._utils import _get_inference_request

    inputs = []
    for name, array in arrays.items():
        item = grpc_client.InferInput(name, list(array.shape), _datatype(array))
        item.set_data_from_numpy(array)
        inputs.append(item)
    return _get_inference_request(
        model_name=model,
        inputs=inputs,
        model_version="",
        request_id="",
        outputs=[grpc_client.InferRequestedOutput(name) for name in outputs] or None,
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=0,
        timeout=None,
        parameters=None,
    )


@contextlib.contextmanager
def _grpc_errors() -> Iterator[None]:
    """Raise a failed gRPC call as ``tritonclient``'s exception (its details and status), as its clients do."""
    import grpc
    from tritonclient.utils import InferenceServerException

    try:
        yield
    except grpc.aio.AioRpcError as error:
        raise InferenceServerException(msg=error.details(), status=str(error.code())) from None


def _datatype(array: np.ndarray) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return np_to_triton_dtype(array.dtype)


def http_error(status: int, body: str) -> str:
    """The error text of a failed generate call: a JSON body, or an SSE ``data:`` event holding one."""
    for candidate in (body, *(line[5:] for line in body.splitlines() if line.startswith("data:"))):
        try:
            return str(json.loads(candidate).get("error", candidate))
        except (ValueError, AttributeError):
            continue
    return f"HTTP {status}: {body[:300]}"
