"""Host and Origin through the shipped nginx config (issue 29, item 3).

The frontends check ``Host`` (421 for a name they do not serve: a
DNS-rebinding page) and a browser's ``Origin`` (403 for another site's page
on a keyless pool). Behind nginx they see what nginx forwards, so the
shipped config must pass the client's own ``Host`` on, port included
(``$http_host``): with ``$host`` (no port) the pool's own page, served
through nginx on a port other than 80, would look cross-origin to the
frontend and every chat from it would get 403.

The stack is ``tests/deploy/test_nginx.py``'s: real nginx in front of two
real, keyless gunicorn frontends and a synthetic worker.
"""

from __future__ import annotations

import httpx
import pytest

from tests.deploy.test_nginx import Balanced
from tests.system_tools import require_tool

pytestmark = pytest.mark.stack

BODY = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def balanced(tmp_path_factory):
    nginx = require_tool("nginx")
    stack = Balanced(tmp_path_factory.mktemp("nginx-hosts"), nginx)
    yield stack
    stack.stop()


def test_the_pools_own_page_through_nginx_may_chat(balanced):
    """A same-origin POST from the page nginx serves (nginx on a port of its
    own): the browser's Origin is nginx's address, port included."""
    r = httpx.post(balanced.url + "/v1/completions", json=BODY,
                   headers={"Origin": balanced.url}, timeout=30)
    assert r.status_code == 200, r.text


def test_another_sites_page_through_nginx_is_refused(balanced):
    r = httpx.post(balanced.url + "/v1/completions", json=BODY,
                   headers={"Origin": "http://attacker.example"}, timeout=30)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "origin_not_allowed"


@pytest.mark.parametrize("path", ["/health", "/v1/completions"])
def test_a_rebinding_host_through_nginx_is_misdirected(balanced, path):
    r = httpx.request("POST" if path != "/health" else "GET", balanced.url + path,
                      json=BODY if path != "/health" else None,
                      headers={"Host": f"rebind.example:{balanced.port}"},
                      timeout=30)
    assert r.status_code == 421, r.text
    assert r.json()["error"]["code"] == "misdirected_request"
