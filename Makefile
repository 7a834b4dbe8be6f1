# Two commands matter: `make serve` and `make test`. Both create .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP_SERVE := $(VENV)/.installed-serve
STAMP_TEST := $(VENV)/.installed-test

.PHONY: serve test venv clean

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
	$(PY) -m pytest tests

clean:
	rm -rf $(VENV) .pytest_cache
