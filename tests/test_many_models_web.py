"""The web page's model picker in a pool of two models (issue 30), through
real processes and a real browser: the picker lists both (with aliases),
and each message goes to the model picked, as the ledger's per-model job
counts show. In a pool of one model the picker stays hidden."""

from __future__ import annotations

import httpx
import pytest

from tests.test_many_models import MixedPool, model_files  # noqa: F401 (fixture)
from tests.test_web_page import browser, emulate, set_setting, status_text  # noqa: F401
from tests.test_web_page import type_and_enter, wait_for

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def two_models(model_files, tmp_path_factory):  # noqa: F811
    pool = MixedPool(tmp_path_factory.mktemp("web-models"), [
        ("alpha", model_files["alpha"], ("--alias", "a"), 0),
        ("bravo", model_files["bravo"], (), 0),
    ])
    yield pool
    pool.stop()


def jobs_by_model(pool) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in httpx.get(pool.url + "/slots", timeout=30).json():
        out[s["model"]] = out.get(s["model"], 0) + s["jobs_served"]
    return out


def test_each_message_goes_to_the_model_picked(two_models, browser):  # noqa: F811
    d = browser
    emulate(d, "light")
    d.get(two_models.url + "/")
    d.execute_script("localStorage.clear()")
    d.get(two_models.url + "/")
    wait_for(d, "!document.getElementById('model-picker').hidden")
    options = d.execute_script(
        "return [...document.getElementById('set-model').options]"
        ".map(o => [o.value, o.textContent])")
    assert options == [["alpha", "alpha (a)"], ["bravo", "bravo"]]
    set_setting(d, "set-max-tokens", 4)
    for model, text in (("bravo", "Hello bravo"), ("alpha", "Hello alpha")):
        before = jobs_by_model(two_models)
        set_setting(d, "set-model", model)
        type_and_enter(d, text)
        wait_for(d, "document.getElementById('status').textContent"
                    ".startsWith('Done')")
        after = jobs_by_model(two_models)
        assert after[model] == before.get(model, 0) + 1, (model, before, after)
        other = "alpha" if model == "bravo" else "bravo"
        assert after[other] == before.get(other, 0), status_text(d)
        d.execute_script("document.getElementById('new-chat').click()")
    # The choice is kept in the browser.
    assert d.execute_script(
        "return JSON.parse(localStorage.getItem('llamapool.settings')).model") == "alpha"


def test_slots_and_the_pool_view_are_grouped_by_model(two_models, browser):  # noqa: F811
    slots = httpx.get(two_models.url + "/slots", timeout=30).json()
    models = [s["model"] for s in slots]
    assert models == sorted(models) and set(models) == {"alpha", "bravo"}
    d = browser
    d.get(two_models.url + "/")
    d.execute_script("document.getElementById('tab-pool').click()")
    wait_for(d, "document.querySelectorAll('#slots tr.model-group').length === 2")
    rows = d.execute_script(
        "return [...document.querySelectorAll('#slots tbody tr')]"
        ".map(r => r.className === 'model-group' ? 'group:' + r.dataset.model"
        " : 'slot:' + r.dataset.model)")
    assert rows == ["group:alpha", "slot:alpha", "group:bravo", "slot:bravo"]
    heading = d.execute_script(
        "return document.querySelector('#slots tr.model-group th').textContent")
    assert heading == "alpha: 1 slot, 0 busy"
