# Two commands (README): `make run` runs the default model, `make test` runs the tests (CI's suite: the tests
# marked slow, more combinations of model and schedule, are left to `make test-all`).
# Each creates .venv and installs what it needs on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned, so pip does not pull a multi-GB build when a local wheel suits
TORCH ?= torch==2.13.0
PROMPT ?= The quick brown fox
ARGS ?=

.PHONY: run test test-all install clean

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
	touch $@

install: $(VENV)/.installed

run: $(VENV)/.installed
	$(VENV)/bin/sluice generate --prompt "$(PROMPT)" $(ARGS)

# tests spread over up to four worker processes (pytest-xdist), one per core
test: $(VENV)/.installed
	$(PY) -m pytest -q -n auto --maxprocesses 4 -m "not slow" $(ARGS)

test-all: $(VENV)/.installed
	$(PY) -m pytest -q -n auto --maxprocesses 4 $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
