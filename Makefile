# The commands a new user runs (see README.md). Each sets up its own virtual environment.
#   make demo        trains the built-in tiny Wan-style DiT on the built-in reference mix (CPU, about 1 min)
#   make test        runs the whole test suite; with CHECK_CUDA=1 (as CI sets it) it first compile-checks
#                    every CUDA source for sm_90 (skipped where nvcc is absent; minutes on a small CPU)
#   make test-fast   the tests not marked slow (no end-to-end runs, subprocesses, builds or Inductor
#                    compiles): a few minutes on a 2-core CPU
#   make check-cuda  only the CUDA compile check (.ci/compile_cuda.sh)
VENV ?= .venv
PYTHON ?= python3
# The torch we test on CPU; on a GPU machine pass your CUDA build, e.g. make test TORCH="torch==2.11.0".
# TORCH_INDEX: extra pip arguments for it, e.g. TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
# (PyPI's Linux wheel is the CUDA build, a large download a CPU-only machine does not need).
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
CHECK_CUDA ?= 0
PY := $(VENV)/bin/python

.PHONY: demo test test-fast check-cuda clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)" $(TORCH_INDEX)
	$(PY) -m pip install -q -e ".[test,plot,parquet]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/adaptiveload train --out runs/demo

check-cuda: $(VENV)/.installed
	bash .ci/compile_cuda.sh $(PY)

# pytest exits 5 when it collects no test; that is not a failure of the code under test.
pytest = $(PY) -m pytest -n 2 -q $(1); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

test: $(VENV)/.installed $(if $(filter 1,$(CHECK_CUDA)),check-cuda)
	$(call pytest,)

test-fast: $(VENV)/.installed
	$(call pytest,-m "not slow")

clean:
	rm -rf $(VENV) runs build *.egg-info
