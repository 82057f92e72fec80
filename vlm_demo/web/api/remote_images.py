"""Fetching an ``http(s)`` image URL for the API, only when the operator opted in (``--api-remote-images``).

A server that fetches URLs for its clients can be made to reach what only it can reach (server-side
request forgery: a cloud's metadata service at 169.254.169.254, an admin page on localhost, the office
network). So:

- ``http`` and ``https`` only, no user name or password in the URL;
- the host is resolved once and **every** address it resolves to must be public (not loopback,
  private, link-local, shared, multicast, reserved or unspecified; IPv4-mapped IPv6 is checked as the
  IPv4 address it is); the connection then goes to that checked address, never through a second look-up,
  so a name cannot resolve to a public address for the check and to a private one for the connection
  (DNS rebinding); HTTPS still verifies the certificate against the host name;
- at most :data:`MAX_REDIRECTS` redirects, each target checked the same way;
- at most ``max_bytes`` (the declared length is checked first, then what arrives) and one deadline for
  the whole fetch, redirects included (name resolution itself is bounded by the system resolver).

Every refusal is an :class:`~vlm_demo.errors.InvalidRequestError` saying which rule it hit.
"""

from __future__ import annotations

import http.client
import ipaddress
import logging
import socket
import ssl
import time
from collections.abc import Callable
from urllib.parse import urljoin, urlsplit

from vlm_demo.errors import InvalidRequestError

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3
REDIRECTS = (301, 302, 303, 307, 308)
CHUNK = 64 * 1024

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def is_public(address: Address) -> bool:
    """Whether a server may connect to this address on a client's behalf."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not (address.is_multicast or address.is_reserved or address.is_unspecified)


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to an address checked beforehand, with the URL's host in the ``Host`` header."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPS(_PinnedHTTP):
    """The same over TLS: the socket goes to the checked address, the certificate is checked for the host."""

    default_port = http.client.HTTPS_PORT

    def connect(self) -> None:
        super().connect()
        self.sock = ssl.create_default_context().wrap_socket(self.sock, server_hostname=self.host)


def _checked_address(host: str, port: int, allowed: Callable[[Address], bool]) -> str:
    """The host's first address, once every address it resolves to is allowed."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise InvalidRequestError(f"The image URL's host {host!r} could not be resolved.") from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
    refused = [str(a) for a in addresses if not allowed(a)]
    if not addresses or refused:
        raise InvalidRequestError(
            f"The image URL's host {host!r} resolves to a non-public address ({', '.join(refused)}); "
            "this server fetches images from public addresses only."
        )
    return str(addresses[0])


def fetch_image(
    url: str,
    max_bytes: int,
    timeout_s: float = FETCH_TIMEOUT_S,
    allowed: Callable[[Address], bool] = is_public,
) -> bytes:
    """The bytes at ``url`` under the rules above (``allowed`` is the address policy: public addresses)."""
    deadline = time.monotonic() + timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequestError("An image URL must be http(s)://host/… or a data: URL.")
        if parts.username is not None or parts.password is not None:
            raise InvalidRequestError("An image URL must not carry a user name or password.")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise InvalidRequestError("The image URL's port is not a number from 0 to 65535.") from None
        address = _checked_address(parts.hostname, port, allowed)
        kind = _PinnedHTTPS if parts.scheme == "https" else _PinnedHTTP
        connection = kind(parts.hostname, port, address, timeout=max(0.1, deadline - time.monotonic()))
        try:
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            connection.request("GET", target, headers={"Accept": "image/*", "User-Agent": "vlm-demo"})
            response = connection.getresponse()
            if response.status in REDIRECTS and response.getheader("Location"):
                url = urljoin(url, response.getheader("Location"))
                continue
            if response.status != 200:
                raise InvalidRequestError(f"The image URL answered HTTP {response.status}, not an image.")
            return _read(response, connection, max_bytes, deadline)
        except (OSError, http.client.HTTPException) as err:
            if isinstance(err, TimeoutError) or time.monotonic() >= deadline:
                raise InvalidRequestError(f"The image URL did not deliver within {timeout_s:g} s.") from None
            log.info("fetching %s failed: %r", url, err)
            raise InvalidRequestError(f"The image URL could not be fetched ({type(err).__name__}).") from None
        finally:
            connection.close()
    raise InvalidRequestError(f"The image URL redirected more than {MAX_REDIRECTS} times.")


def _read(response: http.client.HTTPResponse, connection: _PinnedHTTP, max_bytes: int, deadline: float) -> bytes:
    too_big = f"The image at that URL is larger than the limit of {max_bytes / 1e6:.0f} MB."
    declared = response.getheader("Content-Length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise InvalidRequestError(too_big)
    pieces: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        if connection.sock is not None:
            connection.sock.settimeout(left)
        piece = response.read1(CHUNK)
        if not piece:
            return b"".join(pieces)
        size += len(piece)
        if size > max_bytes:
            raise InvalidRequestError(too_big)
        pieces.append(piece)
