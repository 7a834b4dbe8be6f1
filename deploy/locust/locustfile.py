"""Locust load test for any OpenAI-compatible server (llamapool or others).

    LLAMAPOOL_API_KEY=secret locust -f deploy/locust/locustfile.py \\
        --host http://127.0.0.1:8080 --headless -u 8 -r 2 -t 60s

Two tasks, both streamed: ``/v1/chat/completions`` and ``/v1/completions``.
Each request's row in Locust's table covers the whole stream (sent to last
event), not just the headers. Time to first token is reported as an extra
row per endpoint, ``TTFT chat`` and ``TTFT completions`` (request type
``SSE``), so its percentiles show in the UI, the CSV and ``--json``.

A 503 (every slot busy), an error event mid-stream (``data: {"error": ...}``)
or a stream that ends without ``[DONE]`` is a failure.

Settings (environment):

| variable                     | default | meaning                          |
|------------------------------|---------|----------------------------------|
| LLAMAPOOL_API_KEY            | (none)  | sent as ``Authorization: Bearer`` |
| LLAMAPOOL_LOCUST_MAX_TOKENS  | 32      | ``max_tokens`` of every request  |
| LLAMAPOOL_LOCUST_IGNORE_EOS  | 0       | 1: send ``ignore_eos: true``     |
| LLAMAPOOL_LOCUST_PROMPT      | (short) | the prompt / user message        |
| LLAMAPOOL_LOCUST_MODEL       | (none)  | the ``model`` field, if needed   |
"""

from __future__ import annotations

import json
import os
import time

from locust import HttpUser, between, task

PROMPT = os.environ.get(
    "LLAMAPOOL_LOCUST_PROMPT", "Write a short story about a llama who learns to fly."
)
MAX_TOKENS = int(os.environ.get("LLAMAPOOL_LOCUST_MAX_TOKENS", "32"))
IGNORE_EOS = os.environ.get("LLAMAPOOL_LOCUST_IGNORE_EOS", "0") == "1"
MODEL = os.environ.get("LLAMAPOOL_LOCUST_MODEL", "")


def _chunk_has_text(event: dict) -> bool:
    for choice in event.get("choices") or []:
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            return True
    return False


class StreamingUser(HttpUser):
    """One client that alternates streamed chat and completion requests."""

    wait_time = between(0.0, 0.2)

    def on_start(self) -> None:
        key = os.environ.get("LLAMAPOOL_API_KEY", "")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        # --host may be given with or without /v1.
        self.prefix = "" if (self.host or "").rstrip("/").endswith("/v1") else "/v1"

    def _body(self) -> dict:
        body: dict = {"max_tokens": MAX_TOKENS, "stream": True,
                      "stream_options": {"include_usage": True}}
        if IGNORE_EOS:
            body["ignore_eos"] = True
        if MODEL:
            body["model"] = MODEL
        return body

    def _stream(self, path: str, label: str, body: dict) -> None:
        started = time.perf_counter()
        ttft_ms = None
        with self.client.post(
            self.prefix + path, json=body, headers=self.headers, stream=True,
            catch_response=True, name=f"{path} (stream)",
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
                return
            done = False
            failure = None
            for raw in resp.iter_lines():
                line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    failure = "bad JSON in stream"
                    break
                if not isinstance(event, dict):
                    continue
                if "error" in event:
                    failure = f"stream error: {event['error']}"
                    break
                if ttft_ms is None and _chunk_has_text(event):
                    ttft_ms = (time.perf_counter() - started) * 1000
            # The row covers the whole stream, not just the response headers.
            resp.request_meta["response_time"] = (time.perf_counter() - started) * 1000
            if failure is None and not done:
                failure = "stream ended without [DONE]"
            if failure is not None:
                resp.failure(failure)
            else:
                resp.success()
        if ttft_ms is not None:
            self.environment.events.request.fire(
                request_type="SSE", name=f"TTFT {label}", response_time=ttft_ms,
                response_length=0, exception=None, context={},
            )

    @task
    def chat(self) -> None:
        body = self._body()
        body["messages"] = [{"role": "user", "content": PROMPT}]
        self._stream("/chat/completions", "chat", body)

    @task
    def completions(self) -> None:
        body = self._body()
        body["prompt"] = PROMPT
        self._stream("/completions", "completions", body)
