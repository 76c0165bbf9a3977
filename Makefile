SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-print-directory

ROOT := $(CURDIR)
CHART := charts/deepspeed-training
# The project's version (pyproject.toml, the one place it is written): the images' tags and the chart's.
VERSION := $(shell python3 scripts/pins.py version)
# Pinned tools live in .tools/bin (scripts/install-tools.sh); the venv's python, deepspeed and pytest first.
export PATH := $(ROOT)/.venv/bin:$(ROOT)/.tools/bin:$(PATH)
# DeepSpeed's JIT-built ops, built once by `make setup`.
export TORCH_EXTENSIONS_DIR := $(ROOT)/.build/torch_extensions
PYTEST_ARGS ?=
SOAK_ARGS ?=
# pytest processes for `make test`: the suite waits on ranks, sshd and helm more than it computes (two processes keep
# 55% of 2 cores busy), so three share this machine's cores (636 s -> 598 s); each takes whole test files (module
# fixtures stay shared), in collection order: the long multi-host files of tests/e2e first, not last (xdist's default
# puts big files first).
TEST_WORKERS ?= 3
ENV ?=
PROJECT ?=
RANK ?=
ATTEMPT ?=
KUBE_CONTEXT ?=
DRY_RUN ?=
WAIT ?=
ENVS := $(basename $(filter-out base.yaml,$(notdir $(wildcard values/*.yaml))))
PROJECTS := $(notdir $(patsubst %/,%,$(wildcard values/projects/*/)))
# ENV, PROJECT and KUBE_CONTEXT may come from a CI pipeline: taken unexpanded ($(value)), ENV and PROJECT
# accepted only as names under values/, and all three reach recipes as environment variables ("$$ENV"), never
# pasted into a shell line.
override ENV := $(value ENV)
override PROJECT := $(value PROJECT)
override KUBE_CONTEXT := $(value KUBE_CONTEXT)
override DRY_RUN := $(value DRY_RUN)
override WAIT := $(value WAIT)
override REGISTRY := $(value REGISTRY)
override PYTEST_ARGS := $(value PYTEST_ARGS)
override SOAK_ARGS := $(value SOAK_ARGS)
override TEST_WORKERS := $(value TEST_WORKERS)
override RANK := $(value RANK)
override ATTEMPT := $(value ATTEMPT)
export ENV PROJECT KUBE_CONTEXT TEST_WORKERS SOAK_ARGS
# A refused value as the error shows it: quoted, on one line. Never expanded again (make expands a reference once).
define newline


endef
quoted = '$(subst $(newline), ,$(1))'
# One word, no `%` (a filter pattern), and one of the names in $(2).
one-of = $(and $(filter 1,$(words $(1))),$(if $(findstring %,$(1)),,$(filter $(1),$(2))))
check-project = $(if $(PROJECT),$(if $(call one-of,$(PROJECT),$(PROJECTS)),,$(error PROJECT $(call \
  quoted,$(PROJECT)): not a project under values/projects/; expected one of: $(PROJECTS))))
require-env = $(if $(ENV),,$(error ENV is required: `make $@ ENV=dev`; environments: $(ENVS)))$(if \
  $(call one-of,$(ENV),$(ENVS)),,$(error ENV $(call quoted,$(ENV)): not an environment under values/; expected one of: \
  $(ENVS)))$(check-project)
require-project = $(if $(PROJECT),,$(error PROJECT is required for $@: `make $@ ENV=$(or $(ENV),prod) PROJECT=example`))
DEPLOYCTL = python -m scripts.deployctl --env "$$ENV" $(if $(PROJECT),--project "$$PROJECT") \
  $(if $(KUBE_CONTEXT),--kube-context "$$KUBE_CONTEXT") $(if $(filter 1 true yes,$(DRY_RUN)),--dry-run) \
  $(if $(filter 1 true yes,$(WAIT)),--wait)

##@ General

.PHONY: help
help: ## Show this help.
	@awk 'BEGIN {FS = ":.*##"; printf "Usage: make <target> [VAR=value]\n"} \
	  /^[a-zA-Z_-]+:.*?##/ { printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2 } \
	  /^##@/ { printf "\n\033[1m%s\033[0m\n", substr($$0, 5) }' $(MAKEFILE_LIST)

.PHONY: setup
setup: ## Install everything: Debian packages, pinned helm, .venv (torch, deepspeed), checkov, prebuilt ops.
	bash scripts/setup.sh

##@ Deploy (ENV=dev|staging|prod, PROJECT=<values/projects/NAME>, KUBE_CONTEXT=, DRY_RUN=1, WAIT=1)

.PHONY: render
render: ## Layer values/, render ds_config and the Helm values into build/<project>/<env>/, validate.
	$(require-env)
	$(DEPLOYCTL) render

.PHONY: plan
plan: ## Render, validate and print the plan: release, workers x GPUs, batch, ZeRO, memory per GPU.
	$(require-env)
	$(DEPLOYCTL) plan

.PHONY: template
template: ## helm template of the rendered values (what deploy would apply).
	$(require-env)
	$(DEPLOYCTL) template

.PHONY: deploy
deploy: ## Render, validate, then helm upgrade --install (DRY_RUN=1: print the command and objects only).
	$(require-env)
	$(require-project)
	$(DEPLOYCTL) deploy

.PHONY: diff
diff: ## helm diff upgrade against the cluster (needs the helm-diff plugin).
	$(require-env)
	$(require-project)
	$(DEPLOYCTL) diff

.PHONY: undeploy
undeploy: ## helm uninstall the release (the SSH key Secret is kept for a later install).
	$(require-env)
	$(require-project)
	$(DEPLOYCTL) undeploy

.PHONY: status
status: ## Where the release's run stands: its progress ConfigMap (step, loss, ETA, attempt, state and reason); WATCH=1 follows it until the run ends.
	$(require-env)
	$(require-project)
	$(DEPLOYCTL) status $(if $(WATCH),--watch)

.PHONY: why
why: ## Why the run stands where it does: each attempt's cause and time, the budget left, the culprit and its stacks, the last checkpoint.
	$(require-env)
	$(require-project)
	$(DEPLOYCTL) why

.PHONY: logs
logs: export RANK := $(RANK)
logs: export ATTEMPT := $(ATTEMPT)
logs: ## One global rank's lines (RANK=N, ATTEMPT=k for one attempt), from the pod log that holds them; FOLLOW=1 follows them.
	$(require-env)
	$(require-project)
	$(if $(RANK),,$(error RANK is required: `make logs ENV=$(or $(ENV),prod) PROJECT=$(or $(PROJECT),example) RANK=0 [ATTEMPT=2]`))
	$(DEPLOYCTL) logs --rank "$$RANK" $(if $(ATTEMPT),--attempt "$$ATTEMPT") $(if $(FOLLOW),--follow)

.PHONY: demo
demo: setup ## No cluster needed: render ENV=dev and run its ds_config and train args as a local 2-rank CPU job.
	$(check-project)
	python -m scripts.deployctl --env dev $(if $(PROJECT),--project "$$PROJECT") demo

##@ Development

.PHONY: test
test: setup lint ## Set up if needed, lint, then run the whole test suite (chart, train, glue, multi-host e2e).
	pytest -n "$$TEST_WORKERS" --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

.PHONY: generate
generate: ## Regenerate what is generated from its owner: the chart README's values table and schema docs, the chart's ds_config keys.
	python scripts/values_table.py
	python scripts/chart_data.py

.PHONY: image
image: ## Build the worker/launcher image with docker or podman (VARIANT=cpu|cuda|rocm; docs/deploying.md, "The images").
	bash scripts/image.sh build

.PHONY: image-hf
image-hf: image ## The Hugging Face layer on the image (docker/Dockerfile.hf): transformers, accelerate, datasets.
	bash scripts/image.sh build_hf

.PHONY: image-sidecar
image-sidecar: ## The progress sidecar's image (docker/Dockerfile.sidecar), which a platform pins as progress.image.
	bash scripts/image.sh build_sidecar

.PHONY: image-push
image-push: ## Tag and push the image: make image-push REGISTRY=registry.example.com/ml
	$(if $(REGISTRY),,$(error REGISTRY is required: `make image-push REGISTRY=registry.example.com/ml`))
	REGISTRY=$(REGISTRY) bash scripts/image.sh push

.PHONY: test-images-build
test-images-build: ## What test-image builds, without its tests: podman, the debootstrapped base, the CPU and sidecar images.
	bash scripts/setup-podman.sh
	bash scripts/image.sh base
	VARIANT=cpu bash scripts/image.sh build
	bash scripts/image.sh build_sidecar

.PHONY: test-image
test-image: test-images-build ## Build the CPU and sidecar images with podman (debootstrapped base); run a launcher + 2 workers in them.
	DS_TEST_IMAGE=deepspeed-train:$(VERSION)-cpu DS_TEST_SIDECAR_IMAGE=deepspeed-sidecar:$(VERSION) \
	  CONTAINERS_CONF=$(ROOT)/.build/containers.conf pytest tests/image -v

.PHONY: test-image-cuda
test-image-cuda: ## Build the CUDA image and its Hugging Face layer with podman (no GPU needed) and check them.
	bash scripts/setup-podman.sh
	bash scripts/image.sh base
	VARIANT=cuda bash scripts/image.sh build
	VARIANT=cuda bash scripts/image.sh build_hf
	DS_TEST_CUDA_IMAGE=deepspeed-train:$(VERSION)-cuda CONTAINERS_CONF=$(ROOT)/.build/containers.conf \
	  pytest tests/image/test_image_cuda.py -v -rP
	bash .ci/cuda-image-inputs > .ci/cuda-image-checked  # commit it: CI skips this check while the inputs match

.PHONY: test-cluster
test-cluster: ## The cluster tier on a real Kubernetes: the local one-node cluster of ../shared/k8s (root), or KUBECONFIG + DS_IMAGE.
	bash scripts/test-cluster.sh

.PHONY: soak
soak: ## Half an hour on the real kubelet with a fault every 3 minutes, and each fault's loss and the goodput (root; not in CI; after make test-image). SOAK_ARGS="--minutes 30 --fault-every 180 --mode ssh"
	bash scripts/test-cluster.sh --run sh -c 'exec python bench/soak.py $$SOAK_ARGS'

.PHONY: drill-objectstore
drill-objectstore: ## The object store's long drills (not in CI): 20 uploads killed mid-tag, a resume from the bucket on another world size, the gateway frozen 60 s, the Trainer and plain DeepSpeed examples from the bucket (root).
	DS_DRILLS=objectstore MEMSTORE_BYTES=$$((6 << 30)) pytest tests/drills \
	  tests/e2e/test_byo_programs.py::test_the_trainer_example_resumes_from_the_bucket_in_fresh_pods \
	  tests/e2e/test_byo_programs.py::test_a_plain_deepspeed_program_resumes_from_the_bucket_in_fresh_pods -v -s

.PHONY: drill-faults
drill-faults: ## The fault drill (not all in CI): real faults (tests/drills/test_fault_drill.py CASES), both launch modes, the train package and a Trainer; prints expected vs reported causes (root).
	DS_DRILLS=faults pytest tests/drills/test_fault_drill.py -v -s -p no:cacheprovider

.PHONY: lint
lint: ## helm lint --strict with every ci values file, shellcheck, hadolint, ruff.
	for f in $(CHART)/ci/*-values.yaml; do helm lint --strict $(CHART) -f "$$f" > /dev/null || { helm lint --strict $(CHART) -f "$$f"; exit 1; }; done
	shellcheck -x -P SCRIPTDIR $(CHART)/files/*.sh scripts/*.sh docker/*.sh .ci/run .ci/cuda-image-inputs
	hadolint docker/Dockerfile docker/Dockerfile.hf docker/Dockerfile.sidecar
	ruff check .
