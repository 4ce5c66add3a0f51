# ddp-ladder — every target sets the machine up first (idempotent; < 5 s when nothing is missing).
SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)
# Multi-rank runs oversubscribe 2 cores; mpirun refuses root without these (CI runs as root).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
CARGO ?= cargo
RELEASE := target/release

.PHONY: help demo test bench setup build book book-data cluster-up cluster-down slurm-up slurm-down

## make help: this list (also what `make` alone prints).
help:
	@echo "ddp-ladder: make TARGET  (targets that build or run start with scripts/bootstrap.sh)"
	@echo
	@awk '/^## make [a-z-]+:/ { sub(/^## make /, ""); split($$0, a, ":"); name = a[1]; \
	        text = substr($$0, length(name) + 3); printf "  %-12s %s\n", name, text; next } \
	      /^## / && name != "" { sub(/^## /, ""); printf "  %-12s %s\n", "", $$0; next } \
	      { name = "" }' $(MAKEFILE_LIST)

## make setup: install what is missing (Open MPI, libclang, the torch venv); < 5 s when all is there.
setup:
	@bash scripts/bootstrap.sh

## make build: build every binary and example in release mode (target/release/).
build: setup
	$(CARGO) build --release --workspace --bins --examples

## make demo: the three levels side by side — each one epoch at 2 ranks (MPI, DDP), then one table
## (also target/demo/demo.md and demo.json). `make demo LEVELS=1,3` picks levels.
LEVELS ?= 1,2,3
demo: build
	$(RELEASE)/bench demo --levels $(LEVELS)

## make test: style first (rustfmt, clippy with warnings as errors — missing docs included), then
## the whole suite (unit, integration, multi-process under mpirun, snapshots) and the book's checks.
test: setup
	$(CARGO) fmt --all --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings
	$(CARGO) test --release --workspace --no-fail-fast
	$(CARGO) check --release -p ladder-core --features nccl --all-targets
	bash scripts/ensure-mdbook.sh
	$(CARGO) run --release -q -p book-check -- check
	mdbook build book
	$(CARGO) run --release -q -p book-check -- rendered

## make bench: every level × strategy × world size × width × precision next to PyTorch, measured in
## the same run, and the all-reduce bandwidth (writes bench/results/bench.md, bench.json, runs/, logs/).
## `make bench BENCH_ARGS="--levels 1 --world-sizes 2 --repeats 1"` narrows it (see `bench run --help`).
BENCH_ARGS ?=
bench: build
	$(RELEASE)/bench run $(BENCH_ARGS)

## make book: the mdBook in book/book/ (open book/book/index.html, or `mdbook serve book`).
## Installs mdbook once (scripts/ensure-mdbook.sh), regenerates every generated file (listings,
## diffs, arithmetic, snapshots, the tables and plots of the last book-data run), checks every
## {{#include}}, anchor, link and named test, builds, then checks the rendered pages.
book: setup
	@bash scripts/ensure-mdbook.sh
	$(CARGO) build --release -p book-check
	$(RELEASE)/book-check generate
	$(RELEASE)/book-check check
	mdbook build book
	$(RELEASE)/book-check rendered

## make book-data: the book's measured tables and plots (book/src/generated/demo.md, bench.md,
## provenance.md, fit.md, then book-check generate) from `bench demo`, a small `bench run` matrix
## and the "Will it fit?" sweep. Over an hour (the sweep alone 43 min on a 2-core AMD EPYC Zen 5);
## run it on an idle machine. BOOK_BENCH_ARGS
## overrides the matrix, BOOK_FIT_ARGS the sweep; BOOK_DATA_ONLY=fit runs the sweep alone.
book-data: build
	bash scripts/book-data.sh

## make cluster-up: two namespace hosts on this machine (root), to try multi-node runs; see
## scripts/cluster.sh and the book's "Scaling out". CLUSTER_NODES=N for more hosts.
CLUSTER_NODES ?= 2
cluster-up:
	bash scripts/cluster.sh up $(CLUSTER_NODES)

## make cluster-down: remove the namespace hosts, their network and any process left on them.
cluster-down:
	bash scripts/cluster.sh down

## make slurm-up: a real Slurm on the namespace hosts (munged, slurmctld on host 0, one slurmd per
## host; root): then `scripts/slurm.sh exec 0 srun ...` or `... sbatch ...`. See scripts/slurm.sh.
slurm-up: setup
	bash scripts/slurm.sh up $(CLUSTER_NODES)

## make slurm-down: stop Slurm and remove the namespace hosts (also after a failure).
slurm-down:
	bash scripts/slurm.sh down
