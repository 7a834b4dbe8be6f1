"""Which web pages may use the API from a browser: CORS, Origin and Host.

Three checks, each a middleware, because a browser lets any page it shows
send requests to any address, the pool's on loopback or the LAN included:

* **CORS** (``CorsPolicy``) decides which other origins may *read*
  answers, in llama-server's forms (``--cors-origins`` ``*``, a list, or
  ``localhost``: any page on this machine, its origin reflected;
  ``--cors-methods``, ``--cors-headers``, ``--cors-credentials``). Preflights
  are answered without a key (a browser never sends credentials on one),
  with the route's methods and the headers the page asked to send unless
  those flags name others, and every answer is tagged, errors included, so
  a page can read a 401 or a 503 too. Credentials are off by default, where
  llama-server reflects every origin with them (``frontend.settings``).
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


def is_localhost_origin(origin: str) -> bool:
    """llama-server's ``localhost`` keyword: an origin on this machine
    (``localhost``, ``127.0.0.1``, ``::1``, any port)."""
    try:
        host = urlsplit(origin).hostname
    except ValueError:
        return False
    return host in ("localhost", "127.0.0.1", "::1")


class OriginList:
    """``--cors-origins``: ``*``, or origins and the ``localhost`` keyword."""

    def __init__(self, origins: tuple[str, ...]) -> None:
        self.any = origins == ("*",)
        self.localhost = "localhost" in origins
        self.exact = frozenset(o for o in origins if o != "localhost")

    def __bool__(self) -> bool:
        return self.any or self.localhost or bool(self.exact)

    def allows(self, origin: str) -> bool:
        return (self.any or origin in self.exact
                or (self.localhost and is_localhost_origin(origin)))


class CorsPolicy:
    """The CORS answer headers for allowed origins (module doc).

    Args:
        origins: who may read answers.
        methods: what a preflight allows; empty: the route's methods.
        headers: the request headers a preflight allows; empty: as asked.
        credentials: allow credentialed requests (the origin is reflected).
    """

    def __init__(self, origins: OriginList, methods: tuple[str, ...] = (),
                 headers: tuple[str, ...] = (), credentials: bool = False) -> None:
        self.origins = origins
        self.methods = ", ".join(methods)
        self.headers = ", ".join(headers)
        self.credentials = credentials

    def process_response(self, req: falcon.Request, resp: falcon.Response,
                         resource: object, req_succeeded: bool) -> None:
        origin = req.get_header("Origin")
        if origin is None or not self.origins.allows(origin):
            return
        if self.origins.any and not self.credentials:
            resp.set_header("Access-Control-Allow-Origin", "*")
        else:
            resp.set_header("Access-Control-Allow-Origin", origin)
            resp.append_header("Vary", "Origin")
        if self.credentials:
            resp.set_header("Access-Control-Allow-Credentials", "true")
        resp.set_header("Access-Control-Expose-Headers", ", ".join(EXPOSED_HEADERS))
        if (req_succeeded and req.method == "OPTIONS"
                and req.get_header("Access-Control-Request-Method")):
            self._preflight(req, resp)

    def _preflight(self, req: falcon.Request, resp: falcon.Response) -> None:
        allow = resp.get_header("Allow")  # the route's methods (Falcon's OPTIONS)
        resp.delete_header("Allow")
        if allow is None:  # no such route: grant nothing
            for name in ("Access-Control-Allow-Origin", "Access-Control-Allow-Credentials",
                         "Access-Control-Expose-Headers"):
                resp.delete_header(name)
            return
        resp.set_header("Access-Control-Allow-Methods", self.methods or allow)
        resp.set_header("Access-Control-Allow-Headers", self.headers or req.get_header(
            "Access-Control-Request-Headers", default="*"))
        resp.set_header("Access-Control-Max-Age", "86400")


def cors_policy(settings) -> CorsPolicy | None:
    """The middleware for a frontend's CORS settings
    (``FrontendSettings.web_origins`` and the ``cors_*`` ones), or None when
    no origin is allowed."""
    origins = OriginList(settings.web_origins())
    if not origins:
        return None
    return CorsPolicy(origins, settings.cors_methods, settings.cors_headers,
                      settings.cors_credentials)


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
        self.origins = OriginList(origins)

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        origin = req.get_header("ORIGIN")
        if (origin is None or self.origins.allows(origin)
                or same_origin(origin, req.get_header("HOST"))):
            return
        raise OriginNotAllowed(origin)
