# Two entry points for a fresh machine: `make lab` opens the course, `make test` runs every test.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NBVAL  := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg

.PHONY: lab test chromium exercises check-exercises figures bench

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# Jupyter refuses to start as root (containers often are) unless told to.
lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root)

# The browser tests drive Debian's chromium (never a downloaded browser); apt needs root.
chromium:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || \
		echo "could not install chromium: tests/test_browser.py will fail (MINIKV_SKIP_BROWSER=1 skips it)"

test: $(STAMP) chromium
	$(VENV)/bin/ruff check minikv tests
	$(PY) -m pytest tests $(wildcard notebooks/*.ipynb solutions/*.ipynb) $(NBVAL)

# Regenerate exercises/ from solutions/ (never edit exercises by hand).
exercises: $(STAMP)
	$(PY) -m minikv exercises

# A student's check: passes once every exercise in exercises/ is solved.
check-exercises: $(STAMP)
	$(PY) -m pytest exercises $(NBVAL)

figures: $(STAMP)
	$(PY) -m minikv figures --out figures

bench: $(STAMP)
	$(PY) -m minikv bench --out benchmarks
