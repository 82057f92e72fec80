"""The operator endpoints behind ``--auth`` / ``--metrics-token``: ``/metrics`` refuses anonymous callers
and takes the page's credentials (Basic) or the token (Bearer); an anonymous ``/health`` says only whether
the server is ready, never a process id. Real app process, real HTTP on loopback."""

from __future__ import annotations

import base64

import pytest
import requests
from starlette.requests import Request
from support import running_app

from vlm_demo.config import Config
from vlm_demo.web.operator import KeyDoor, OperatorDoor


@pytest.fixture(scope="module")
def guarded(tiny_dir: str):
    with running_app("--auth", "alice:s3cret", "--metrics-token", "scrape-me") as url:
        yield url


def test_anonymous_health_says_only_whether_it_is_ready(guarded: str) -> None:
    answer = requests.get(guarded + "/health", timeout=10)
    assert answer.status_code == 200
    assert answer.json() == {"status": "ok", "ready": True}
    assert "pid" not in answer.text
    full = requests.get(guarded + "/health", timeout=10, auth=("alice", "s3cret")).json()
    assert full["ready"] is True and full["details"]["engine_pid"] > 0


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Basic " + base64.b64encode(b"alice:wrong").decode()},
        {"Authorization": "Bearer not-the-token"},
        {"Authorization": "Basic !!!not-base64"},
        {"Authorization": "scrape-me"},
    ],
    ids=["anonymous", "wrong-password", "wrong-token", "garbage", "no-scheme"],
)
def test_metrics_refuse_anyone_without_the_credentials(guarded: str, headers: dict[str, str]) -> None:
    answer = requests.get(guarded + "/metrics", headers=headers, timeout=10)
    assert answer.status_code == 401
    assert answer.headers["WWW-Authenticate"].startswith("Basic realm=")
    assert "--auth USER:PASS" in answer.json()["error"] and "--metrics-token" in answer.json()["error"]
    assert "vlm_requests_total" not in answer.text


def test_metrics_take_the_page_credentials_or_the_token(guarded: str) -> None:
    by_password = requests.get(guarded + "/metrics", auth=("alice", "s3cret"), timeout=10)
    by_token = requests.get(guarded + "/metrics", headers={"Authorization": "Bearer scrape-me"}, timeout=10)
    for answer in (by_password, by_token):
        assert answer.status_code == 200
        assert "vlm_queue_depth" in answer.text


def request_with(authorization: str | None) -> Request:
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    return Request({"type": "http", "method": "GET", "path": "/metrics", "headers": headers})


def test_a_token_alone_guards_with_a_bearer_challenge_and_an_open_server_is_open() -> None:
    token_only = OperatorDoor(Config(metrics_token="t0k"))
    assert token_only.guarded
    assert token_only.allows(request_with("Bearer t0k")) and token_only.allows(request_with("bearer  t0k"))
    assert not token_only.allows(request_with(None))
    assert not token_only.allows(request_with("Basic " + base64.b64encode(b"t0k:t0k").decode()))
    refusal = token_only.refusal()
    assert refusal.status_code == 401 and refusal.headers["WWW-Authenticate"] == "Bearer"
    open_door = OperatorDoor(Config())
    assert not open_door.guarded and open_door.allows(request_with(None))


def test_a_key_owns_what_it_stores_and_without_keys_everyone_is_one_owner() -> None:
    """Whose stored responses a ``/v1`` caller sees: its key's digest (never the key itself) where keys are
    checked; one shared owner where they are not."""
    keyed = KeyDoor(Config(api_key="sk-one"))
    owner = keyed.owner(request_with("Bearer sk-one"))
    assert owner and "sk-one" not in owner and owner == keyed.owner(request_with("bearer  sk-one"))
    assert keyed.owner(request_with("Bearer sk-two")) != owner
    assert KeyDoor(Config()).owner(request_with("Bearer anything")) == KeyDoor(Config()).owner(request_with(None)) == ""
