"""CORS: which web pages may call the API from a browser, as llama.cpp allows.

llama-server answers every ``OPTIONS`` preflight without a key (a browser
never sends credentials on one) and sends ``Access-Control-Allow-Origin: *``
by default (``--cors-origins``). Here Falcon's ``CORSMiddleware`` does the
same: it answers preflights with the methods the route has and the headers
the page asked to send (``Authorization``, ``Content-Type``, ...), and tags
every answer, errors included, so a page can read a 401 or a 503 too.
``ApiKeyMiddleware`` lets ``OPTIONS`` through, which carries no data.

An origin that is not allowed gets no ``Access-Control-Allow-Origin``: the
browser then refuses the preflight and never sends the request, or hides the
answer of a simple one. The key check is unchanged: CORS decides which pages
may read answers, not who may ask.
"""

from __future__ import annotations

import falcon

#: Headers of ours a page's script may read (the CORS-safelisted ones, like
#: Content-Type, are readable anyway): the 503's hint, the slot and request
#: ids, and llama.cpp's metrics header.
EXPOSED_HEADERS = ("Retry-After", "X-Slot-Id", "X-Request-Id", "X-Frontend-Pid",
                   "Process-Start-Time-Unix")


def cors_middleware(origins: tuple[str, ...]) -> falcon.CORSMiddleware:
    """The middleware for ``LLAMAPOOL_CORS_ORIGINS`` (``*`` or a list)."""
    allowed = "*" if origins == ("*",) else frozenset(origins)
    return falcon.CORSMiddleware(allow_origins=allowed,
                                 expose_headers=EXPOSED_HEADERS)
