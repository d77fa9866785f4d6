# Two entry points for a fresh machine: `make lab` opens the course, `make test` runs every test.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: lab test

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

test: $(STAMP)
	$(PY) -m pytest
