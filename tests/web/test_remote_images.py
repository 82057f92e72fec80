"""Fetching image URLs (``--api-remote-images``) against real HTTP servers on loopback.

The real policy refuses loopback, so these servers are never reached under it (the tests check that no
request arrived). To exercise the fetching itself (limits, redirects, time), the tests pass a test-only
address policy that allows exactly 127.0.0.1, named as such: a public address cannot be served offline.
"""

from __future__ import annotations

import http.server
import ipaddress
import threading
import time
from collections.abc import Iterator

import pytest

from vlm_demo.errors import InvalidRequestError
from vlm_demo.web.api.remote_images import fetch_image, is_public

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 200


def only_127_0_0_1(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """TEST-ONLY address policy: this loopback address stands in for a public one."""
    return address == ipaddress.ip_address("127.0.0.1")


class Handler(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        Handler.hits.append(self.path)
        if self.path == "/image.png":
            self._send(200, PNG, {"Content-Length": str(len(PNG))})
        elif self.path == "/declared-big":
            self._send(200, b"", {"Content-Length": str(10_000_000)})
        elif self.path == "/chunked-big":  # no length declared: the limit is applied to what arrives
            self.send_response(200)
            self.end_headers()
            for _ in range(40):
                self.wfile.write(b"x" * 1000)
        elif self.path == "/to-metadata":
            self._send(302, b"", {"Location": "http://169.254.169.254/latest/meta-data/"})
        elif self.path == "/to-image":
            self._send(301, b"", {"Location": "/image.png"})
        elif self.path == "/loop":
            self._send(302, b"", {"Location": "/loop"})
        elif self.path == "/slow":
            self.send_response(200)
            self.end_headers()
            for _ in range(30):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        else:
            self._send(404, b"no", {})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class Site(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        pass  # the fetcher hanging up on an oversized or slow answer is what these tests cause


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    server = Site(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize(
    "address", ["127.0.0.1", "10.1.2.3", "192.168.0.1", "169.254.169.254", "100.64.0.1", "::1", "fe80::1", "0.0.0.0"]
)
def test_the_policy_refuses_every_non_public_address(address: str) -> None:
    assert not is_public(ipaddress.ip_address(address))


def test_the_policy_sees_through_ipv4_mapped_ipv6_and_allows_public_addresses() -> None:
    assert not is_public(ipaddress.ip_address("::ffff:127.0.0.1"))
    assert is_public(ipaddress.ip_address("93.184.216.34")) and is_public(ipaddress.ip_address("2606:4700::1"))


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "127.1"])
def test_loopback_urls_are_refused_before_any_connection(site: str, host: str) -> None:
    port = site.split(":")[1]
    before = len(Handler.hits)
    with pytest.raises(InvalidRequestError, match="non-public address"):
        fetch_image(f"http://{host}:{port}/image.png", 1_000_000)
    assert len(Handler.hits) == before, "the server was reached"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://example.com/a.png", "must be http"),
        ("http://user:pw@example.com/a.png", "user name or password"),
        ("http://:80/a.png", "must be http"),
    ],
)
def test_malformed_urls_are_refused(url: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        fetch_image(url, 1000)


def test_an_allowed_address_is_fetched_and_redirects_are_followed(site: str) -> None:
    assert fetch_image(f"http://{site}/image.png", 1000, allowed=only_127_0_0_1) == PNG
    assert fetch_image(f"http://{site}/to-image", 1000, allowed=only_127_0_0_1) == PNG


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/declared-big", "larger than the limit"),
        ("/chunked-big", "larger than the limit"),
        ("/to-metadata", "'169.254.169.254' resolves to a non-public address"),
        ("/loop", "redirected more than 3 times"),
        ("/missing", "answered HTTP 404"),
        ("/slow", "did not deliver within 0.5 s"),
    ],
)
def test_each_limit_is_a_specific_refusal(site: str, path: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        fetch_image(f"http://{site}{path}", 20_000, timeout_s=0.5, allowed=only_127_0_0_1)
