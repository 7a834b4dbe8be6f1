"""Output-control fields against this checkout: a before/after table (issue 11, s. 1).

Starts a real pool (broker, 1 worker, gunicorn) on the tiny test model and
sends each request a client of llama.cpp's server would send; prints what
came back. Run it on two checkouts to compare. Two rows are about the
machinery rather than the HTTP API, and run here in subprocesses:

* ``in-chain grammar dead end``: llama-cpp-python's own way to apply a
  grammar (``Llama.generate(grammar=...)``), given a grammar that admits no
  token: the process's exit code (llama.cpp aborts), against this checkout's
  engine (``LlamaEngine.run``) on the same grammar.
* ``maxItems 10**6 schema``: llama-cpp-python's converter unbounded, against
  ``workers.model.grammar.schema_to_gbnf``: seconds and peak memory.

    python -m tests.bench.bench_output_controls
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

PERSON = {"type": "object", "properties": {"name": {"type": "string",
                                                    "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def _post(pool: Pool, path: str, body: dict) -> httpx.Response:
    return httpx.post(pool.url + path, json=body, timeout=120)


def _chat(pool: Pool, **extra) -> httpx.Response:
    return _post(pool, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Who?"}], "max_tokens": 200,
        **extra})


def _valid_person(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"name", "age"}
            and isinstance(value["name"], str) and isinstance(value["age"], int))


def http_rows(pool: Pool) -> list[tuple[str, str]]:
    rows = []
    valid = 0
    for seed in range(10):
        r = _chat(pool, temperature=1.0, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"schema": PERSON}})
        valid += r.status_code == 200 and _valid_person(
            r.json()["choices"][0]["message"]["content"])
    rows.append(("json_schema answers that validate (10 seeds)", f"{valid}/10"))
    for name, body in [
        ('response_format {"type": "sound"}', {"response_format": {"type": "sound"}}),
        ("malformed schema (type: frobnicate)",
         {"json_schema": {"type": "frobnicate"}}),
        ("GBNF that does not parse", {"grammar": "root ::= nope"}),
        ("unknown field (frobnicate: 1)", {"frobnicate": 1}),
        ("mirostat: 2 (a sampler we lack)", {"mirostat": 2}),
    ]:
        r = _chat(pool, **body)
        rows.append((name, f"HTTP {r.status_code}"))
    r = _post(pool, "/v1/completions", {"prompt": "Hello", "max_tokens": 6,
                                        "temperature": 0, "ignore_eos": True,
                                        "logit_bias": {"world": 100}})
    rows.append(('logit_bias {"world": 100}: output',
                 repr(r.json()["choices"][0]["text"]) if r.status_code == 200
                 else f"HTTP {r.status_code}"))
    r = _chat(pool, logprobs=True, top_logprobs=2, max_tokens=4)
    lp = r.json()["choices"][0].get("logprobs") if r.status_code == 200 else None
    rows.append(("logprobs: true, top_logprobs: 2",
                 f"HTTP {r.status_code}, {len(lp['content'])} entries" if lp
                 else f"HTTP {r.status_code}, none"))
    r = _post(pool, "/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                        "n_predict": 7, "ignore_eos": True})
    rows.append(("n_predict 7 with max_tokens 2: tokens",
                 str(r.json()["usage"]["completion_tokens"])))
    return rows


IN_CHAIN = """
import llama_cpp, sys
llama = llama_cpp.Llama(sys.argv[1], n_ctx=256, verbose=False)
grammar = llama_cpp.LlamaGrammar.from_string('root ::= "\\\\x00"')
for i, token in enumerate(llama.generate(llama.tokenize(b"Hi"), temp=0,
                                        grammar=grammar)):
    if i > 3:
        break
print("survived")
"""

OURS = """
import sys
from protocol.payloads import GenerationRequest, Sampling
from workers.model.llama_engine import LlamaEngine

class Sink:
    def emit(self, *a, **k): pass
    def should_stop(self): return False
    def wait_for_credit(self): return True
    def report_progress(self, *a): pass

engine = LlamaEngine(sys.argv[1], n_ctx=256, n_threads=1)
result = engine.run(GenerationRequest("completion", "Hi", max_tokens=4,
                                      grammar='root ::= "\\\\x00"',
                                      sampling=Sampling(temperature=0)), Sink())
print("survived", result.finish_reason)
"""

CONVERT = """
import json, resource, sys, time
started = time.perf_counter()
schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 10**6}
try:
    if sys.argv[1] == "unbounded":
        from llama_cpp.llama_grammar import json_schema_to_gbnf
        out = "grammar of %d chars" % len(json_schema_to_gbnf(json.dumps(schema)))
    else:
        from workers.model.grammar import schema_to_gbnf
        out = "grammar of %d chars" % len(schema_to_gbnf(schema))
except BaseException as exc:
    out = type(exc).__name__ + ": " + str(exc)[:60]
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
print(f"{out}; {time.perf_counter() - started:.2f} s, peak {rss} MB")
"""


def _run(code: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, timeout=300)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    return f"exit {proc.returncode}" + (f", {last}" if last else "")


def machinery_rows(model: Path) -> list[tuple[str, str]]:
    rows = [("in-chain grammar dead end (llama-cpp-python generate)",
             _run(IN_CHAIN, str(model)))]
    try:
        rows.append(("grammar dead end, this checkout's engine",
                     _run(OURS, str(model))))
    except subprocess.TimeoutExpired:
        rows.append(("grammar dead end, this checkout's engine", "timeout"))
    rows.append(("maxItems 10**6 schema, converter unbounded",
                 _run(CONVERT, "unbounded")))
    rows.append(("maxItems 10**6 schema, workers.model.grammar",
                 _run(CONVERT, "bounded")))
    return rows


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny.gguf"
        subprocess.run([sys.executable, "-m", "llamapool", "make-test-model",
                        str(model)], check=True, capture_output=True)
        run_dir = Path(tmp) / "pool"
        run_dir.mkdir()
        pool = Pool(model, run_dir, workers=1)
        try:
            started = time.monotonic()
            rows = http_rows(pool)
            rows.append(("(HTTP rows took)", f"{time.monotonic() - started:.1f} s"))
        finally:
            pool.stop()
        if "--no-machinery" not in sys.argv:
            rows += machinery_rows(model)
    print("| request | result |\n|---|---|")
    for name, result in rows:
        print(f"| {name} | {result} |")


if __name__ == "__main__":
    main()
