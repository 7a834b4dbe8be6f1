"""Two brokers serving different models (issue 30): a frontend over both
asks only the broker that has workers of the request's model, so every
request lands on its model without a refused round trip, and a name
neither serves is 404."""

from __future__ import annotations

import httpx
import pytest

from tests.test_many_models import (
    SEQUENCE,
    MixedPool,
    complete,
    model_files,  # noqa: F401 (the module fixture)
    streamed_model,
)

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def split(model_files, tmp_path_factory):  # noqa: F811
    pool = MixedPool(tmp_path_factory.mktemp("split"), [
        ("alpha", model_files["alpha"], ("--alias", "a"), 0),
        ("bravo", model_files["bravo"], ("--alias", "b"), 1),
    ], n_brokers=2)
    yield pool
    pool.stop()


def counters(pool, broker: int) -> dict:
    return pool.probes[broker].status()["counters"]


def test_each_model_is_asked_of_its_own_broker(split):
    for stream in (False, True):
        for name in SEQUENCE:
            resp = complete(split, name, stream=stream)
            assert resp.status_code == 200, resp.text
            got = streamed_model(resp) if stream else {resp.json()["model"]}
            assert got == {name}
            # Broker 1's slot ids are shown from 1 000 000 up (pool_view).
            assert (int(resp.headers["X-Slot-Id"]) >= 1_000_000) == (name == "bravo")
    for alias, name in (("a", "alpha"), ("b", "bravo")):
        assert complete(split, alias).json()["model"] == name
    # Neither broker was asked for a model it does not have.
    for broker, served in ((0, "alpha"), (1, "bravo")):
        c = counters(split, broker)
        assert c.get("model_not_found", 0) == 0, (broker, c)
        assert c["finished"] >= SEQUENCE.count(served) * 2


def test_models_of_both_brokers_are_listed_and_unknown_is_404(split):
    data = httpx.get(split.url + "/v1/models", timeout=30).json()["data"]
    assert {m["id"]: m["aliases"] for m in data} == {"alpha": ["a"], "bravo": ["b"]}
    resp = complete(split, "no-such-model")
    assert resp.status_code == 404, resp.text
    assert resp.json()["error"]["code"] == "model_not_found"
