# Two commands on a fresh clone:  make demo   and   make test
# Both create .venv on first use and install the project into it from pyproject.toml.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: demo test bench bench-cpu train notebooks docs site assignments clean

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

# The real-data tests read MNIST from $CNN_DATA_DIR, else from data/mnist/ (where make demo fetches it),
# else from ../shared/data beside the checkout (tests/conftest.py); with none of them they are skipped, saying so.
test: $(VENV)/.installed-dev
	$(PY) -m pytest

bench: $(VENV)/.installed-core
	$(PY) -m cnn bench

# The [bench] extra (PyTorch's reference rows) on a machine without an NVIDIA GPU: PyTorch's CPU build from
# PyTorch's own index first (from PyPI, Linux gets the CUDA build and ~17 NVIDIA wheels, gigabytes it cannot use),
# then the rest of the extra from PyPI, which keeps the torch already there. The torch requirement is the one of
# pyproject's bench extra (tests/test_cli.py keeps the two equal).
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
bench-cpu: $(VENV)/.installed-core
	$(PY) -m pip install --quiet "torch>=2.4" --index-url $(TORCH_CPU_INDEX)
	$(PY) -m pip install --quiet -e ".[bench]"

train: $(VENV)/.installed-core
	$(PY) -m cnn train --stage numpy --model lenet5 --epochs 10

# Every tutorial notebook run top to bottom (a full run, not CNN_FAST) with its outputs stored in it, as
# they are committed; `python notebooks/execute.py 04 08` runs only some. As root, Open MPI also wants
# OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 in the environment.
notebooks: $(VENV)/.installed-dev
	$(PY) notebooks/execute.py

# The headline picture, then the generated blocks of README.md, docs/benchmarks.md (the fault-injection table and
# the distributed strategies too), docs/profiling.md and the
# stage docstrings, from the quiet files of benchmarks/results/ (the files left out are named).
docs: $(VENV)/.installed-core
	$(PY) -m cnn bench --headline
	$(PY) -m cnn bench --update-readme
	$(PY) -m cnn bench --update-docs
	$(PY) benchmarks/fault_injection.py --render-only --page docs/benchmarks.md --readme README.md
	$(PY) -m cnn.parallel.report benchmarks/results/parallel_strategies.json --into docs/benchmarks.md

# The course website in results/site/ (open results/site/index.html): README, docs/ and the tutorial
# notebooks with their stored outputs, not re-executed (site/conf.py). Equations: apt-get install libjs-mathjax.
site: $(VENV)/.installed-dev
	$(PY) -m sphinx -b html -c site -q . results/site

# The student release (solutions removed) of every assignment, into assignments/release/.
# nbgrader shells out to alembic when it creates the gradebook, hence the PATH.
assignments: $(VENV)/.installed-dev
	cd assignments && PATH="$(CURDIR)/$(VENV)/bin:$$PATH" "$(CURDIR)/$(PY)" -m nbgrader generate_assignment "*" --force

clean:
	rm -rf $(VENV) results .pytest_cache
