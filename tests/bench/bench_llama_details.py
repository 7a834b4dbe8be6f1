"""llama.cpp's details against this checkout: a before/after table (issue 11, s. 3).

Starts a real pool (broker, 1 worker, gunicorn, an API key) on the tiny test
model and sends what a client of llama-server sends; prints what came back,
one row per detail. Run it on two checkouts to compare:

    python -m tests.bench.bench_llama_details
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.pool import Pool

KEY = "sk-bench-details-0001"
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {}}}}


def _events(pool: Pool, body: dict) -> list:
    with httpx.stream("POST", pool.url + "/v1/chat/completions", headers=AUTH,
                      json={**body, "stream": True}, timeout=120) as r:
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def _post(pool: Pool, body: dict, path: str = "/v1/chat/completions"):
    return httpx.post(pool.url + path, headers=AUTH, json=body, timeout=120)


def _error(r: httpx.Response) -> str:
    try:
        e = r.json()["error"]
    except Exception:
        return f"{r.status_code}"
    keys = sorted(set(e) - {"message", "param"})
    return f"{r.status_code} {e.get('type')} {keys}"


def rows(pool: Pool) -> list[tuple[str, str]]:
    out = []
    first = json.loads(_events(pool, {"messages": HI, "max_tokens": 3,
                                      "ignore_eos": True})[0])
    out.append(("first streamed chat chunk's delta",
                json.dumps(first["choices"][0]["delta"])))
    whole = _post(pool, {"messages": HI, "max_tokens": 3}).json()
    out.append(("`timings` fields on a whole answer", str(len(whole["timings"]))))
    out.append(("`system_fingerprint`", str(whole.get("system_fingerprint"))))
    events = _events(pool, {"messages": HI, "max_tokens": 8, "ignore_eos": True,
                            "timings_per_token": True})
    if events and events[0].startswith('{"error"'):
        out.append(("`timings_per_token: true` chunks with timings", events[0][:60]))
    else:
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        timed = sum("timings" in c for c in chunks)
        out.append(("`timings_per_token: true` chunks with timings",
                    f"{timed}/{len(chunks)}"))
    r = _post(pool, {"prompt": "Hello " * 2100}, "/v1/completions")
    out.append(("prompt over the context", _error(r)))
    r = _post(pool, {"messages": [*HI, {"role": "assistant", "content": "a"},
                                  {"role": "assistant", "content": "b"}],
                     "max_tokens": 1})
    out.append(("two trailing assistant messages", str(r.status_code)))
    r = _post(pool, {"messages": HI, "tools": [TOOL], "tool_choice": "none",
                     "max_tokens": 1})
    out.append(("`tools` + `tool_choice: none`", str(r.status_code)))
    r = _post(pool, {"messages": HI, "tools": [TOOL]})
    out.append(("`tools`, template without tools", f"{r.status_code} "
                f"{r.json()['error'].get('code')}"))
    r = httpx.options(pool.url + "/v1/chat/completions", timeout=30, headers={
        "Origin": "http://page.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization"})
    out.append(("CORS preflight, no key", f"{r.status_code}, allow-origin "
                f"{r.headers.get('Access-Control-Allow-Origin')}"))
    with httpx.Client(timeout=30) as client:  # one connection, no TLS setup
        started = time.perf_counter()
        for _ in range(50):
            client.options(pool.url + "/v1/chat/completions", headers={
                "Origin": "http://page.example",
                "Access-Control-Request-Method": "POST"})
        out.append(("CORS preflight, mean ms (50, one connection)",
                    f"{(time.perf_counter() - started) / 50 * 1000:.1f}"))
    r = httpx.get(pool.url + "/metrics", headers=AUTH, timeout=30)
    names = {line.split()[2] for line in r.text.splitlines()
             if line.startswith("# TYPE llamacpp:")}
    out.append(("`llamacpp:*` series on /metrics", str(len(names))))
    out.append(("`Process-Start-Time-Unix` on /metrics",
                str("Process-Start-Time-Unix" in r.headers)))
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny.gguf"
        subprocess.run([sys.executable, "-m", "llamapool", "make-test-model",
                        str(model)], check=True, capture_output=True)
        pool = Pool(model, Path(tmp), workers=1, api_keys=(KEY,))
        try:
            table = rows(pool)
        finally:
            pool.stop()
    print("| detail | result |\n|---|---|")
    for name, value in table:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
