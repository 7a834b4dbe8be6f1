"""One pool, many models (issue 30), through real processes: a broker, a
worker of each of two distinct tiny GGUFs (``alpha``, plain; ``bravo``,
with a tools template and FIM tokens) under their own names and aliases,
and real gunicorn.

Before, the broker gave any job any idle slot and the frontend ignored the
request's ``model``: in a sequence that did not alternate, about a third of
the answers came from the other model, ``no-such-model`` was answered 200,
and a request for a busy model was served by the other one.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.pool import TEST_HEARTBEAT, BrokerProbe, Proc, cli, free_port, wait_until
from tests.test_slot_paths import LONG, RawStream, wait_paused

pytestmark = pytest.mark.stack

TIMEOUT_S = 60
#: Not alternating: runs of each, so a model-blind ledger shows up.
SEQUENCE = ["alpha", "alpha", "alpha", "bravo", "alpha", "bravo", "bravo",
            "bravo", "alpha", "alpha", "bravo", "alpha", "bravo", "bravo",
            "alpha", "bravo"]


def make_model(path, *extra: str):
    subprocess.run([sys.executable, "-m", "llamapool", "make-test-model",
                    str(path), "--quant", "q4_0", *extra], check=True,
                   capture_output=True)
    return path


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    where = tmp_path_factory.mktemp("models")
    return {"alpha": make_model(where / "alpha.gguf"),
            "bravo": make_model(where / "bravo.gguf", "--tools-template", "--fim")}


class MixedPool:
    """Brokers, a worker per (model, broker), and one frontend over all."""

    def __init__(self, run_dir, workers: list[tuple[str, object, tuple, int]],
                 n_brokers: int = 1, frontend_args: tuple = (),
                 frontend_env: dict | None = None,
                 broker_args: tuple = ()) -> None:
        self.run_dir = run_dir
        self.procs: list[Proc] = []
        self.probes: list[BrokerProbe] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fronts = []
        try:
            for b in range(n_brokers):
                fe, we = f"ipc://{run_dir}/fe{b}", f"ipc://{run_dir}/we{b}"
                fronts.append(fe)
                self.procs.append(Proc(f"broker{b}", cli(
                    "broker", "--frontends", fe, "--workers", we,
                    *TEST_HEARTBEAT, *broker_args), run_dir))
                self.probes.append(BrokerProbe(fe))
            for i, (name, path, extra, broker) in enumerate(workers):
                self.procs.append(Proc(f"worker{i}-{name}", cli(
                    "worker", "--broker", f"ipc://{run_dir}/we{broker}",
                    "--model", str(path), "--model-name", name, "--threads", "1",
                    "--ctx", "2048", *TEST_HEARTBEAT, *extra), run_dir))
            import os
            env = {**os.environ, "LLAMAPOOL_FRONTEND_PROCESSES": "1",
                   "LLAMAPOOL_FRONTEND_THREADS": "16", **(frontend_env or {})}
            self.procs.append(Proc("frontend", cli(
                "frontend", *[a for fe in fronts for a in ("--broker", fe)],
                "--bind", f"127.0.0.1:{self.port}", "--ctx", "2048",
                *TEST_HEARTBEAT, *frontend_args), run_dir, env=env))
            wait_until(lambda: self.loaded() == len(workers), 90,
                       "every worker to register")
            wait_until(self.http_up, 60, "gunicorn to answer /health")
        except BaseException:
            logs = self.logs()
            self.stop()
            raise AssertionError(f"the pool did not start\n{logs}") from None

    def loaded(self) -> int:
        total = 0
        for probe in self.probes:
            snap = probe.status(1.0)
            total += snap["slots_free"] if snap else 0
        return total

    def http_up(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        return False

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log()}" for p in self.procs)

    def status(self) -> dict:
        """The first broker's ledger (``wait_paused`` reads it)."""
        return self.probes[0].status()

    def stop(self) -> None:
        for probe in self.probes:
            probe.close()
        self.probes = []
        for proc in reversed(self.procs):
            if proc.alive():
                proc.stop()


@pytest.fixture(scope="module")
def mixed(model_files, tmp_path_factory):
    pool = MixedPool(tmp_path_factory.mktemp("mixed"), [
        ("alpha", model_files["alpha"], ("--alias", "a,first"), 0),
        ("bravo", model_files["bravo"], ("--alias", "b"), 0),
    ], frontend_args=("--model", str(model_files["alpha"])),
        frontend_env={"LLAMAPOOL_MODEL_NAME": "alpha"})
    yield pool
    pool.stop()


def complete(pool, model, stream=False, **extra):
    body = {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True, **extra}
    if model is not None:
        body["model"] = model
    if stream:
        body["stream"] = True
    return httpx.post(pool.url + "/v1/completions", json=body, timeout=TIMEOUT_S)


def streamed_model(resp: httpx.Response) -> set[str]:
    chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: {")]
    assert chunks, resp.text
    return {c["model"] for c in chunks}


def slot_models(pool) -> dict[int, str]:
    slots = httpx.get(pool.url + "/slots", timeout=TIMEOUT_S).json()
    return {s["id"]: s["model"] for s in slots}


def test_each_request_lands_on_its_model_whole_and_streamed(mixed):
    models_of_slots = slot_models(mixed)
    for stream in (False, True):
        for name in SEQUENCE:
            resp = complete(mixed, name, stream=stream)
            assert resp.status_code == 200, resp.text
            assert models_of_slots[int(resp.headers["X-Slot-Id"])] == name
            if stream:
                assert streamed_model(resp) == {name}
            else:
                assert resp.json()["model"] == name
    chat = httpx.post(mixed.url + "/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": "bravo", "max_tokens": 3,
        "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == "bravo", chat.text


def test_aliases_resolve_to_their_model(mixed):
    for alias, name in (("a", "alpha"), ("first", "alpha"), ("b", "bravo")):
        resp = complete(mixed, alias)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == name
    native = httpx.post(mixed.url + "/completion", timeout=TIMEOUT_S, json={
        "model": "b", "prompt": "Hi", "n_predict": 2})
    assert native.status_code == 200 and native.json()["model"] == "bravo"


def test_an_unknown_model_is_404_and_takes_no_slot(mixed):
    before = mixed.status()["counters"].get("submitted", 0)
    resp = complete(mixed, "no-such-model")
    assert resp.status_code == 404, resp.text
    error = resp.json()["error"]
    assert error["code"] == "model_not_found"
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "model"
    # Anthropic's and OpenAI's Responses endpoints, in their own shapes.
    msgs = httpx.post(mixed.url + "/v1/messages", timeout=TIMEOUT_S, json={
        "model": "no-such-model", "max_tokens": 3,
        "messages": [{"role": "user", "content": "Hi"}]})
    assert msgs.status_code == 404 and msgs.json()["type"] == "error", msgs.text
    responses = httpx.post(mixed.url + "/v1/responses", timeout=TIMEOUT_S, json={
        "model": "no-such-model", "input": "Hi", "max_output_tokens": 3})
    assert responses.status_code == 404, responses.text
    emb = httpx.post(mixed.url + "/v1/embeddings", timeout=TIMEOUT_S, json={
        "model": "no-such-model", "input": "Hi"})
    assert emb.status_code == 404, emb.text
    # None of them reached the broker: no SUBMIT, no slot.
    assert mixed.status()["counters"].get("submitted", 0) == before


def test_a_full_model_is_503_while_the_other_is_served(mixed):
    held = RawStream(mixed.port, {**LONG, "model": "alpha"})
    try:
        slot_id = int(held.header("X-Slot-Id"))
        assert slot_models(mixed)[slot_id] == "alpha"
        wait_paused(mixed, slot_id)
        refused = complete(mixed, "alpha")
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        served = complete(mixed, "bravo")
        assert served.status_code == 200 and served.json()["model"] == "bravo"
    finally:
        held.close()
    wait_until(lambda: mixed.loaded() == 2, 30, "alpha's slot to come back")


def test_no_model_with_several_and_no_default_is_400(mixed):
    resp = complete(mixed, None)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "model"


def test_models_list_each_model_with_aliases_and_slots(mixed):
    data = httpx.get(mixed.url + "/v1/models", timeout=TIMEOUT_S).json()["data"]
    by_id = {m["id"]: m for m in data}
    assert set(by_id) == {"alpha", "bravo"}
    assert by_id["alpha"]["aliases"] == ["a", "first"]
    assert by_id["bravo"]["aliases"] == ["b"]
    assert "tools" in by_id["bravo"]["capabilities"]
    assert "infill" in by_id["bravo"]["capabilities"]
    assert "infill" not in by_id["alpha"]["capabilities"]
    for m in data:
        assert m["meta"]["n_ctx"] >= 2048
        assert m["meta"]["slots_total"] == 1 and m["meta"]["slots_loading"] == 0
    props = httpx.get(mixed.url + "/props", params={"model": "b"},
                      timeout=TIMEOUT_S).json()
    assert props["model_alias"] == "bravo" and props["total_slots"] == 1
    assert httpx.get(mixed.url + "/props", params={"model": "zzz"},
                     timeout=TIMEOUT_S).status_code == 404


def test_the_openai_client_lists_and_calls_both(mixed):
    client = openai.OpenAI(base_url=mixed.url + "/v1", api_key="none")
    assert {m.id for m in client.models.list()} == {"alpha", "bravo"}
    for name in ("bravo", "alpha"):
        answer = client.completions.create(model=name, prompt="Hi", max_tokens=2)
        assert answer.model == name
        chat = client.chat.completions.create(
            model=name, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert chat.model == name
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)


def test_metrics_and_slots_carry_the_model(mixed):
    slots = httpx.get(mixed.url + "/slots", timeout=TIMEOUT_S).json()
    assert sorted(s["model"] for s in slots) == ["alpha", "bravo"]
    text = httpx.get(mixed.url + "/metrics", timeout=TIMEOUT_S).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    for name in ("alpha", "bravo"):
        assert samples[("llamapool_model_slots",
                        (("model", name), ("state", "idle")))] == 1


@pytest.fixture(scope="module")
def defaulted(model_files, tmp_path_factory):
    pool = MixedPool(tmp_path_factory.mktemp("defaulted"), [
        ("alpha", model_files["alpha"], (), 0),
        ("bravo", model_files["bravo"], (), 0),
    ], frontend_args=("--default-model", "bravo"))
    yield pool
    pool.stop()


def test_no_model_goes_to_the_default_model(defaulted):
    for body_model in (None, ""):
        resp = complete(defaulted, body_model)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "bravo"


@pytest.fixture(scope="module")
def queued(model_files, tmp_path_factory):
    pool = MixedPool(tmp_path_factory.mktemp("queued"), [
        ("alpha", model_files["alpha"], (), 0),
        ("bravo", model_files["bravo"], (), 0),
    ], broker_args=("--queue-max", "4", "--queue-timeout-s", "60"))
    yield pool
    pool.stop()


def test_a_freed_slot_goes_only_to_a_waiter_of_its_model(queued):
    import concurrent.futures

    def held(model):
        stream = RawStream(queued.port, {**LONG, "model": model})
        slot_id = int(stream.header("X-Slot-Id"))
        wait_paused(queued, slot_id)
        return stream, slot_id

    def deferred():
        return queued.status()["jobs_waiting"]

    alpha, _ = held("alpha")
    bravo, bravo_slot = held("bravo")
    with concurrent.futures.ThreadPoolExecutor(1) as clients:
        try:
            waiter = clients.submit(complete, queued, "alpha")
            wait_until(lambda: deferred() == 1, 30, "the alpha job to wait")
            bravo.close()
            wait_until(lambda: next(s for s in queued.status()["slots"]
                                    if s["id"] == bravo_slot)["state"] == "idle",
                       30, "bravo's slot to be free")
            # Bravo's free slot did not take the job for alpha.
            assert deferred() == 1 and not waiter.done()
            assert complete(queued, "bravo").json()["model"] == "bravo"
            alpha.close()
            answer = waiter.result(timeout=TIMEOUT_S)
        finally:
            alpha.close()
            bravo.close()
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "alpha"
    wait_until(lambda: queued.loaded() == 2, 30, "both slots to come back")


def test_counting_a_prompt_uses_the_vocabulary_and_template_of_its_model(mixed):
    # The frontend's --model is alpha's, whose template renders no tools:
    # a prompt for bravo (which does) is counted by bravo's worker, and
    # matches what a real request to bravo reports.
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [{"type": "function", "function": {
                "name": "weather", "parameters": {"type": "object", "properties": {
                    "city": {"type": "string"}}}}}]}
    counted = httpx.post(mixed.url + "/v1/chat/completions/input_tokens",
                         json={**body, "model": "bravo"}, timeout=TIMEOUT_S)
    assert counted.status_code == 200, counted.text
    served = httpx.post(mixed.url + "/v1/chat/completions", timeout=TIMEOUT_S,
                        json={**body, "model": "bravo", "max_tokens": 1})
    assert served.status_code == 200, served.text
    assert counted.json()["input_tokens"] == served.json()["usage"]["prompt_tokens"]
    # alpha's own template refuses tools, at the door, as its chat does.
    refused = httpx.post(mixed.url + "/v1/chat/completions/input_tokens",
                         json={**body, "model": "alpha"}, timeout=TIMEOUT_S)
    assert refused.status_code == 400, refused.text
    unknown = httpx.post(mixed.url + "/v1/chat/completions/input_tokens",
                         json={**body, "model": "nobody"}, timeout=TIMEOUT_S)
    assert unknown.status_code == 404


def test_a_model_without_a_vocabulary_here_is_501_on_the_tokenizer(mixed):
    # The frontend's --model is alpha's: alpha's tokenizer answers, bravo's
    # (whose file this frontend lacks) is 501 naming the setting, as for a
    # frontend with no file at all; a name nobody serves is still 404.
    for path, body in (("/tokenize", {"content": "Hi"}),
                       ("/detokenize", {"tokens": [1]}),
                       ("/apply-template",
                        {"messages": [{"role": "user", "content": "Hi"}]})):
        ok = httpx.post(mixed.url + path, json={**body, "model": "first"},
                        timeout=TIMEOUT_S)
        assert ok.status_code == 200, ok.text
        lacking = httpx.post(mixed.url + path, json={**body, "model": "b"},
                             timeout=TIMEOUT_S)
        assert lacking.status_code == 501, lacking.text
        assert "--models" in lacking.json()["error"]["message"]
        unknown = httpx.post(mixed.url + path, json={**body, "model": "nobody"},
                             timeout=TIMEOUT_S)
        assert unknown.status_code == 404, unknown.text
