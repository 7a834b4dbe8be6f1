"""Each model's series carry its ``model`` label (issue 30), in process: a
ledger of two models, jobs that end on each, and the exposition rendered
from the STATUS reply as a frontend decodes it. The same through real
processes is in ``tests/test_many_models_metrics.py``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from frontend.pool_view import merge_statuses
from protocol import messages
from protocol.payloads import Timings, Usage
from workers.broker.ledger import Ledger
from workers.broker.llamacpp_metrics import render as render_llamacpp
from workers.broker.metrics import PoolCollector
from workers.broker.pool_stats import PoolStats


def ready(name: str, model: str) -> messages.Ready:
    return messages.Ready(name, model, 512, 1, "h")


def final(job_id: str, prompt_n: int, completion: int) -> messages.Final:
    return messages.Final(
        job_id, "length",
        Usage(prompt_n, completion, prompt_n + completion, cached_tokens=1),
        Timings(prompt_n, 10.0, completion, 20.0))


def two_model_snapshot():
    """alpha ran two jobs (one still running), bravo one that was lost."""
    ledger, stats = Ledger(60.0), PoolStats()
    for ident, model in ((b"a1", "alpha"), (b"a2", "alpha"), (b"b1", "bravo")):
        ledger.register_worker(ident, ready(ident.decode(), model), 0.0)
    for job_id, prompt_n, completion in (("j1", 7, 3), ("j2", 5, 2)):
        ledger.assign(job_id, b"f", 1.0, model="alpha")
        job = ledger.jobs[job_id]
        ledger.finish(job_id, 2.0)
        stats.job_ended(final(job_id, prompt_n, completion), None, 2.0, job.model)
    ledger.assign("j3", b"f", 3.0, model="alpha")  # running
    ledger.assign("j4", b"f", 3.0, model="bravo")
    stats.job_lost(ledger.remove_worker(b"b1").model)
    stats.of("bravo").no_slot += 1
    snap = ledger.snapshot(4.0, {}, stats.totals())
    # As a frontend has it: through the wire.
    reply = messages.StatusReply("r", snap).to_wire()
    return messages.decode(reply).snapshot


def samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples}


def exposition(snap) -> str:
    registry = CollectorRegistry()
    registry.register(PoolCollector(snap))
    return (generate_latest(registry) + render_llamacpp(snap)).decode()


def test_each_model_counts_only_its_own_jobs():
    got = samples(exposition(two_model_snapshot()))
    alpha, bravo = (("model", "alpha"),), (("model", "bravo"),)
    assert got["llama_prompt_tokens_total", alpha] == 12
    assert got["llama_tokens_generated_total", alpha] == 5
    assert got["llama_request_success_total", alpha] == 2
    assert got["llama_request_fail_total", alpha] == 0
    assert got["llama_tokens_generated_total", bravo] == 0
    assert got["llama_request_fail_total", bravo] == 1
    assert got["llamapool_prompt_tokens_cached_total", alpha] == 2
    assert got["llamapool_broker_no_slot_total", bravo] == 1
    assert got["llamapool_broker_no_slot_total", alpha] == 0
    assert got["llama_slots_processing", alpha] == 1
    assert got["llama_slots_processing", bravo] == 0
    assert got["llamapool_slots_registered", alpha] == 2
    assert got["llamapool_slots_registered", bravo] == 0  # its worker is gone
    assert got["llamacpp:prompt_tokens_total", alpha] == 12
    assert got["llamacpp:tokens_predicted_total", alpha] == 5
    assert got["llamacpp:n_decode_total", alpha] == 2 + 5
    assert got["llamacpp:tokens_predicted_total", bravo] == 0
    assert got["llamacpp:requests_processing", alpha] == 1
    # (The parser reads a counter without "_total" as if it had one.)
    assert got["llamacpp:n_tokens_max_total", alpha] == 10
    assert got["llamapool_queue_refused_total",
               (("model", "alpha"), ("reason", "full"))] == 0
    assert got["llamapool_disconnect_release_seconds_count", alpha] == 0


def test_every_model_scoped_sample_names_its_model():
    got = samples(exposition(two_model_snapshot()))
    broker_level = {"llamapool_worker_deaths_total", "llamapool_worker_restarts_total"}
    for (name, labels), _ in got.items():
        if name.startswith(("llama_", "llamacpp:", "llamapool_slots_",
                            "llamapool_prompt_", "llamapool_queue_",
                            "llamapool_disconnect_", "llamapool_requests_cancelled",
                            "llamapool_broker_no_slot")):
            assert dict(labels).get("model") in ("alpha", "bravo"), (name, labels)
        elif name in broker_level:
            assert labels == ()


def test_two_brokers_sum_a_models_totals():
    snap = two_model_snapshot()
    merged = merge_statuses([(0, snap), (1, snap)])
    got = samples(exposition(merged))
    assert got["llama_prompt_tokens_total", (("model", "alpha"),)] == 24
    assert got["llamacpp:n_tokens_max_total", (("model", "alpha"),)] == 10
    assert got["llama_request_fail_total", (("model", "bravo"),)] == 2


def test_model_totals_stay_bounded():
    stats = PoolStats()
    for i in range(200):
        stats.job_lost(f"m{i}")
    names = [m.name for m in stats.totals().models]
    assert len(names) == 64 and "m199" in names and "m0" not in names
    assert stats.totals().request_fail_total == 200  # the pool's count keeps all
