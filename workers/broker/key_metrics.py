"""Usage per named API key as Prometheus families (``key_limits``): what
each key's jobs cost, and why its requests were refused. Labelled with the
key's name from the keys file, never the key; bounded by
``limits.MAX_KEY_NAMES``."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from protocol.payloads import PoolStatus

#: The refusal reasons, each a series from the start for every key.
REFUSAL_REASONS = ("slots", "queued", "tokens", "no_slot")


def key_usage_families(snap: PoolStatus):
    prompt = CounterMetricFamily(
        "llamapool_key_prompt_tokens", "Prompt tokens of the key's jobs",
        labels=["key"])
    completion = CounterMetricFamily(
        "llamapool_key_completion_tokens", "Tokens the key's jobs generated",
        labels=["key"])
    requests = CounterMetricFamily(
        "llamapool_key_requests", "Jobs of the key that got a slot", labels=["key"])
    refused = CounterMetricFamily(
        "llamapool_key_refusals",
        "Requests of the key refused: over its limit (slots, queued, tokens: "
        "429) or for want of a slot (no_slot: 503)", labels=["key", "reason"])
    running = GaugeMetricFamily(
        "llamapool_key_jobs", "Jobs of the key now, by state",
        labels=["key", "state"])
    for usage in snap.keys:
        prompt.add_metric([usage.name], usage.prompt_tokens)
        completion.add_metric([usage.name], usage.completion_tokens)
        requests.add_metric([usage.name], usage.requests)
        for reason in REFUSAL_REASONS:
            refused.add_metric([usage.name, reason], usage.refused.get(reason, 0))
        running.add_metric([usage.name, "running"], usage.running)
        running.add_metric([usage.name, "waiting"], usage.waiting)
    yield from (prompt, completion, requests, refused, running)
