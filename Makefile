# Two commands on a fresh clone:  make demo   and   make test
# Both create .venv on first use and install the project into it from pyproject.toml.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: demo test bench train assignments clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# One stamp per set of extras, redone whenever pyproject.toml changes.
$(VENV)/.installed-core: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@ $(VENV)/.installed-core

demo: $(VENV)/.installed-core
	$(PY) -m cnn bench --demo

test: $(VENV)/.installed-dev
	$(PY) -m pytest

bench: $(VENV)/.installed-core
	$(PY) -m cnn bench

train: $(VENV)/.installed-core
	$(PY) -m cnn train --stage numpy --model lenet5 --epochs 10

clean:
	rm -rf $(VENV) results .pytest_cache
