# make demo: the main job on the embedded default. make test: the test suite. Both install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install data browser clean fuzz

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The pinned CPU wheel first, so the dependency `torch>=2.4` is already met (no multi-GB CUDA build).
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

install: $(STAMP)

# Debian's Fashion-MNIST package when apt is at hand (as root); vitkit downloads it otherwise.
$(FMNIST):
	-(command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	  (apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1))) || true

data: $(FMNIST)

# Debian's Chromium for the web page's browser test (tests/test_serve.py drives it with playwright).
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	-(command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	  (apt-get install -y -q chromium >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1))) || true

browser: $(CHROMIUM)

demo: $(STAMP) data
	$(VENV)/bin/vitkit demo

# pytest-xdist: a worker per core (at most 4), each with its share of the cores (tests/conftest.py). A worker that
# crashes is reported with its test's name and replaced; faulthandler prints the stack of a crash or a hang.
# lint-imports: the package's layers and no import cycles, as pyproject.toml declares them (docs/architecture.md);
# ruff: the rule set pyproject.toml's [tool.ruff.lint] declares, over the whole tree
test: $(STAMP) data browser
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff check .
	$(PY) -m pytest tests -n auto --maxprocesses 4 --dist loadgroup --durations=15

# A fuzzing campaign (fuzz/README.md): every door under atheris for FUZZ_SECONDS each, then schemathesis against
# the service. A crash stops with the input in fuzz/crashes/; fixed, it joins tests/fuzz_regressions/.
FUZZ_SECONDS ?= 60
fuzz: $(STAMP)
	$(PY) -m pip install -q -e '.[fuzz]'
	$(PY) -m fuzz.run all --seconds $(FUZZ_SECONDS)
	$(PY) -m fuzz.service --max-examples 500

clean:
	rm -rf $(VENV) build *.egg-info
