# The README's two commands: `make run` (the main job) and `make test` (the test suite).
# Both create .venv and install everything on a fresh machine; nothing is installed by hand.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
NPROC ?= 4
STAMP := $(VENV)/.installed

.PHONY: install run run-megatron-lm test test-fast bench clean

$(STAMP): setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU torch build (local on our machines); pinned first so nothing pulls a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,bench,megatron-lm]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/python scripts/main_job.py --nproc $(NPROC)

# real Megatron-LM (MEGATRON_LM=DIR for your own checkout; default ../shared/megatron-lm/core_v0.16.1):
# patched copy, switched in memory, beside its own --save + restart + --load, timed
run-megatron-lm: $(STAMP)
	$(BIN)/python scripts/megatron_lm_job.py --nproc $(NPROC)

test: $(STAMP)
	$(BIN)/python -m pytest -q --timeout=1500

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not multirank"

clean:
	rm -rf $(VENV) runs .pytest_cache
