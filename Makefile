# The README's two commands: `make run` (the main job) and `make test` (the test suite).
# Both create .venv and install everything on a fresh machine; nothing is installed by hand.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
NPROC ?= 4
STAMP := $(VENV)/.installed

.PHONY: install run run-mcore test test-fast bench clean gpu-wheels

$(STAMP): setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU torch build (local on our machines); pinned first so nothing pulls a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,bench,megatron-lm]"
	touch $(STAMP)

install: $(STAMP)

# the main job, real Megatron-LM (MEGATRON_LM=DIR for your own checkout of a supported release;
# default ../shared/megatron-lm/core_v0.19.0, the latest release, the one the whole suite
# runs on; its dataset helper is built in the copy: g++ and the extra's pybind11): a patched copy trains with the plain torchrun command,
# switches through its schedule and signal file (a scale-in and a scale-out among them),
# beside its own --save + restart + --load, timed
run: $(STAMP)
	$(BIN)/python scripts/megatron_lm_job.py --nproc 4

# our own stand-in job on megatron-core (scripts/pretrain_gpt.py), for tests and benchmarks
run-mcore: $(STAMP)
	$(BIN)/python scripts/main_job.py --nproc $(NPROC)

# the whole suite on the default Megatron-LM release (core_v0.19.0, the latest), then the
# tests marked every_release on the others (docs/releases.md: the test matrix)
OTHER_MEGATRON_LM ?= core_v0.16.1
test: $(STAMP)
	$(BIN)/python -m pytest -q --timeout=1500 --durations=20
	for r in $(OTHER_MEGATRON_LM); do \
	  DYNATRAIN_MEGATRON_LM=$$r $(BIN)/python -m pytest -q --timeout=1500 -m every_release || exit 1; \
	done

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not multirank"

# what scripts/gpu_check.py needs on the lent GPU machine (Python 3.12, its own torch, no
# network, no megatron-core): wheels in the git-ignored gpu_wheels/, which the device tool
# carries with the tree (carry=["gpu_wheels"]); docs/gpu.md
gpu-wheels: $(STAMP)
	$(BIN)/pip download -q --no-deps --python-version 3.12 --only-binary=:all: -d gpu_wheels \
	  megatron-core==0.16.1 "packaging>=24.2" "einops~=0.8" psutil

clean:
	rm -rf $(VENV) runs .pytest_cache
