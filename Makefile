# Two commands on a fresh machine:  `make demo`  and  `make test`.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: install demo test
install: $(VENV)/.installed

# The CPU build of torch first: a bare `torch` requirement may pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[test,eval]"
	touch $@

demo: install
	$(BIN)/selfspec demo

test: install
	$(BIN)/python -m pytest
