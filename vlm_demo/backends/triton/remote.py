"""The remote Triton server as the demo sees it: where it is, whether it (and the model) are ready, how the
model wants to be called (its metadata and config), and what a failure talking to it means as one of the
demo's typed errors.

Readiness and metadata are a few calls at start-up and one per ``/health`` probe, over Triton's plain
(blocking) clients; answers go over the asynchronous transports (:mod:`.transport`).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from vlm_demo.errors import BackendTimeoutError, BackendUnavailableError, DemoError, GenerationError
from vlm_demo.triton import contract
from vlm_demo.triton.contract import error_from_text

log = logging.getLogger(__name__)


@dataclass
class Endpoint:
    """A parsed ``--triton-url``: ``http://host:port`` or ``grpc://host:port``."""

    scheme: str  # "http" or "grpc"
    address: str  # host:port, as tritonclient wants it

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parsed = urlparse(url if "://" in url else "http://" + url)
        if parsed.scheme not in {"http", "grpc"} or not parsed.hostname:
            raise SystemExit(f"--triton-url must look like http://host:port or grpc://host:port, got {url!r}")
        port = parsed.port or (8001 if parsed.scheme == "grpc" else 8000)
        return cls(parsed.scheme, f"{parsed.hostname}:{port}")

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}"


# ---- turning transport failures into the demo's typed errors ------------------------------------------


def _status_name(exc: Exception) -> str:
    """The status a Triton client error carries (tritonclient's ``status()``, gRPC's ``code()``), as text."""
    for name in ("status", "code"):
        method = getattr(exc, name, None)
        if callable(method):
            return str(method() or "")
    return ""


class TritonStarting(BackendUnavailableError):
    """Triton is not there yet: nothing listens at the address, the server is still starting, or the model is
    still loading. At start-up the demo waits for it (up to ``--triton-timeout``); later it is an error."""


def to_demo_error(exc: BaseException, endpoint: Endpoint, model: str, timeout: float) -> DemoError:
    """A specific, user-facing error for anything a Triton call can raise."""
    if isinstance(exc, DemoError):
        return exc
    text = str(exc) or exc.__class__.__name__
    typed = error_from_text(text)
    if typed is not None:
        return typed
    status = _status_name(exc) if isinstance(exc, Exception) else ""
    if isinstance(exc, (TimeoutError, socket.timeout)) or "DEADLINE_EXCEEDED" in status or "timed out" in text.lower():
        return BackendTimeoutError(f"Triton at {endpoint.url} did not answer within {timeout:g} s.")
    if isinstance(exc, ConnectionError) or "UNAVAILABLE" in status or _is_connection_error(exc):
        return TritonStarting(f"Triton at {endpoint.url} is unreachable ({short(text)}). Is the server running?")
    lowered = text.lower()
    if any(word in lowered for word in ("unknown model", "not found", "not ready", "unavailable", "is stopping")):
        return BackendUnavailableError(f"Triton model '{model}' is not available at {endpoint.url}: {short(text)}")
    return GenerationError(f"Triton model '{model}' failed: {short(text)}")


def _is_connection_error(exc: BaseException) -> bool:
    """Nothing answered at the address (the asynchronous HTTP transport's way of saying it)."""
    import aiohttp

    return isinstance(exc, aiohttp.ClientConnectionError) and not isinstance(exc, aiohttp.ServerTimeoutError)


def short(text: str) -> str:
    """Triton wraps Python-backend errors in a traceback; its last non-empty line says what happened."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else text)[:300]


# ---- readiness and metadata --------------------------------------------------------------------------


@dataclass
class ModelInfo:
    """What the model's metadata (and config, when readable) says about how to call it."""

    protocol: str  # "infer" or "generate"
    inputs: dict[str, list[int]]  # name -> shape as the metadata reports it
    outputs: list[str]
    batched: bool  # IMAGE carries a leading batch dimension (max_batch_size > 0)
    decoupled: bool
    served_model: str | None = None  # what the config's "model" parameter says the engine runs, if it says


def _admin_client(endpoint: Endpoint, timeout: float) -> Any:
    if endpoint.scheme == "http":
        import tritonclient.http as mod

        return mod.InferenceServerClient(endpoint.address, connection_timeout=timeout, network_timeout=timeout)
    import tritonclient.grpc as mod

    return mod.InferenceServerClient(endpoint.address)


def check_ready(endpoint: Endpoint, model: str, timeout: float) -> dict[str, Any]:
    """Raise a typed error saying which of server or model is not ready, or that no Triton answered at all."""
    client = _admin_client(endpoint, timeout)
    kwargs = {} if endpoint.scheme == "http" else {"client_timeout": timeout}
    try:
        try:
            live = client.is_server_live(**kwargs)
            server_ready = client.is_server_ready(**kwargs)
        except Exception as exc:
            error = to_demo_error(exc, endpoint, model, timeout)
            if isinstance(error, GenerationError):  # an odd answer to a health check: something else is there
                error = BackendUnavailableError(
                    f"Triton at {endpoint.url} is unreachable or not a Triton server ({short(str(exc))})."
                )
            raise error from None
        if not live or not server_ready:
            raise not_ready_error(endpoint, "live" if not live else "ready", timeout)
        try:
            model_ready = client.is_model_ready(model, **kwargs)
        except Exception as exc:
            raise to_demo_error(exc, endpoint, model, timeout) from None
        if not model_ready:
            raise _model_not_ready(client, kwargs, endpoint, model)
        return {"server_ready": True, "model_ready": True}
    finally:
        client.close()


def _model_not_ready(client: Any, kwargs: dict[str, Any], endpoint: Endpoint, model: str) -> DemoError:
    """Why a ready server's model is not. Only a model the repository index says failed to load is final;
    one it does not list yet (a server still binding its models) or that is loading is worth waiting for,
    and so is any model where the index is closed (PyTriton restricts it)."""
    try:
        index = client.get_model_repository_index(**({"as_json": True} if kwargs else {}))
    except Exception:  # noqa: BLE001 - an index some servers restrict: the plain answer then
        index = None
    entries = index.get("models", []) if isinstance(index, dict) else index
    if not isinstance(entries, list):
        return TritonStarting(
            f"Triton at {endpoint.url} is ready but model '{model}' is not (unknown, still loading or failed to load)."
        )
    states = {entry.get("name"): entry for entry in entries if isinstance(entry, dict)}
    entry = states.get(model)
    if entry is None:
        served = ", ".join(sorted(str(name) for name in states)) or "none yet"
        return TritonStarting(f"Triton at {endpoint.url} has no model '{model}' (it serves: {served}).")
    state = str(entry.get("state", "")).upper()
    if state in ("LOADING", "READY", ""):
        return TritonStarting(f"Triton at {endpoint.url} is still loading model '{model}'.")
    reason = entry.get("reason") or state.lower()
    return BackendUnavailableError(f"Triton at {endpoint.url} could not load model '{model}': {short(str(reason))}")


def not_ready_error(endpoint: Endpoint, check: str, timeout: float) -> DemoError:
    """Why a health check said no: only Triton's own "no" (HTTP 400, or gRPC) means "up but not ready".

    Over HTTP the client only reports "not 200". Whatever else answers at the address (a gateway's 504
    after its own timeout, a 404 from some other server, an intercepting proxy) means no Triton was
    reached, and "up but not ready" would send the user looking at the wrong thing.
    """
    if endpoint.scheme == "http":
        import requests

        url = f"http://{endpoint.address}/v2/health/{check}"
        with requests.Session() as session:
            session.trust_env = False  # ask the address itself, as the Triton client does (it ignores *_PROXY)
            try:
                status = session.get(url, timeout=timeout).status_code
            except requests.Timeout:
                return BackendTimeoutError(f"Triton at {endpoint.url} did not answer within {timeout:g} s.")
            except requests.RequestException as exc:
                return BackendUnavailableError(f"Triton at {endpoint.url} is unreachable ({short(str(exc))}).")
        if status in (408, 504):
            return BackendTimeoutError(
                f"Triton at {endpoint.url} did not answer within {timeout:g} s (a gateway answered HTTP {status})."
            )
        if status not in (200, 400):
            return BackendUnavailableError(
                f"Triton at {endpoint.url} is unreachable: /v2/health/{check} answered HTTP {status}, which is "
                "not a Triton server's answer. Is the address right and the server running?"
            )
    return TritonStarting(
        f"Triton at {endpoint.url} is up but not ready (health/{check} says no: still starting or stopping?)."
    )


def inspect_model(endpoint: Endpoint, model: str, protocol: str, timeout: float) -> ModelInfo:
    """Check readiness and read the model's metadata to decide how to call it."""
    check_ready(endpoint, model, min(timeout, 10.0))
    client = _admin_client(endpoint, timeout)
    kwargs: dict[str, Any] = {} if endpoint.scheme == "http" else {"as_json": True, "client_timeout": timeout}
    try:
        try:
            meta = client.get_model_metadata(model, **kwargs)
        except Exception as exc:
            raise to_demo_error(exc, endpoint, model, timeout) from None
        try:
            config = client.get_model_config(model, **kwargs)
            config = config.get("config", config)
        except Exception:  # some servers restrict the config endpoint; metadata is enough
            config = {}
    finally:
        client.close()
    inputs = {i["name"]: [int(d) for d in i.get("shape", [])] for i in meta.get("inputs", [])}
    outputs = [o["name"] for o in meta.get("outputs", [])]
    if protocol == "auto":
        if contract.IMAGE in inputs and contract.QUESTION in inputs:
            protocol = "infer"
        elif contract.TEXT_INPUT in inputs:
            protocol = "generate"
        else:
            raise BackendUnavailableError(
                f"Triton model '{model}' speaks neither contract: inputs {sorted(inputs)} "
                "(expected IMAGE+QUESTION, or text_input). Set --triton-protocol if this is wrong."
            )
    needed = {"infer": (contract.IMAGE, contract.QUESTION), "generate": (contract.TEXT_INPUT,)}[protocol]
    missing = [n for n in needed if n not in inputs]
    if missing:
        raise BackendUnavailableError(
            f"Triton model '{model}' lacks input(s) {missing} needed by --triton-protocol {protocol}."
        )
    if protocol == "infer" and contract.ANSWER not in outputs:
        raise BackendUnavailableError(f"Triton model '{model}' has no ANSWER output (outputs: {outputs}).")
    policy = config.get("model_transaction_policy", {}) if isinstance(config, dict) else {}
    decoupled = bool(policy.get("decoupled", protocol == "generate" and not config))
    if decoupled and protocol == "infer" and endpoint.scheme == "http":
        raise BackendUnavailableError(
            f"Triton model '{model}' is decoupled (streaming); Triton streams it only over gRPC: use --triton-url grpc://..."
        )
    batched = protocol == "infer" and len(inputs[contract.IMAGE]) == 4
    return ModelInfo(protocol, inputs, outputs, batched, decoupled, _parameter(config, contract.MODEL_PARAMETER))


def _parameter(config: Any, name: str) -> str | None:
    """A model-config parameter's string value, as both transports' JSON config gives it; ``None`` if absent."""
    parameters = config.get("parameters") if isinstance(config, dict) else None
    value = parameters.get(name) if isinstance(parameters, dict) else None
    return value.get("string_value") if isinstance(value, dict) else None
