"""Many conversations on few workers: what the prompt-state cache and prefix
routing save (issue 13).

``python -m tests.bench.bench_conversations`` (``make bench-conversations``)
starts one real pool (broker, K workers, gunicorn) per configuration, all at
once, and plays the same N conversations x T turns against each: every
conversation has its own preamble (~300 tokens), each turn resends the whole
history (chat completions, streamed, usage included), and the turns of
different conversations are interleaved at random with a fixed seed,
``--concurrency`` turns of different conversations at a time. The pools take
each step in turn, in an order that rotates (``play``), so the machine's
drift falls on all of them alike.

Configurations, side by side: ``--routing prefix`` and ``--routing lru`` with
the default ``--cache-ram``, and ``--routing prefix --cache-ram 0`` (only
the live KV sequence, as before the cache). Printed per configuration: the
share of follow-up prompt tokens served from cache, TTFT p50/p90 of first
turns and of follow-ups, decode tokens/s (per request, mean) and the seconds
the pool was busy with its turns.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.bench.bench_prompt_size import default_gemma
from tests.bench.harness import md_table
from tests.pool import Pool

WORDS = ("river mountain lantern harbor orchard violet copper meadow falcon "
         "pebble thunder saffron glacier whisper compass ember willow quartz "
         "canyon maple beacon tundra velvet cobalt prairie lagoon summit "
         "juniper marble cinder fjord nectar").split()


def system_prompt(rng: random.Random, i: int, n_words: int) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(n_words))
    return (f"You are assistant number {i}. Keep these notes in mind: {body}. "
            "Answer briefly.")


def user_turn(rng: random.Random, turn: int) -> str:
    topic = " ".join(rng.choice(WORDS) for _ in range(8))
    return f"Turn {turn}: tell me about {topic}."


class Conversation:
    """One conversation's history. Its ~300-token preamble opens the first
    user message: Gemma has no system role, and llama-cpp-python's ``gemma``
    chat format drops system messages (Gemma's own template folds them into
    the first user turn, as here)."""

    def __init__(self, idx: int, preamble: str) -> None:
        self.idx = idx
        self.preamble = preamble
        self.messages: list[dict] = []
        self.turn = 0


def play_turn(url: str, conv: Conversation, text: str, max_tokens: int) -> dict:
    """One streamed chat turn; returns its figures. Retries on 503."""
    if not conv.messages:
        text = f"{conv.preamble}\n\n{text}"
    conv.messages.append({"role": "user", "content": text})
    body = {"messages": conv.messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0,
            "ignore_eos": True}
    while True:
        started = time.perf_counter()
        first = None
        reply, usage = [], None
        with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                          timeout=900) as r:
            if r.status_code == 503:
                time.sleep(float(r.headers.get("Retry-After", "1")))
                continue
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        if first is None:
                            first = time.perf_counter()
                        reply.append(piece)
        ended = time.perf_counter()
        break
    conv.messages.append({"role": "assistant", "content": "".join(reply)})
    first = first or ended
    decode_s = ended - first
    return {
        "first_turn": conv.turn == 0,
        "ttft_s": first - started,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "decode_tps": (usage["completion_tokens"] - 1) / decode_s
        if decode_s > 0 else 0.0,
    }


def steps_of(schedule: list[int], concurrency: int) -> list[list[int]]:
    """Cut the shuffled schedule into steps of up to ``concurrency`` turns of
    different conversations (a conversation's next turn waits for its last),
    in schedule order."""
    pending, steps = list(schedule), []
    while pending:
        step: list[int] = []
        for conv in pending:
            if conv not in step:
                step.append(conv)
            if len(step) == concurrency:
                break
        for conv in step:
            pending.remove(conv)
        steps.append(step)
    return steps


def play(urls: dict[str, str], args: argparse.Namespace
         ) -> dict[str, tuple[list[dict], float]]:
    """All conversations against every pool, side by side.

    The pools run at once (an idle worker costs no CPU). Step by step, each
    pool in turn gets the same ``--concurrency`` turns at once, and the order
    of the pools rotates every step: this machine's speed drifts by 10-30%
    over minutes, so pools played one after another would compare the drift
    (it once showed the first pool 9% slower at decoding). Each pool has its
    own copy of every conversation: its replies go into its own history.

    Returns, per pool: the turns' figures and the pool's busy seconds.
    """
    rng = random.Random(args.seed)
    preambles = [system_prompt(rng, i, args.system_words)
                 for i in range(args.conversations)]
    schedule = [i for i in range(args.conversations) for _ in range(args.turns)]
    rng.shuffle(schedule)
    texts = {(i, t): user_turn(rng, t)
             for i in range(args.conversations) for t in range(args.turns)}
    convs = {name: [Conversation(i, preambles[i])
                    for i in range(args.conversations)] for name in urls}
    results: dict[str, list[dict]] = {name: [] for name in urls}
    busy_s = dict.fromkeys(urls, 0.0)
    names = list(urls)
    with ThreadPoolExecutor(max_workers=args.concurrency) as clients:
        for n, step in enumerate(steps_of(schedule, args.concurrency)):
            for name in names[n % len(names):] + names[:n % len(names)]:
                started = time.perf_counter()
                turns = [convs[name][i] for i in step]
                figures = list(clients.map(
                    lambda conv, url=urls[name]: play_turn(
                        url, conv, texts[conv.idx, conv.turn], args.max_tokens),
                    turns))
                busy_s[name] += time.perf_counter() - started
                for conv in turns:
                    conv.turn += 1
                results[name] += figures
    return {name: (results[name], busy_s[name]) for name in urls}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarise(name: str, results: list[dict], busy_s: float) -> list[object]:
    firsts = [r for r in results if r["first_turn"]]
    follows = [r for r in results if not r["first_turn"]]
    share = (sum(r["cached_tokens"] for r in follows)
             / max(1, sum(r["prompt_tokens"] for r in follows)))
    return [name, round(share, 2),
            pct([r["ttft_s"] for r in firsts], 0.5),
            pct([r["ttft_s"] for r in firsts], 0.9),
            pct([r["ttft_s"] for r in follows], 0.5),
            pct([r["ttft_s"] for r in follows], 0.9),
            statistics.fmean(r["decode_tps"] for r in results),
            round(busy_s, 1)]


def start_pool(model: str, routing: str, cache_ram: str | None,
               args: argparse.Namespace, run_dir: Path) -> Pool:
    worker_args = ["--threads", str(args.threads), "--ctx", str(args.ctx)]
    if args.chat_format:
        worker_args += ["--chat-format", args.chat_format]
    if cache_ram is not None:
        worker_args += ["--cache-ram", cache_ram]
    env = {"LLAMAPOOL_CHAT_FORMAT": args.chat_format} if args.chat_format else {}
    return Pool(Path(model), run_dir, workers=args.workers,
                worker_args=tuple(worker_args), frontend_env=env,
                broker_args=("--routing", routing))


#: name -> (--routing, --cache-ram or None for the default, label).
CONFIGS = {
    "prefix": ("prefix", None, "--routing prefix"),
    "lru": ("lru", None, "--routing lru"),
    "no-cache": ("prefix", "0", "--routing prefix --cache-ram 0"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="GGUF (default: Gemma 3 270M, the default model)")
    parser.add_argument("--chat-format", default="gemma")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="llama.cpp threads per worker")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=230,
                        help="words of system prompt (~300 Gemma tokens)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="comma-separated, from: " + ", ".join(CONFIGS))
    args = parser.parse_args()
    model = args.model or default_gemma()
    if model is None:
        parser.error("no --model and the default model package is not installed")
    names = [name.strip() for name in args.configs.split(",")]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        pools = {}
        for name in names:
            routing, cache_ram, _ = CONFIGS[name]
            run_dir = Path(tmp, name)
            run_dir.mkdir()
            pools[name] = start_pool(model, routing, cache_ram, args, run_dir)
            stack.callback(pools[name].stop)
        played = play({name: pool.url for name, pool in pools.items()}, args)
    rows = [summarise(CONFIGS[name][2], *played[name]) for name in names]
    print(f"\n{args.conversations} conversations x {args.turns} turns, "
          f"{args.workers} workers x {args.threads} thread(s), "
          f"concurrency {args.concurrency}, seed {args.seed}, "
          f"model {Path(model).name}\n")
    print(md_table(["config", "follow-up cached share", "TTFT p50 first (s)",
                    "TTFT p90 first (s)", "TTFT p50 follow-up (s)",
                    "TTFT p90 follow-up (s)", "decode tok/s", "busy s"], rows))


if __name__ == "__main__":
    main()
