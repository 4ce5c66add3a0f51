#!/usr/bin/env bash
# The CUDA / NCCL checks, for a machine with NVIDIA GPUs (the CPU suite cannot reach them):
#   1. libtorch's CUDA backend loads and tch::Cuda::is_available() turns true;
#   2. the nccl backend's collectives at world size 1 (a real NCCL communicator) on cuda;
#   3. training steps of level 1 on cuda, then 2 ranks over NCCL if there are 2 GPUs.
# Usage: bash scripts/gpu-check.sh        (prints PASS/FAIL per check; exits non-zero on failure)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release -p ladder-core -p level1-raw-ddp --features ladder-core/nccl --bins
cargo test --release -p ladder-core --features nccl --test gpu -- --ignored --nocapture --test-threads 1
target/release/level1-raw-ddp --device cuda --max-steps 50 --log-interval 10 --metrics-json target/gpu-level1.json
ngpu=$(.venv/bin/python -c 'import torch; print(torch.cuda.device_count())')
if [ "$ngpu" -ge 2 ]; then
  target/release/ladder-run --nproc-per-node 2 --backend nccl target/release/level1-raw-ddp \
    --device cuda --max-steps 50 --check-sync --log-interval 10
fi
echo "gpu-check: all checks passed ($ngpu GPU(s))"
