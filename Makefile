# make demo: the main job on the embedded default. make test: the test suite. Both install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The pinned CPU wheel first, so the dependency `torch>=2.4` is already met (no multi-GB CUDA build).
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[demo,test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/vitkit demo

test: $(STAMP)
	$(PY) -m pytest tests

clean:
	rm -rf $(VENV) build *.egg-info
