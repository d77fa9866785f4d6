# Two entry points for a fresh machine: `make lab` opens the course, `make test` runs every test.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NBVAL  := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg
# Lax: cells must run without raising; no saved output is compared (its last bits differ by host).
NBVAL_LAX := --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg

.PHONY: lab test test-gpu fuzz-server chromium exercises check-exercises grade figures bench book

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# JupyterLab at the repository's root, so notebooks/, exercises/ and solutions/ are all in its file
# browser, opening on chapter 00. Jupyter refuses to start as root (containers often are) unless
# told to. LAB_FLAGS adds flags (the browser test: a port, a token, no browser).
LAB_START := notebooks/00_setup.ipynb
lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ServerApp.root_dir="$(CURDIR)" \
		--LabApp.default_url=/lab/tree/$(LAB_START) $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_FLAGS)

# The browser tests drive Debian's chromium (never a downloaded browser); apt needs root.
chromium:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || \
		echo "could not install chromium: tests/test_browser.py will fail (MINIKV_SKIP_BROWSER=1 skips it)"

# Every test, then the portability pass: the notebooks and solutions again under another CPU's
# kernels (ATEN_CPU_CAPABILITY=default: no vector instructions, other summation orders), so a
# saved output that only this machine's arithmetic prints fails here, not on a student's laptop.
NOTEBOOKS := $(wildcard notebooks/*.ipynb solutions/*.ipynb)
test: $(STAMP) chromium
	@start=$$(date +%s); \
	$(VENV)/bin/ruff check minikv tests && \
	$(PY) -m pytest tests $(NOTEBOOKS) $(NBVAL) && \
	echo "== portability pass: notebooks/ and solutions/ under ATEN_CPU_CAPABILITY=default ==" && \
	ATEN_CPU_CAPABILITY=default $(PY) -m pytest -p no:cacheprovider $(NOTEBOOKS) $(NBVAL); \
	status=$$?; echo "make test: $$(( $$(date +%s) - start )) s in all"; exit $$status

# Regenerate exercises/ from solutions/ (never edit exercises by hand).
exercises: $(STAMP)
	$(PY) -m minikv exercises

# A student's check: one line per exercise (✓, not started, or ✗ with the checker's hint) and the
# total; exit 0 exactly when every exercise is solved and no other cell raised. CHAPTER=02 grades one
# chapter, VERBOSE=1 adds the failing cells' tracebacks. Graded by what the notebooks compute (a
# check cell must run without raising), so a student's CPU or GPU cannot fail a cell by its digits.
check-exercises: $(STAMP)
	@$(PY) -m minikv grade $(if $(CHAPTER),--chapter $(CHAPTER)) $(if $(filter 1,$(VERBOSE)),--verbose)

grade: check-exercises

# On a machine with a CUDA GPU: the tests marked `cuda`, then every notebook and solution on the
# GPU (MINIKV_DEVICE=cuda; lax, since GPU numbers differ in their last bits from the saved CPU
# outputs). Fails at once when torch sees no CUDA device.
test-gpu: $(STAMP)
	@$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
		'test-gpu: torch ' + torch.__version__ + ' sees no CUDA device (no GPU here, or a CPU-only torch)')"
	$(PY) -m pytest -m cuda tests
	MINIKV_DEVICE=cuda $(PY) -m pytest $(NOTEBOOKS) $(NBVAL_LAX)

# The HTTP server under its fuzzer at full length: 2,000 generated bodies (the default test run
# sends a few hundred), every answer checked, no 5xx, nothing in the server's log.
fuzz-server: $(STAMP)
	MINIKV_FUZZ_BODIES=2000 $(PY) -m pytest tests/test_fuzz_server.py

figures: $(STAMP)
	$(PY) -m minikv figures --out figures

bench: $(STAMP)
	$(PY) -m minikv bench --out benchmarks
	$(PY) -m minikv bench-load --out benchmarks/load
	$(PY) -m minikv bench-disagg --out benchmarks/disagg

# The course as a static site (Jupyter Book): the chapters as committed, with their outputs and each
# stepper's first step as a picture; nothing is executed or written beside the notebooks.
BOOK_OUT ?= build/book
book: $(STAMP)
	@start=$$(date +%s); \
	$(VENV)/bin/jupyter-book build . --config book/_config.yml --toc book/_toc.yml \
		--path-output $(BOOK_OUT) --warningiserror --keep-going --quiet && \
	echo "make book: $(BOOK_OUT)/_build/html/index.html in $$(( $$(date +%s) - start )) s"
