"""Serve our engine from a real Triton Inference Server (PyTriton), speaking the two contracts the demo calls.

* ``llama_3_2v_11b_cot_ensemble`` — ``IMAGE`` UINT8 ``[H,W,3]`` + ``QUESTION`` BYTES → ``ANSWER`` BYTES, with
  Triton's dynamic batcher in front: each batch Triton forms is handed whole to the engine, so it becomes one
  engine batch. Optional inputs carry sampling parameters; optional outputs carry the finish reason, token
  counts and a per-request ``ERROR`` (one bad request must not fail the batch it was grouped into).
* ``vllm_model`` — the generate contract of Triton's vLLM backend, decoupled (streaming): ``text_input``
  (chat-templated prompt), ``image`` (base64 of an image file), ``stream``, ``sampling_parameters`` (JSON),
  ``exclude_input_in_output`` → ``text_output`` pieces.

What a request does is :mod:`vlm_demo.triton.handlers`' (plain numpy, shared with the classic model
repository's ``model.py`` files in ``vlm_demo/triton/repo``); the names and types on the wire are
:mod:`vlm_demo.triton.contract`'s. This module binds them to PyTriton.

Run ``python -m vlm_demo.triton.serve --model tiny``. The bundled ``tritonserver`` needs
``LD_LIBRARY_PATH`` to include this Python's ``LIBDIR`` (see docs/triton.md); without it the Python backend
stub loads the system libpython and fails at start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from vlm_demo import REPO_ROOT, logs
from vlm_demo.config import Config, build_parser, config_from_namespace
from vlm_demo.errors import DemoError, EngineStoppedError
from vlm_demo.request import DEFAULT_MAX_NEW_TOKENS, Limits
from vlm_demo.triton import contract
from vlm_demo.triton.contract import ENSEMBLE_MODEL, GENERATE_MODEL, SAMPLING_INPUTS, error_text
from vlm_demo.triton.handlers import EnsembleHandler, decode_generate_request, generate_responses

if TYPE_CHECKING:
    from vlm_demo.engine.batching.base import Engine

log = logging.getLogger(__name__)

ANSWERS_GRACE_S = 60.0  # on SIGTERM, answers in flight get this long to finish; then they are ended
IDLE_GIVE_UP_S = 10.0  # on SIGTERM, an unload still pending this long after our last answer ended is given up
EXIT_TIMEOUT_S = 5  # tritonserver's wait for clients to hang up once the models are unloaded (its default: 30)
MISSING_PYTRITON = (
    "python -m vlm_demo.triton.serve needs PyTriton, which this Python does not have: install "
    "requirements-triton.txt, in a virtual environment of its own (PyTriton 0.7 needs numpy below 2; see docs/triton.md)"
)

# ---- PyTriton wiring ----------------------------------------------------------------------------------


class _GenerateModel:
    """PyTriton's decoupled infer function: an async generator, so many streams run at once.

    PyTriton runs infer functions on one asyncio loop; a blocking generator would serialise every stream
    (and the engine could never batch them). Each request's engine stream is read by a thread that hands
    pieces to the loop.
    """

    def __init__(self, engine: Engine, limits: Limits, default_max_tokens: int, stopping: threading.Event) -> None:
        self.engine = engine
        self.limits = limits
        self.default_max_tokens = default_max_tokens
        self.stopping = stopping  # set when the server ends the answers still running at its stop
        self.streaming = 0  # streams this model is answering now (the stop's log says how many are left)

    async def __call__(self, requests: list[Any]) -> Any:
        loop = asyncio.get_running_loop()
        for request in requests:  # Triton sends one request at a time to a model without batching
            pieces: asyncio.Queue = asyncio.Queue()
            stop = threading.Event()
            thread = threading.Thread(target=self._pump, args=(request, loop, pieces, stop), daemon=True)
            thread.start()
            self.streaming += 1
            try:
                while True:
                    kind, payload = await pieces.get()
                    if kind == "error":
                        if isinstance(payload, EngineStoppedError) and self.stopping.is_set():
                            break  # ended by the server's own stop, after the grace: the stream just ends
                        raise RuntimeError(error_text(payload) if isinstance(payload, DemoError) else str(payload))
                    if kind == "end":
                        break
                    yield [payload]
            finally:
                self.streaming -= 1
                stop.set()

    def _pump(
        self, request: Any, loop: asyncio.AbstractEventLoop, pieces: asyncio.Queue, stop: threading.Event
    ) -> None:
        def put(kind: str, payload: Any) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, (kind, payload))

        responses: Generator[dict[str, np.ndarray], None, None] | None = None
        try:
            call = decode_generate_request(dict(request), request.parameters, self.limits, self.default_max_tokens)
            responses = generate_responses(self.engine, call)
            for response in responses:
                if stop.is_set():
                    break
                put("data", response)
            put("end", None)
        except DemoError as exc:
            put("error", exc)
        except Exception as exc:  # noqa: BLE001 - reported to the client as a Triton error
            log.exception("generate request failed")
            put("error", exc)
        finally:
            if responses is not None:
                responses.close()


def _ensemble_fn(handler: EnsembleHandler) -> Any:
    """Run the blocking engine batch off PyTriton's event loop."""

    async def infer(requests: list[Any]) -> list[dict[str, np.ndarray]]:
        return await asyncio.get_running_loop().run_in_executor(None, handler, requests)

    return infer


def _wire(kind: type) -> type:
    """PyTriton's name for a contract dtype (BYTES tensors are ``bytes``)."""
    return bytes if kind is np.object_ else kind


def bind_models(triton: Any, engine: Engine, config: Config, stopping: threading.Event | None = None) -> _GenerateModel:
    """Bind both contracts to a PyTriton ``Triton`` instance (``stopping``: set when the server's stop ends the
    answers still running); returns the generate contract's model (it counts the streams it is answering)."""
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

    default_tokens = min(DEFAULT_MAX_NEW_TOKENS, config.max_new_tokens)
    handler = EnsembleHandler(engine, Limits.from_config(config), default_tokens)
    triton.bind(
        model_name=ENSEMBLE_MODEL,
        infer_func=_ensemble_fn(handler),
        inputs=[
            Tensor(name=contract.IMAGE, dtype=np.uint8, shape=(-1, -1, 3)),
            Tensor(name=contract.QUESTION, dtype=bytes, shape=(1,)),
            Tensor(name=contract.HISTORY, dtype=bytes, shape=(1,), optional=True),
            *[Tensor(name=n, dtype=_wire(t), shape=(1,), optional=True) for n, t in SAMPLING_INPUTS.items()],
        ],
        outputs=[Tensor(name=n, dtype=_wire(t), shape=(1,)) for n, t in contract.INFER_OUTPUT_TYPES.items()],
        config=ModelConfig(
            max_batch_size=engine.max_batch_size,  # the engine sizes it (from memory when 0)
            # A short delay lets concurrent requests meet; a lone request waits at most this long.
            batcher=DynamicBatcher(max_queue_delay_microseconds=int(config.batch_window_ms * 1000)),
            response_cache=config.response_cache_mb > 0,  # Triton's own cache (see cache_config)
        ),
        strict=True,
    )
    generate = _GenerateModel(engine, Limits.from_config(config), default_tokens, stopping or threading.Event())
    triton.bind(
        model_name=GENERATE_MODEL,
        infer_func=generate,
        inputs=[
            Tensor(name=contract.TEXT_INPUT, dtype=bytes, shape=(1,)),
            Tensor(name=contract.IMAGE_INPUT, dtype=bytes, shape=(-1,), optional=True),
            Tensor(name=contract.SAMPLING_PARAMETERS, dtype=bytes, shape=(1,), optional=True),
            *[Tensor(name=n, dtype=np.bool_, shape=(1,), optional=True) for n in contract.GENERATE_FLAGS],
        ],
        outputs=[Tensor(name=n, dtype=_wire(t), shape=(-1,)) for n, t in contract.GENERATE_OUTPUT_TYPES.items()],
        config=ModelConfig(batching=False, decoupled=True),
    )
    name_the_model(triton, config.model)
    return generate


def name_the_model(triton: Any, model: str) -> None:
    """Put ``parameters { key: "model" ... }`` in every bound model's config, as the repository's config.pbtxt
    files have it, so a client can tell which model answers (the tiny one gets the page's tiny banner).

    PyTriton's ``ModelConfig`` has no parameters: this adds one to the config it generates (its
    ``backend_parameters``), which must happen before the models load, i.e. before the server starts.
    """
    for bound in triton._model_manager.models:
        bound._get_triton_model_config().backend_parameters[contract.MODEL_PARAMETER] = model


def triton_config_for(
    config: Config,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    host: str,
    repository: str | None = None,
    gpu: bool = True,
) -> Any:
    """PyTriton's server settings: our ports on ``host``, the response cache, a model repository if given.

    Without a GPU, no GPU metrics: tritonserver would otherwise try NVML and DCGM at start-up and print an
    ``Error: Failed to initialize NVML`` line and a DCGM warning that mean only "no GPU here"."""
    from pytriton.triton import TritonConfig

    return TritonConfig(
        model_repository=repository,
        allow_gpu_metrics=gpu,
        exit_timeout_secs=EXIT_TIMEOUT_S,
        http_address=host,
        grpc_address=host,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        cache_config=cache_config(config),
    )


def cache_config(config: Config) -> list[str] | None:
    """Triton's ``--cache-config`` for its response cache (the infer model declares ``response_cache``):
    the local cache, ``--response-cache-mb`` large; ``None`` (no cache) at 0."""
    if config.response_cache_mb <= 0:
        return None
    return [f"local,size={int(config.response_cache_mb * 1024**2)}"]


def explain_expected_errors(gpu: bool, in_process: bool) -> None:
    """Say before tritonserver starts which of its ``E`` lines are expected here, so nobody hunts them down:
    without a GPU it reports that it could not initialise CUDA, and with models bound in-process PyTriton
    loads each one with a config of its own, which tritonserver 2.51 cannot date (once per model)."""
    expected = []
    if not gpu:
        expected.append('"CudaDriverHelper has not been initialized" (no GPU here)')
    if in_process:
        expected.append('"Failed to set config modification time" once per model (PyTriton passes configs inline)')
    if expected:
        log.info("tritonserver will log %s: expected, and harmless", " and ".join(expected))


def libdir_on_path() -> bool:
    """Whether this Python's LIBDIR is on ``LD_LIBRARY_PATH`` (the Python backend stub needs it)."""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    return libdir in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)


def put_libdir_on_path() -> None:
    """Put this Python's LIBDIR on ``LD_LIBRARY_PATH`` before tritonserver starts: it and the Python backend
    stubs it starts inherit it, so the stub finds this interpreter's libpython rather than the system's."""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    if libdir and not libdir_on_path():
        current = os.environ.get("LD_LIBRARY_PATH", "")
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libdir, current]))
        log.info("added %s to LD_LIBRARY_PATH for Triton's Python backend", libdir)


def _security() -> Any:
    """PyTriton token-protects statistics by default; they show Triton's batch sizes, so leave them readable
    and keep protecting the endpoints that change the server."""
    from pytriton.triton import TritonSecurityConfig

    return TritonSecurityConfig(restricted_endpoints=["shared-memory", "model-repository", "trace", "logging"])


def serve(config: Config, http_port: int, grpc_port: int, metrics_port: int, host: str) -> None:
    """Load the engine, start Triton with both models bound, and block until SIGTERM/SIGINT."""
    from pytriton.triton import Triton

    from vlm_demo.engine import make_engine

    engine = make_engine(config)
    gpu = str(engine.worker.device).startswith("cuda")
    explain_expected_errors(gpu, in_process=True)
    security = _security()
    triton = Triton(
        config=triton_config_for(config, http_port, grpc_port, metrics_port, host, gpu=gpu), security_config=security
    )
    stopping = threading.Event()

    def end_answers() -> None:
        log.warning("ending the engine's answers: %d generate streams still open, %d requests in the engine",
                    generate.streaming, len(engine.live))  # fmt: skip
        stopping.set()
        engine.shutdown()

    try:
        # before the server starts: the models load with their parameters
        generate = bind_models(triton, engine, config, stopping)
        log.info(
            "Triton starting to serve %s and %s on http://%s:%d and grpc://%s:%d",
            ENSEMBLE_MODEL,
            GENERATE_MODEL,
            host,
            http_port,
            host,
            grpc_port,
        )
        run_until_stopped(triton, f"{host}:{http_port}", [ENSEMBLE_MODEL, GENERATE_MODEL], security.access_token,
                          overdue=end_answers, idle=lambda: generate.streaming == 0 and not engine.live)  # fmt: skip
    finally:
        triton.stop()
        engine.shutdown()


def local_copy_of_repository(repository: str, into: str, model: str | None, cpu: bool) -> str:
    """A copy of ``repository`` to serve here: each model's ``model`` parameter set to ``model`` (an explicit
    ``--model``; clients read the parameter to learn which model answers), and with ``cpu`` its GPU instance
    groups run on the CPU (machines without a GPU)."""
    import re
    import shutil

    target = os.path.join(into, "model_repository")
    shutil.copytree(repository, target, ignore=shutil.ignore_patterns("__pycache__", "*.md"))
    for name in os.listdir(target):
        path = os.path.join(target, name, "config.pbtxt")
        if os.path.exists(path):
            with open(path) as f:
                text = f.read()
            if model is not None:
                named = r'(key:\s*"' + contract.MODEL_PARAMETER + r'"\s*value:\s*\{\s*string_value:\s*")[^"]*"'
                text = re.sub(named, lambda found: found.group(1) + model + '"', text)
            if cpu:
                text = re.sub(r"kind:\s*KIND_GPU", "kind: KIND_CPU", text)
                text = re.sub(r"\n\s*gpus:\s*\[[^\]]*\]", "", text)
            with open(path, "w") as f:
                f.write(text)
    return target


def serve_repository(
    repository: str, config: Config, http_port: int, grpc_port: int, metrics_port: int, host: str
) -> None:
    """Serve a classic model repository (``vlm_demo/triton/repo``) with the bundled tritonserver, no Docker.

    It serves a copy (:func:`local_copy_of_repository`): an explicit ``--model`` replaces the ``model``
    parameters, and without a GPU the instances run on the CPU. The Python-backend stubs inherit this
    environment: ``PYTHONPATH`` gets this package, an explicit ``--model`` is also ``VLM_MODEL`` and a
    ``--quantize`` other than auto ``VLM_QUANTIZE``.
    """
    import tempfile

    import torch
    from pytriton.triton import Triton

    package_parent = REPO_ROOT
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH", "")) if p)
    if config.model_explicit:  # also for a config.pbtxt without a model parameter
        os.environ["VLM_MODEL"] = config.model
    if config.tiny_dir:
        os.environ["VLM_TINY_DIR"] = config.tiny_dir
    if config.quantize != "auto":  # the stubs' engines load the weights: quantized as asked here
        os.environ["VLM_QUANTIZE"] = config.quantize
    cpu = not torch.cuda.is_available()
    if cpu:
        log.warning("no GPU: running the repository's KIND_GPU instances on the CPU")
    explain_expected_errors(not cpu, in_process=False)
    with tempfile.TemporaryDirectory() as scratch:
        repository = local_copy_of_repository(repository, scratch, config.model if config.model_explicit else None, cpu)
        triton_config = triton_config_for(config, http_port, grpc_port, metrics_port, host, repository, gpu=not cpu)
        security = _security()
        with Triton(config=triton_config, security_config=security) as triton:
            log.info("Triton serving %s on http://%s:%d and grpc://%s:%d", repository, host, http_port, host, grpc_port)
            models = [name for name in os.listdir(repository) if os.path.isdir(os.path.join(repository, name))]
            run_until_stopped(triton, f"{host}:{http_port}", models, security.access_token)


def build_arg_parser() -> argparse.ArgumentParser:
    parser = build_parser(
        "Serve the engine from Triton Inference Server (PyTriton): the ensemble and generate contracts.",
        prog="python -m vlm_demo.triton.serve",
        only=[
            "model",
            "device",
            "dtype",
            "quantize",
            "max_batch_size",
            "batch_window_ms",
            "max_queue",
            "max_new_tokens",
            "response_cache_mb",
            "image_cache_mb",
            "max_image_pixels",
            "max_question_chars",
            "batching",
            "structured_stages",
            "tiny_dir",
        ],
    )
    parser.add_argument("--host", default="127.0.0.1", help="Bind address for HTTP and gRPC (default loopback).")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument(
        "--model-repository",
        default="",
        help="Serve this classic model repository (e.g. vlm_demo/triton/repo) instead of binding the engine in-process.",
    )
    return parser


def run_until_stopped(triton: Any, address: str, models: Sequence[str], token: str | None,
                      overdue: Callable[[], None] | None = None,
                      idle: Callable[[], bool] | None = None) -> None:  # fmt: skip
    """Start tritonserver and serve until SIGTERM or SIGINT (a service manager, ``docker stop``, Ctrl+C, a test)
    or until it dies; then unload the models, so the caller's ``triton.stop()`` finds nothing running.

    In that order because tritonserver, told to stop, first waits for its clients to hang up (a web replica's
    keep-alive connection never does) and then exits without unloading anything: its model processes died
    mid-way and left shared memory for Python's resource tracker to reclaim ("leaked shared_memory objects").
    Unloading first lets requests in flight finish and every model process end cleanly; PyTriton's stop then
    removes its workspace (``~/.cache/pytriton/workspace_*``). Answers still running after ``ANSWERS_GRACE_S``
    (PyTriton does not tell a model that a client hung up, so a gone client's answer runs to its end) are
    ended through ``overdue``. ``idle`` says whether none of our answers is running: an unload Triton still has
    not finished ``IDLE_GIVE_UP_S`` after that is not waited for: tritonserver before 2.57 leaks a gRPC stream's
    state, and with it its hold on the model, when the client cancels the stream between its final response
    and its end (server#8078; our own client lets such streams end, other clients may not). SIGINT is handled
    too: a server started in the background has it ignored otherwise."""
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    triton.run()
    log.info("serving; SIGTERM or Ctrl+C stops it")
    while not stopping.is_set():
        time.sleep(1)  # a signal cuts the sleep short
        if not triton.is_alive():
            log.error("tritonserver or a model process stopped on its own; shutting down")
            return
    log.info("stopping: unloading the models (answers in flight get %.0f s to finish)", ANSWERS_GRACE_S)
    unloaded = unload_models(address, models, token, ANSWERS_GRACE_S, idle=idle)
    if not unloaded and overdue is not None and not (idle is not None and idle()):
        log.warning("answers were still running after %.0f s: ending them", ANSWERS_GRACE_S)
        overdue()  # every stream ends ("the server shut down"), so the models' handlers can finish
        unload_models(address, models, token, request=False, idle=idle)
    log.info("stopping tritonserver (it gives open client connections up to %d s to close)", EXIT_TIMEOUT_S)


def tritonserver_in_a_group_of_its_own() -> None:
    """Have PyTriton start tritonserver, and with it its model processes, in a process group of their own.

    A stop is often sent to a whole process group: a terminal's Ctrl+C, the SIGTERM of ``timeout`` or a container
    runtime. In ours, tritonserver stopped at once on it, its model processes died mid-way (Python's resource
    tracker then reported their "leaked shared_memory objects") and the orderly unload found nobody to talk to
    ("Connection refused"). In a group of its own only this process hears the stop, unloads the models, and then
    stops tritonserver itself (PyTriton's stop; and should this process die, the kernel stops tritonserver, as
    PyTriton asks it to). PyTriton starts it through ``sh``, whose defaults hold the option."""
    import sh

    sh.Command._call_args["new_group"] = True


def unload_models(
    address: str, models: Sequence[str], token: str | None, timeout_s: float = 120, request: bool = True,
    idle: Callable[[], bool] | None = None,
) -> bool:  # fmt: skip
    """Unload ``models`` through Triton's model-control API and wait until it is done: Triton unloads in the
    background, and with strict readiness it says the server is ready again once no model is unloading.
    Whether it was done within ``timeout_s`` (a model waits for the answers it is streaming); ``request=False``
    only waits (for an unload asked before). ``idle``: whether none of our answers is running; when it has been
    for ``IDLE_GIVE_UP_S`` and Triton still unloads, the wait ends (what Triton waits for is not ours to end)."""
    import tritonclient.http as httpclient

    headers = {"triton-access-token": token} if token else None
    client = httpclient.InferenceServerClient(address)
    deadline = time.monotonic() + timeout_s
    try:
        for name in models if request else ():
            client.unload_model(name, headers=headers)
        idle_since: float | None = None
        while time.monotonic() < deadline and (
            any(client.is_model_ready(name) for name in models) or not client.is_server_ready()
        ):
            if idle is not None and idle():
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since >= IDLE_GIVE_UP_S:
                    log.warning("Triton is still unloading %.0f s after our last answer ended: stopping it anyway "
                                "(a client's stream it did not release; ours are all done)", IDLE_GIVE_UP_S)  # fmt: skip
                    return False
            else:
                idle_since = None
            time.sleep(0.2)
        if time.monotonic() >= deadline:
            log.warning("the models were still unloading after %.0f s", timeout_s)
            return False
        return True
    except Exception as err:  # noqa: BLE001 - tritonserver already gone: nothing left to unload
        log.warning("could not unload the models before stopping: %s", err)
        return True
    finally:
        client.close()


def main(argv: Sequence[str] | None = None) -> None:
    args = build_arg_parser().parse_args(argv)
    try:
        import pytriton  # noqa: F401 - only to say in one line that it is missing
    except ImportError:
        raise SystemExit(MISSING_PYTRITON) from None
    logs.setup()
    put_libdir_on_path()
    tritonserver_in_a_group_of_its_own()
    config = config_from_namespace(args)
    ports = (args.http_port, args.grpc_port, args.metrics_port, args.host)
    try:
        if args.model_repository:
            serve_repository(args.model_repository, config, *ports)
        else:
            serve(config, *ports)
    except KeyboardInterrupt:  # Ctrl+C while the model loaded, before tritonserver started: nothing to unload
        log.info("stopped before serving")
        raise SystemExit(130) from None


if __name__ == "__main__":
    main(sys.argv[1:])
