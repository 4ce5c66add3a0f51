#!/usr/bin/env bash
# ddp-ladder next to PyTorch, measured in the same run on the same machine.
#
#   make bench                                   # ≈ 10 min on 2 cores
#   BENCH_STEPS=938 BENCH_REPEATS=1 make bench   # one full epoch per run instead
#
# Pairs 1 and 2 run BENCH_REPEATS times (default 3), ours and PyTorch's alternating, each for
# BENCH_STEPS optimizer steps (default 300); the report gives the median of the per-repeat ratios,
# which is steadier than one long run on a machine whose speed drifts.
#
# Pairs (ours / PyTorch's, same model, recipe, batch per rank, threads per rank):
#   1. single process:      ladder-baseline          / bench/reference/tutorial.py
#   2. DDP at 2 ranks:      level1-raw-ddp (mpi)     / bench/reference/ddp_gloo.py under torchrun
#   3. all-reduce busbw:    ProcessGroup::all_reduce / a raw rsmpi all_reduce on a Vec<f32>
# and, ours only:
#   4. strategies at 2 ranks: ddp, fsdp-full-shard, fsdp-shard-grad-op, fsdp-no-shard
#      (STRATEGY_STEPS optimizer steps each, default 300)
#   5. memory at 2 ranks with BasicNet width 4096 (~38M parameters): ddp vs fsdp-full-shard
#      (per-layer FlatParameters), 20 steps: peak RSS and model-state bytes per rank
# Each JSON result lands in bench/results/; a table with the ratios is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results
mkdir -p "$out"
py=.venv/bin/python
rel=target/release
steps=(--max-steps "${BENCH_STEPS:-300}")
reps=${BENCH_REPEATS:-3}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

rm -f $out/*.json $out/torchrun.log
for i in $(seq 1 "$reps"); do
  echo "== 1. single process ($i/$reps): ladder-baseline vs PyTorch tutorial loop"
  $rel/ladder-baseline --device cpu --log-interval 0 "${steps[@]}" --metrics-json $out/baseline-$i.json | tail -n 1
  $py bench/reference/tutorial.py "${steps[@]}" | tail -n 1 | tee $out/pytorch-tutorial-$i.json

  echo "== 2. DDP, 2 ranks ($i/$reps): level1-raw-ddp (mpi) vs PyTorch DDP over gloo (torchrun)"
  $rel/ladder-run --nproc-per-node 2 $rel/level1-raw-ddp --device cpu --log-interval 0 "${steps[@]}" \
    --metrics-json $out/level1-ddp-2-$i.json | tail -n 1
  .venv/bin/torchrun --standalone --nproc-per-node 2 bench/reference/ddp_gloo.py "${steps[@]}" 2>>$out/torchrun.log | tail -n 1 \
    | tee $out/pytorch-ddp-gloo-2-$i.json
done

echo "== 3. all_reduce bus bandwidth, 2 ranks"
mpirun -n 2 --bind-to none $rel/examples/allreduce_bench --json $out/allreduce-2.json

echo "== 4. strategies, 2 ranks"
for s in ddp fsdp-full-shard fsdp-shard-grad-op fsdp-no-shard; do
  $rel/ladder-run --nproc-per-node 2 $rel/level1-raw-ddp --device cpu --log-interval 0 --strategy $s \
    --fsdp-min-num-params 0 --max-steps "${STRATEGY_STEPS:-300}" --metrics-json $out/strategy-$s-2.json | tail -n 1
done

echo "== 5. memory, 2 ranks, width 4096"
for s in ddp fsdp-full-shard; do
  $rel/ladder-run --nproc-per-node 2 $rel/level1-raw-ddp --device cpu --log-interval 0 --strategy $s \
    --fsdp-min-num-params 0 --width 4096 --max-steps 20 --metrics-json $out/memory-$s-w4096-2.json | tail -n 1
done

$py bench/report.py "$out"
