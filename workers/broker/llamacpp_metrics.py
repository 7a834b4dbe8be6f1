"""llama.cpp's own ``llamacpp:*`` series, for dashboards made for llama-server.

llama-server's ``/metrics`` (``server_task_result_metrics::to_metrics`` in
its source) writes every series as three lines, ``# HELP``, ``# TYPE`` and the
value, with these exact names, types and help texts. Our ``llama_*`` series
(``workers.broker.metrics``) stay as they are; these are rendered beside
them from the same broker snapshot, so their values are the same counts.

They are written as text, not through prometheus_client: the client accepts
the colon, but renders a counter's HELP and TYPE lines with ``_total``
appended, and llama.cpp's ``n_tokens_max`` is a counter without it.

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


def values(snapshot: PoolStatus) -> dict[str, float]:
    """Every ``llamacpp:*`` value, by name, from one broker snapshot."""
    t = snapshot.stats
    return {
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
        "requests_processing": snapshot.slots_busy,
        "requests_deferred": snapshot.jobs_waiting,
        "n_busy_slots_per_decode": 1.0 if t.n_decode_total else 0.0,
    }


def render(snapshot: PoolStatus) -> bytes:
    """The ``llamacpp:*`` block of a text exposition."""
    by_name = values(snapshot)
    lines = []
    for kind, items in (("counter", COUNTERS), ("gauge", GAUGES)):
        for name, help_text in items:
            lines += [f"# HELP llamacpp:{name} {help_text}",
                      f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {floatToGoString(by_name[name])}"]
    return ("\n".join(lines) + "\n").encode()
