"""``/livez`` and ``/readyz``: an orchestrator's two questions, kept apart.

``/health`` keeps llama-server's meaning (200 once a model is loaded, 503
while none is), which is wrong for both probes of a frontend:

* **Liveness** (``/livez``) asks whether restarting this process would
  help. It answers from this process alone and never asks the broker: a
  frontend whose workers or brokers are restarting is healthy, and killing
  it would only drop the streams it still holds.
* **Readiness** (``/readyz``) asks whether a new request sent here could be
  served: 200 only when a broker answers within ``health_timeout_s`` and its
  ledger holds at least one loaded worker (busy counts: a full pool answers
  503 + Retry-After itself, and taking every frontend out of the Service for
  it would turn a short wait into refused connections).
"""

from __future__ import annotations

import falcon

from frontend.errors import Unavailable, write_error
from frontend.interfaces import BrokerClient
from frontend.settings import FrontendSettings
from protocol.errors import ErrorCode

#: The probe paths; public like ``/health`` (a kubelet sends no API key).
PROBE_PATHS = frozenset({"/livez", "/readyz"})


class LivezResource:
    """``GET /livez``: 200 while a request thread of this process answers."""

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = {"status": "alive"}


class ReadyzResource:
    """``GET /readyz``: 200 when a broker with a loaded worker answers."""

    def __init__(self, link: BrokerClient, settings: FrontendSettings) -> None:
        self.link = link
        self.settings = settings

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        # The same bounded, cached STATUS as /health: probes from every
        # kubelet cost the broker a few STATUS a second at most.
        status = self.link.status(self.settings.health_timeout_s,
                                  self.settings.health_cache_s)
        if status is None:
            write_error(resp, Unavailable(ErrorCode.BROKER_UNREACHABLE,
                                          "no broker answered"))
            return
        if status.slots_total == 0:
            write_error(resp, Unavailable(ErrorCode.LOADING_MODEL,
                                          "no worker is ready"))
            return
        resp.media = {"status": "ready", "slots_ready": status.slots_total,
                      "slots_idle": status.slots_free}


def add_probe_routes(app: falcon.App, link: BrokerClient,
                     settings: FrontendSettings) -> None:
    """Route ``/livez`` and ``/readyz``."""
    app.add_route("/livez", LivezResource())
    app.add_route("/readyz", ReadyzResource(link, settings))
