#!/usr/bin/env bash
# ddp-ladder next to PyTorch, measured in the same run on the same machine.
#
#   make bench                      # one full epoch each (≈ 6 min on 2 cores)
#   BENCH_STEPS=300 make bench      # shorter: 300 optimizer steps each
#
# Pairs (ours / PyTorch's, same model, recipe, batch per rank, threads per rank):
#   1. single process:      ladder-baseline          / bench/reference/tutorial.py
#   2. DDP at 2 ranks:      level1-raw-ddp (mpi)     / bench/reference/ddp_gloo.py under torchrun
#   3. all-reduce busbw:    ProcessGroup::all_reduce / a raw rsmpi all_reduce on a Vec<f32>
# Each JSON result lands in bench/results/; a table with the ratios is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results
mkdir -p "$out"
py=.venv/bin/python
rel=target/release
steps=()
[ -n "${BENCH_STEPS:-}" ] && steps=(--max-steps "$BENCH_STEPS")
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

echo "== 1. single process: ladder-baseline vs PyTorch tutorial loop"
$rel/ladder-baseline --device cpu --log-interval 0 "${steps[@]}" --metrics-json $out/baseline.json | tail -n 2
$py bench/reference/tutorial.py "${steps[@]}" | tail -n 1 | tee $out/pytorch-tutorial.json

echo "== 2. DDP, 2 ranks: level1-raw-ddp (mpi) vs PyTorch DDP over gloo (torchrun)"
$rel/ladder-run --nproc-per-node 2 $rel/level1-raw-ddp --device cpu --log-interval 0 "${steps[@]}" \
  --metrics-json $out/level1-ddp-2.json | tail -n 2
.venv/bin/torchrun --nproc-per-node 2 bench/reference/ddp_gloo.py "${steps[@]}" 2>/dev/null | tail -n 1 | tee $out/pytorch-ddp-gloo-2.json

echo "== 3. all_reduce bus bandwidth, 2 ranks"
mpirun -n 2 --bind-to none $rel/examples/allreduce_bench --json $out/allreduce-2.json

$py bench/report.py "$out"
