"""llama.cpp's own ``llamacpp:*`` series, for dashboards made for llama-server.

llama-server's ``/metrics`` (``server_task_result_metrics::to_metrics`` in
its source) writes every series as three lines, ``# HELP``, ``# TYPE`` and the
value, with these exact names, types and help texts. Our ``llama_*`` series
(``workers.broker.metrics``) stay as they are; these are rendered beside
them from the same broker snapshot, so their values are the same counts.

They are written as text, not through prometheus_client: the client accepts
the colon, but renders a counter's HELP and TYPE lines with ``_total``
appended, and llama.cpp's ``n_tokens_max`` is a counter without it.

Each series has a ``model`` label, one sample per model of the pool (issue
30): llama-server's router answers ``/metrics?model=X`` with that model's
instance's series, and a pool's one exposition holds them all. A dashboard
made for one llama-server still works for a pool of one model: its queries
name the series, and one sample matches (``sum`` over several models gives
the pool's).

Where the pool differs from one llama-server process
(docs/llama-cpp-compatibility.md):

* ``prompt_tokens_seconds`` and ``predicted_tokens_seconds`` are the average
  throughput since the broker started; llama-server averages over the time
  between two scrapes, which a pool scraped through several frontends cannot
  share.
* ``n_decode_total`` counts evaluations (one per computed prompt, one per
  generated token), not ``llama_decode()`` calls: llama-cpp-python splits a
  prompt longer than ``n_batch`` into several.
* Each worker decodes one sequence, so ``n_busy_slots_per_decode`` is 1 once
  anything was decoded; ``requests_deferred`` counts the jobs waiting for a
  slot (``--queue-max``; 0 without a queue, where a full pool answers 503);
  there is no speculative decoding, so its counters are 0.
"""

from __future__ import annotations

from prometheus_client.utils import floatToGoString

from protocol.payloads import PoolStatus
from workers.broker.model_metrics import slots_by_model, totals_by_model

#: Name (after ``llamacpp:``) and help text, as llama-server writes them.
COUNTERS = (
    ("prompt_tokens_total",
     "Number of prompt tokens processed, excluding cached tokens"),
    ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache"),
    ("prompt_seconds_total", "Total time spent processing prompts"),
    ("tokens_predicted_total", "Number of generation tokens processed"),
    ("tokens_predicted_seconds_total", "Total time spent generating tokens"),
    ("n_decode_total",
     "Total number of llama_decode() calls, excluding speculative decoding and "
     "multimodal decoding"),
    ("n_tokens_max", "Largest observed sequence length (prompt + generation)"),
    ("spec_decode_num_draft_tokens_total",
     "Speculative: Total draft tokens generated"),
    ("spec_decode_num_accepted_tokens_total",
     "Speculative: Total draft tokens accepted by the target model"),
    ("spec_decode_num_drafts_total",
     "Speculative: Total speculative decoding verification steps"),
)
GAUGES = (
    ("prompt_tokens_seconds", "Average prompt throughput in tokens/s"),
    ("predicted_tokens_seconds", "Average generation throughput in tokens/s"),
    ("requests_processing", "Number of requests processing"),
    ("requests_deferred", "Number of requests deferred"),
    ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call"),
)


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def values(snapshot: PoolStatus) -> dict[str, dict[str, float]]:
    """Every ``llamacpp:*`` value, by model and then by name, from one broker
    snapshot: a model's jobs and slots only (``workers.broker.model_metrics``)."""
    totals = totals_by_model(snapshot)
    slots = slots_by_model(snapshot)
    waiting = {m.name: m.jobs_waiting for m in snapshot.models}
    return {model: {
        "prompt_tokens_total": t.prompt_tokens_total,
        "prompt_tokens_cached_total": t.prompt_tokens_cached_total,
        "prompt_seconds_total": t.prompt_seconds_total,
        "tokens_predicted_total": t.tokens_generated_total,
        "tokens_predicted_seconds_total": t.tokens_seconds_total,
        "n_decode_total": t.n_decode_total,
        "n_tokens_max": t.n_tokens_max,
        "spec_decode_num_draft_tokens_total": 0,
        "spec_decode_num_accepted_tokens_total": 0,
        "spec_decode_num_drafts_total": 0,
        "prompt_tokens_seconds": _rate(t.prompt_tokens_total,
                                       t.prompt_seconds_total),
        "predicted_tokens_seconds": _rate(t.tokens_generated_total,
                                          t.tokens_seconds_total),
        "requests_processing": sum(s.state in ("busy", "cancelling")
                                   for s in slots[model]),
        "requests_deferred": waiting.get(model, 0),
        "n_busy_slots_per_decode": 1.0 if t.n_decode_total else 0.0,
    } for model, t in totals.items()}


def render(snapshot: PoolStatus) -> bytes:
    """The ``llamacpp:*`` block of a text exposition: each series once per
    model, labelled ``model`` (none before any worker registered)."""
    by_model = values(snapshot)
    lines = []
    for kind, items in (("counter", COUNTERS), ("gauge", GAUGES)):
        for name, help_text in items:
            lines += [f"# HELP llamacpp:{name} {help_text}",
                      f"# TYPE llamacpp:{name} {kind}"]
            lines += [f'llamacpp:{name}{{model="{_label(model)}"}} '
                      f"{floatToGoString(by_name[name])}"
                      for model, by_name in by_model.items()]
    return ("\n".join(lines) + "\n").encode()


def _label(value: str) -> str:
    """A label value in the text format's escapes (a model's name may hold
    any character a worker's ``--model-name`` gives it)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
