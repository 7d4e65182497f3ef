# The two commands a new user runs (see README.md). Each sets up its own virtual environment.
#   make demo   trains the built-in tiny Wan-style DiT on the built-in reference mix (CPU, < 3 min)
#   make test   compile-checks the CUDA sources (when nvcc exists) and runs the test suite
VENV ?= .venv
PYTHON ?= python3
# The torch we test on CPU; on a GPU machine pass your CUDA build, e.g. make test TORCH="torch==2.11.0".
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: demo test check-cuda clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,plot,parquet]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/adaptiveload train --out runs/demo

check-cuda:
	bash .ci/compile_cuda.sh $(PY)

# pytest exits 5 when it collects no test; that is not a failure of the code under test.
test: $(VENV)/.installed check-cuda
	$(PY) -m pytest -n 2 -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

clean:
	rm -rf $(VENV) runs build *.egg-info
