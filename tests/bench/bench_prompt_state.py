"""What one saved prompt state costs: bytes, save ms, restore ms.

``python -m tests.bench.bench_prompt_state [--gemma PATH]`` loads the tiny
test model (and Gemma 3 270M, the default model, if installed), prefills
prompts of ~300 and ~1000 tokens, and times the two ways llama-cpp-python
offers to keep a KV state:

* sequence state (``llama_state_seq_get_data`` / ``set_data`` on sequence 0),
  what ``workers.model.prompt_reuse`` uses;
* whole-context state (``Llama.save_state`` / ``load_state``), which also
  copies the logits buffer.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp

from tests.bench.bench_prompt_size import default_gemma
from tests.bench.harness import md_table

N_CTX = 2048
SIZES = (300, 1000)


def _ms(fn) -> tuple[object, float]:
    started = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - started) * 1000


def _one_size(llama: llama_cpp.Llama, n: int) -> list[str]:
    ctx = llama._ctx.ctx
    words = ("the quick brown fox jumps over the lazy dog " * 400).encode()
    tokens = llama.tokenize(words)[:n]
    llama.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    _, prefill_ms = _ms(lambda: llama.eval(tokens))

    def save_seq():
        size = llama_cpp.llama_state_seq_get_size(ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0)
        return ctypes.string_at(buf, written)

    data, save_ms = _ms(save_seq)

    def load_seq():
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return llama_cpp.llama_state_seq_set_data(ctx, buf, len(data), 0)

    read, load_ms = _ms(load_seq)
    assert read == len(data), (read, len(data))
    whole, whole_save_ms = _ms(llama.save_state)
    _, whole_load_ms = _ms(lambda: llama.load_state(whole))
    whole_bytes = len(whole.llama_state) + whole.scores.nbytes
    return [str(len(tokens)), f"{prefill_ms:.0f}", f"{len(data) / 2**20:.1f}",
            f"{len(data) / len(tokens) / 1024:.1f}", f"{save_ms:.1f}",
            f"{load_ms:.1f}", f"{whole_bytes / 2**20:.1f}",
            f"{whole_save_ms:.0f}", f"{whole_load_ms:.0f}"]


def measure(name: str, path: str) -> list[list[str]]:
    llama = llama_cpp.Llama(model_path=path, n_ctx=N_CTX, n_batch=512,
                            n_threads=1, verbose=False)
    return [[name, *_one_size(llama, n)] for n in SIZES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gemma", default=None, help="Gemma GGUF (default: find)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tiny = Path(tmp) / "tiny.gguf"
        subprocess.run([sys.executable, "-m", "llamapool", "make-test-model",
                        str(tiny)], check=True, capture_output=True)
        models = [("tiny test model", str(tiny))]
        gemma = args.gemma or default_gemma()
        if gemma:
            models.append(("gemma-3-270m Q4_K_M", gemma))
        rows = [row for name, path in models for row in measure(name, path)]
    print(md_table(["model", "tokens", "prefill ms", "seq state MiB",
                    "KiB/token", "seq save ms", "seq restore ms",
                    "save_state MiB", "save_state ms", "load_state ms"], rows))


if __name__ == "__main__":
    main()
