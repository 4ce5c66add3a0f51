# ddp-ladder — every target sets the machine up first (idempotent; < 5 s when nothing is missing).
SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)
# Multi-rank runs oversubscribe 2 cores; mpirun refuses root without these (CI runs as root).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
CARGO ?= cargo
RELEASE := target/release

.PHONY: demo test bench setup build

setup:
	@bash scripts/bootstrap.sh

build: setup
	$(CARGO) build --release --workspace --bins

## make demo: train BasicNet for one epoch single-process, then level 1 (raw DDP) at 2 ranks.
demo: build
	@echo "== baseline: one process, all cores =="
	$(RELEASE)/ladder-baseline --device cpu
	@echo
	@echo "== level 1: raw DDP, 2 ranks (ladder-run --nproc-per-node 2) =="
	$(RELEASE)/ladder-run --nproc-per-node 2 $(RELEASE)/level1-raw-ddp --device cpu

## make test: the whole suite (unit, integration, multi-process under mpirun, snapshots).
test: setup
	$(CARGO) test --release --workspace --no-fail-fast
	$(CARGO) check --release -p ladder-core --features nccl --all-targets

## make bench: ddp-ladder next to PyTorch, measured in the same run (writes bench/results/).
bench: build
	bash bench/run.sh
