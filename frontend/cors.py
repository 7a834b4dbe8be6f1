"""Which web pages may use the API from a browser: CORS, Origin and Host.

Three checks, each a middleware, because a browser lets any page it shows
send requests to any address, the pool's on loopback or the LAN included:

* **CORS** (``cors_middleware``) decides which other origins may *read*
  answers. llama-server answers every ``OPTIONS`` preflight without a key (a
  browser never sends credentials on one) and sends
  ``Access-Control-Allow-Origin: *`` by default (``--cors-origins``). Here
  Falcon's ``CORSMiddleware`` does the same for the origins allowed: it
  answers preflights with the methods the route has and the headers the page
  asked to send (``Authorization``, ``Content-Type``, ...), and tags every
  answer, errors included, so a page can read a 401 or a 503 too.
  ``ApiKeyMiddleware`` lets ``OPTIONS`` through, which carries no data. The
  default is ``*`` only when API keys are set: without a key, a grant to
  every origin would let any page the user opens chat, read ``/slots``,
  ``/props`` and ``/metrics``, and run jobs on the pool (issue 29). A
  keyless pool grants no origin unless ``--cors-origins`` names it.
* **Origin** (``OriginCheckMiddleware``): CORS only hides answers; a "simple"
  cross-origin ``POST`` (``Content-Type: text/plain``, no preflight) is still
  sent and would still run a job. A browser names the page's origin on every
  such request, so a request whose ``Origin`` is neither allowed nor the
  pool's own is refused (403) before anything runs. Clients that are not
  browsers send no ``Origin`` and are not concerned.
* **Host** (``HostCheckMiddleware``): a DNS-rebinding page (its own name,
  made to resolve to the pool's address) is same-origin with the pool, so
  neither check above sees it; but its requests carry its name in ``Host``.
  Only names the pool answers to are served, 421 (Misdirected Request)
  otherwise: ``localhost`` and ``*.localhost`` (browsers resolve them to
  loopback themselves), any IP address (a page addressed by IP is served by
  that address, so it cannot be a rebinding page), this machine's name, the
  name ``--bind`` gives, and ``--allowed-hosts``.

An origin that is not allowed gets no ``Access-Control-Allow-Origin`` and
a 403: the browser refuses the preflight and never sends the request, and a
simple request runs nothing. The key check is unchanged: these decide which
pages may use the pool, a key who may.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

import falcon

from frontend.errors import MisdirectedRequest, OriginNotAllowed

#: Headers of ours a page's script may read (the CORS-safelisted ones, like
#: Content-Type, are readable anyway): the 503's hint, the slot and request
#: ids, and llama.cpp's metrics header.
EXPOSED_HEADERS = ("Retry-After", "X-Slot-Id", "X-Request-Id", "X-Frontend-Pid",
                   "Process-Start-Time-Unix")

_DEFAULT_PORTS = {"http": 80, "https": 443}


def cors_middleware(origins: tuple[str, ...]) -> falcon.CORSMiddleware | None:
    """The middleware for the origins CORS grants (``*`` or a list;
    ``FrontendSettings.web_origins``), or None when it grants none."""
    if not origins:
        return None
    allowed = "*" if origins == ("*",) else frozenset(origins)
    return falcon.CORSMiddleware(allow_origins=allowed,
                                 expose_headers=EXPOSED_HEADERS)


def split_host(value: str) -> tuple[str, int | None]:
    """A ``Host`` value's name (lower case, no trailing dot; an IPv6 address
    without its brackets) and port (None: not given or not a number)."""
    value = value.strip()
    port: int | None = None
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        if rest.startswith(":") and rest[1:].isdigit():
            port = int(rest[1:])
    else:
        name, colon, tail = value.rpartition(":")
        if not colon or ":" in name:  # no port, or a bare IPv6 address
            name = value
        elif tail.isdigit():
            port = int(tail)
    return name.rstrip(".").lower(), port


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def bind_name(bind: str) -> str | None:
    """The host name in gunicorn's ``--bind`` (``name:port``); None for an
    address, ``unix:`` or a wildcard, which need no entry."""
    if bind.startswith(("unix:", "fd://")):
        return None
    name, _ = split_host(bind)
    return None if not name or _is_ip(name) else name


class HostCheckMiddleware:
    """Answers 421 to a request addressed to a name the pool does not serve."""

    def __init__(self, allowed: tuple[str, ...]) -> None:
        self.any_host = allowed == ("*",)
        names = {name.rstrip(".").lower() for name in allowed}
        names.add(socket.gethostname().rstrip(".").lower())
        self.names = frozenset(n for n in names if n and not n.startswith("."))
        #: ``.example.com``: the domain and every name under it.
        self.domains = tuple(n for n in names if n.startswith(".") and len(n) > 1)

    def serves(self, host: str) -> bool:
        """Whether a ``Host`` value names this pool (module doc)."""
        name, _ = split_host(host)
        if not name or name == "localhost" or name.endswith(".localhost"):
            return True  # no name given: nothing to rebind
        return (name in self.names or _is_ip(name)
                or any(name.endswith(d) or name == d[1:] for d in self.domains))

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        host = req.get_header("HOST")
        if self.any_host or host is None or self.serves(host):
            return
        raise MisdirectedRequest(split_host(host)[0])


def same_origin(origin: str, host: str | None) -> bool:
    """Whether ``Origin`` names the scheme-less address ``Host`` gives (a Host
    without a port means the scheme's default one)."""
    if host is None:
        return False
    try:
        parts = urlsplit(origin)
        origin_port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return False
    name, port = split_host(host)
    return (bool(parts.hostname) and parts.hostname.rstrip(".") == name
            and (port or _DEFAULT_PORTS.get(parts.scheme)) == origin_port)


class OriginCheckMiddleware:
    """Refuses (403) a browser's request from a page on an origin that is
    neither allowed (``origins``) nor the pool's own."""

    def __init__(self, origins: tuple[str, ...]) -> None:
        self.any_origin = origins == ("*",)
        self.origins = frozenset(origins)

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        origin = req.get_header("ORIGIN")
        if (self.any_origin or origin is None or origin in self.origins
                or same_origin(origin, req.get_header("HOST"))):
            return
        raise OriginNotAllowed(origin)
