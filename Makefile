# The two commands of the README, and the steps of the test suite.
# Every target bootstraps .venv/ first (idempotent: redone only when pyproject.toml or constraints.txt change).

SHELL := /bin/bash
VENV  := .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTHON ?= python3
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_PROGRESS_BARS := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: golden run test setup check-clean check-export check-readme nbtest nbval pytest readme

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# CPU torch first, pinned: anything unpinned that depends on torch would pull a CUDA build.
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

## make run: the main job on the embedded default (RL on CPU that visibly learns; under 10 minutes).
run: setup
	$(BIN)/molt-nb train recipes/arith

## make test: the whole suite, in order, stopping at the first failure; ends with pytest's summary line.
test: setup check-clean check-export check-readme nbtest nbval pytest

# Hash the files `find $(1)` lists, run $(2), fail with message $(3) if any changed.
define unchanged
	@before=$$(find $(1) -type f -not -path '*/.ipynb_checkpoints/*' | sort | xargs sha256sum); \
	$(2) >/dev/null; \
	after=$$(find $(1) -type f -not -path '*/.ipynb_checkpoints/*' | sort | xargs sha256sum); \
	if [ "$$before" != "$$after" ]; then \
	  echo "FAILED: '$(2)' changed files:"; diff <(echo "$$before") <(echo "$$after") | grep '^>' ; \
	  echo "$(3)"; exit 1; fi; echo "ok: $(2) changes nothing"
endef

check-clean: setup
	$(call unchanged,nbs -name '*.ipynb',$(BIN)/nbdev-clean,Notebooks were not clean: commit the cleaned notebooks.)

check-export: setup
	$(call unchanged,molt_nb -name '*.py',$(BIN)/nbdev-export,molt_nb/ differs from what the notebooks export: commit the export and never edit molt_nb/ by hand.)

## make golden: record the outputs of every golden case (after a deliberate change to an algorithm; commit the JSON).
golden: setup
	$(BIN)/python -c 'from molt_nb.golden import update_golden; print(*update_golden(), sep="\n")'

readme: setup
	$(BIN)/jupyter nbconvert --to markdown nbs/index.ipynb --output README --output-dir . --log-level=ERROR

check-readme: setup
	$(call unchanged,. -maxdepth 1 -name README.md,$(MAKE) -s readme,README.md is out of date with nbs/index.ipynb: commit the regenerated README.md.)

nbtest: setup
	$(BIN)/nbdev-test

nbval: setup
	$(BIN)/python -m pytest --nbval nbs --nbval-sanitize-with nbval_sanitize.cfg -p no:cacheprovider -q

pytest: setup
	$(BIN)/python -m pytest tests -p no:cacheprovider
