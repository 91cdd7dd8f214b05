# The two commands of the README:
#   make demo   run the whole farm end to end on this machine (example data, tiny model)
#   make test   lint, type-check and run the whole test suite (what .ci/run calls)
# Both create .venv and install what they need first.

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint system-deps clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# redis-server is the only system package needed; install it only where it is missing.
system-deps:
	@command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; }

demo: $(STAMP) system-deps
	$(PY) -m producer demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy .

test: $(STAMP) system-deps lint
	$(PY) -m pytest

clean:
	rm -rf $(VENV) demo-out .pytest_cache .mypy_cache .ruff_cache
