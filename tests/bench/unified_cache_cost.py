"""What the batched worker's unified KV cache costs a decode step: K
sequences with prompts of N tokens each, one token per sequence per step,
with llama.cpp's unified cache (the batched worker's) or one cache per
sequence (listed in increasing order, so that it too is one ubatch).

    python -m tests.bench.unified_cache_cost unified|perseq N K on|off
"""
import random
import sys
import time

import llama_cpp

from tests.bench import harness
from workers.model import llama_internals

unified = sys.argv[1] == "unified"; n_prompt = int(sys.argv[2]); K = int(sys.argv[3]); fa = sys.argv[4] == "on"
orig = llama_internals.BatchLlama.context_params.fset
def fset(self, params):
    orig(self, params)
    params.kv_unified = unified
llama_internals.BatchLlama.context_params = property(llama_internals.BatchLlama.context_params.fget, fset)
per = 2048
llama = llama_internals.BatchLlama(model_path=harness.default_model(), n_seq_max=K, use_extra_bufts=False,
    n_ctx=per * K, n_threads=2, n_threads_batch=2, n_batch=512, flash_attn=fa, verbose=False)
ctx = llama_internals.context_handle(llama)
batch = llama_internals.new_batch(512)
b = batch.batch
def decode(items):  # list of (seq, pos, token, logits)
    for i, (seq, pos, tok, lg) in enumerate(items):
        b.token[i] = tok; b.pos[i] = pos; b.n_seq_id[i] = 1; b.seq_id[i][0] = seq; b.logits[i] = lg
    b.n_tokens = len(items)
    assert llama_cpp.llama_decode(ctx, b) == 0
random.seed(0)
for seq in range(K):
    toks = [random.randrange(1000, 20000) for _ in range(n_prompt)]
    for start in range(0, n_prompt, 512):
        chunk = toks[start:start + 512]
        decode([(seq, start + i, t, False) for i, t in enumerate(chunk)])
pos = n_prompt
times = []
for step in range(40):
    t0 = time.perf_counter()
    decode([(seq, pos, 1234, True) for seq in range(K)])
    times.append(time.perf_counter() - t0)
    pos += 1
times = sorted(times[5:])
print(f"unified={unified} prompt={n_prompt} K={K} fa={fa}: decode ms/step median {1000*times[len(times)//2]:.1f}")
