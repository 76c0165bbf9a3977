SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-print-directory

ROOT := $(CURDIR)
CHART := charts/deepspeed-training
# Pinned tools live in .tools/bin (scripts/install-tools.sh); the venv's python, deepspeed and pytest first.
export PATH := $(ROOT)/.venv/bin:$(ROOT)/.tools/bin:$(PATH)
# DeepSpeed's JIT-built ops, built once by `make setup`.
export TORCH_EXTENSIONS_DIR := $(ROOT)/.build/torch_extensions
PYTEST_ARGS ?=

##@ General

.PHONY: help
help: ## Show this help.
	@awk 'BEGIN {FS = ":.*##"; printf "Usage: make <target> [VAR=value]\n"} \
	  /^[a-zA-Z_-]+:.*?##/ { printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2 } \
	  /^##@/ { printf "\n\033[1m%s\033[0m\n", substr($$0, 5) }' $(MAKEFILE_LIST)

.PHONY: setup
setup: ## Install everything: Debian packages, pinned helm, .venv (torch, deepspeed), checkov, prebuilt ops.
	bash scripts/setup.sh

##@ Development

.PHONY: test
test: ## Run the whole test suite (chart, train, glue, multi-host e2e).
	pytest $(PYTEST_ARGS)

.PHONY: lint
lint: ## helm lint --strict with every ci values file, shellcheck, ruff.
	for f in $(CHART)/ci/*-values.yaml; do helm lint --strict $(CHART) -f "$$f" > /dev/null || { helm lint --strict $(CHART) -f "$$f"; exit 1; }; done
	shellcheck -x $(CHART)/files/*.sh scripts/*.sh
	ruff check .
