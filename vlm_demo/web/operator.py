"""Who may read the operator endpoints (``/metrics`` and the full ``/health``), and who may call the
programs' doors (``/v1`` and MCP).

Operator endpoints: open on a private box. Once the page has a password (``--auth``) or a scraper token is set
(``--metrics-token``), they hold what a stranger behind a share link should not see (process ids, the
memory plan, traffic): then ``/metrics`` needs the page's credentials (HTTP Basic) or the token (Bearer),
and an anonymous ``/health`` says only whether the server is ready, which is all a load balancer needs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import secrets

from fastapi import Request
from fastapi.responses import JSONResponse

from vlm_demo.config import Config


class KeyDoor:
    """The programs' doors (``/v1``, MCP): with ``--api-key`` every call needs ``Authorization: Bearer KEY``;
    with ``--auth`` and no key they are closed (the page's password must not leave a side door open)."""

    def __init__(self, config: Config) -> None:
        self.key = config.api_key
        self.closed = bool(config.auth) and not config.api_key

    def refusal(self, request: Request) -> tuple[str, str] | None:
        """``(code, message)`` saying why ``request`` may not call, or ``None`` when it may."""
        if self.key:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.key.encode()):
                return (
                    "invalid_api_key",
                    "Incorrect or missing API key: send 'Authorization: Bearer KEY' with the key the server was "
                    "started with (--api-key).",
                )
        elif self.closed:
            return (
                "api_key_required",
                "The API is closed: the page is password-protected (--auth) and no API key is set. Start the "
                "server with --api-key KEY (or VLM_API_KEY=KEY) and send 'Authorization: Bearer KEY'.",
            )
        return None

    def owner(self, request: Request) -> str:
        """Whose stored things (``/v1/responses``) a caller may see: a digest of the key it called with where
        keys are checked, else everyone's (``""``)."""
        if not self.key:
            return ""
        token = request.headers.get("authorization", "").partition(" ")[2].strip()
        return hashlib.sha256(token.encode()).hexdigest()


class OperatorDoor:
    """Checks a request's ``Authorization`` against ``--auth`` (Basic) and ``--metrics-token`` (Bearer)."""

    def __init__(self, config: Config) -> None:
        self.credentials = config.auth
        self.token = config.metrics_token
        self.guarded = bool(self.credentials or self.token)

    def allows(self, request: Request) -> bool:
        if not self.guarded:
            return True
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        value = value.strip()
        if scheme.lower() == "bearer" and self.token:
            return secrets.compare_digest(value.encode(), self.token.encode())
        if scheme.lower() == "basic" and self.credentials:
            try:
                given = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                return False
            return secrets.compare_digest(given, self.credentials.encode())
        return False

    def refusal(self) -> JSONResponse:
        """401 that says which credentials work; browsers and Prometheus both understand the challenge."""
        ways = []
        if self.credentials:
            ways.append("the page's --auth USER:PASS as HTTP Basic")
        if self.token:
            ways.append("'Authorization: Bearer TOKEN' with --metrics-token")
        challenge = 'Basic realm="LLaVA-CoT demo operator", charset="UTF-8"' if self.credentials else "Bearer"
        body = {"error": "The operator endpoints need credentials: " + " or ".join(ways) + "."}
        return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": challenge})

    def health(self, request: Request, body: dict, status_code: int) -> JSONResponse:
        """The full health body for the operator; only ``status`` and ``ready`` for anyone else."""
        if not self.allows(request):
            body = {"status": body["status"], "ready": body["ready"]}
        return JSONResponse(body, status_code=status_code, headers={"Retry-After": "5"} if status_code == 503 else None)
