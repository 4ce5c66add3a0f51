#!/usr/bin/env bash
# The GPU check (issues #25 and #23), for a machine with one NVIDIA GPU — the CPU suite cannot
# reach one:
#   1. build levels 1–3 with the `nccl` feature (and the core's GPU tests), or take them prebuilt
#      (GPU_CHECK_PREBUILT, below);
#   2. CUDA loads, a single-rank NCCL all-reduce and broadcast match their closed forms, and the
#      CUDA allocator's statistics count a tensor exactly (shared/tests/gpu.rs);
#   3. levels 1–3 at W = 1 on CUDA, $STEPS steps each, in every precision the level offers
#      (level 1 and level 3: fp32 and bf16, as PyTorch's FSDP MixedPrecision and the Trainer's
#      --bf16 here; level 2 also fp16 with dynamic loss scaling);
#   4. "will it fit" on the GPU (issue #23): at width $FIT_WIDTH, batch $FIT_BATCH, fp32,
#      $FIT_STEPS steps without evaluation: level 1 under DDP with and without activation
#      checkpointing, FULL_SHARD with and without CPU offload, and levels 1–3 with CPU offload and
#      checkpointing together; each row's CUDA allocator peak beside
#      `ladder-accelerate estimate-memory --device cuda`'s;
#   5. the PyTorch peers on the same GPU: the tutorial loop (fp32, as the tutorial) and the tuned
#      loop (bench/reference/tuned.py) in fp32, bf16 and fp16;
#   6. two markdown tables, $OUT/gpu-check.md: samples/s, GPU memory peak (nvidia-smi, sampled)
#      and the CUDA allocator peak (torch.cuda.max_memory_allocated over the training steps, ours
#      and the peers'), accuracy, ours / each peer.
# It keeps to DEADLINE_S seconds (default 480: 8 minutes including the build): a step that would
# run past it is cut short and its row says so.
# Exit status: 0 all passed; 1 a check or run failed (its row says so); 2 refused: without an
# NVIDIA GPU it refuses at once, before building anything, with one line saying why.
#
# Usage: bash scripts/gpu-check.sh
# Environment: STEPS (300), FIT_STEPS (60), FIT_WIDTH (4096), FIT_BATCH (512), DEADLINE_S (480),
#   GPU_CHECK_OUT (target/gpu-check), NVIDIA_SMI (the nvidia-smi to ask; default: on PATH),
#   GPU_CHECK_PREBUILT=DIR: a GPU machine without cargo or a network — DIR holds level1-raw-ddp,
#     level2-accelerator, level3-trainer, ladder-accelerate and gpu-tests (shared/tests/gpu.rs's
#     test binary), built with `--features ladder-core/nccl` against the libtorch of the torch
#     that GPU_CHECK_PYTHON imports (scripts/gpu-prebuild.sh makes DIR), and lib/ with shared
#     libraries that machine lacks (Open MPI's); nothing is bootstrapped or built;
#   GPU_CHECK_PYTHON: the python with torch and torchvision for the peers (default: .venv/bin/python,
#     or python3 with GPU_CHECK_PREBUILT).
set -euo pipefail
cd "$(dirname "$0")/.."

refuse() {
  echo "gpu-check: refused: ${1%.}. This check needs a machine with an NVIDIA GPU; nothing was built or run." >&2
  exit 2
}
smi=${NVIDIA_SMI:-nvidia-smi}
command -v "$smi" >/dev/null 2>&1 || refuse "no NVIDIA GPU on this machine ($smi not found)"
gpus=$("$smi" -L 2>&1) || refuse "$smi failed: $(printf '%s\n' "$gpus" | head -n 1)"
printf '%s\n' "$gpus" | grep -q '^GPU ' || refuse "$smi lists no GPU"

STEPS=${STEPS:-300}
FIT_STEPS=${FIT_STEPS:-60}
FIT_WIDTH=${FIT_WIDTH:-4096}
FIT_BATCH=${FIT_BATCH:-512}
DEADLINE_S=${DEADLINE_S:-480}
OUT=${GPU_CHECK_OUT:-target/gpu-check}
PREBUILT=${GPU_CHECK_PREBUILT:-}
start=$SECONDS
left() { echo $((DEADLINE_S - (SECONDS - start))); }
mkdir -p "$OUT"
rm -f "$OUT"/*.json "$OUT"/*.mem "$OUT/nccl.ok"
echo "gpu-check: $(printf '%s\n' "$gpus" | head -n 1); $STEPS steps per run; deadline ${DEADLINE_S}s; results in $OUT"

if [ -n "$PREBUILT" ]; then
  BIN=$(cd "$PREBUILT" 2>/dev/null && pwd) || { echo "gpu-check: GPU_CHECK_PREBUILT=$PREBUILT: no such directory" >&2; exit 1; }
  PY=${GPU_CHECK_PYTHON:-python3}
  for b in level1-raw-ddp level2-accelerator level3-trainer ladder-accelerate gpu-tests; do
    [ -x "$BIN/$b" ] || { echo "gpu-check: GPU_CHECK_PREBUILT=$BIN has no executable $b (scripts/gpu-prebuild.sh makes it)" >&2; exit 1; }
  done
  # The torch that $PY imports provides libtorch (the binaries were built against its version)
  # and, beside it, the CUDA libraries and NCCL of its wheel.
  torchlib=$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
  nvlibs=$( (ls -d "$torchlib"/../../nvidia/*/lib 2>/dev/null || true) | tr '\n' ':')
  LD_LIBRARY_PATH="$BIN/lib:$torchlib:$nvlibs${LD_LIBRARY_PATH:-}"
  export LD_LIBRARY_PATH=${LD_LIBRARY_PATH%:}
  echo "gpu-check: prebuilt binaries from $BIN; libtorch $("$PY" -c 'import torch; print(torch.__version__)') from $torchlib"
  gpu_tests() { "$BIN/gpu-tests" --ignored --nocapture --test-threads 1; }
else
  bash scripts/bootstrap.sh
  export PATH="$HOME/.cargo/bin:$PATH" CARGO_PROFILE_RELEASE_DEBUG=false
  BIN=target/release
  PY=${GPU_CHECK_PYTHON:-.venv/bin/python}
  timeout "$(left)" cargo build --release -p level1-raw-ddp -p level2-accelerator -p level3-trainer --features ladder-core/nccl --bins
  gpu_tests() { cargo test --release -p ladder-core --features nccl --test gpu -- --ignored --nocapture --test-threads 1; }
fi
# A failure here is reported in the table; the runs below still go.
if timeout "$(left)" bash -c "$(declare -f gpu_tests); BIN='$BIN'; gpu_tests" >"$OUT/nccl.log" 2>&1; then
  touch "$OUT/nccl.ok"
  echo "gpu-check: CUDA, single-rank NCCL all-reduce / broadcast, allocator statistics: passed ($((SECONDS - start))s)"
else
  echo "gpu-check: CUDA / NCCL checks FAILED (log: $OUT/nccl.log)"
fi

# run NAME CMD...: runs CMD with what is left of the deadline, sampling the GPU memory it holds
# (nvidia-smi, every 0.2 s) into $OUT/NAME.mem; its output in $OUT/NAME.log.
run() {
  local name=$1
  shift
  local budget
  budget=$(left)
  if [ "$budget" -le 5 ]; then
    echo "deadline reached before this run" >"$OUT/$name.log"
    return 0
  fi
  timeout "$budget" "$@" >"$OUT/$name.log" 2>&1 &
  local pid=$! peak=0 used
  while kill -0 "$pid" 2>/dev/null; do
    used=$("$smi" --query-compute-apps=used_memory --format=csv,noheader,nounits 2>/dev/null | awk '{s += $1} END {print s + 0}')
    [ "${used:-0}" -gt "$peak" ] && peak=$used
    sleep 0.2
  done
  wait "$pid" || echo "exit status $?" >>"$OUT/$name.log"
  echo "$peak" >"$OUT/$name.mem"
  echo "gpu-check: $name done ($((SECONDS - start))s)"
}

common=(--device cuda --log-interval 0)
run l1-fp32 "$BIN/level1-raw-ddp" "${common[@]}" --max-steps "$STEPS" --metrics-json "$OUT/l1-fp32.json"
run l1-bf16 "$BIN/level1-raw-ddp" "${common[@]}" --max-steps "$STEPS" --mixed-precision bf16 --metrics-json "$OUT/l1-bf16.json"
for p in fp32 bf16 fp16; do
  mp=$p
  [ "$p" = fp32 ] && mp=no
  run "l2-$p" "$BIN/level2-accelerator" "${common[@]}" --max-steps "$STEPS" --mixed-precision "$mp" --metrics-json "$OUT/l2-$p.json"
done
l3=(--output-dir "$OUT/trainer-output" --overwrite-output-dir --save-strategy no)
run l3-fp32 "$BIN/level3-trainer" "${common[@]}" "${l3[@]}" --max-steps "$STEPS" --metrics-json "$OUT/l3-fp32.json"
run l3-bf16 "$BIN/level3-trainer" "${common[@]}" "${l3[@]}" --max-steps "$STEPS" --bf16 --metrics-json "$OUT/l3-bf16.json"

# Will it fit (#23): name | binary and flags | estimate-memory flags. W = 1, fp32, no evaluation.
fit=(--device cuda --log-interval 0 --width "$FIT_WIDTH" --batch-size "$FIT_BATCH" --max-steps "$FIT_STEPS")
est=(--device cuda --num-processes 1 --width "$FIT_WIDTH" --batch-size "$FIT_BATCH" --json)
fitrun() {
  local name=$1 strategy=$2 estflags=$3
  shift 3
  run "$name" "$@" --metrics-json "$OUT/$name.json"
  # shellcheck disable=SC2086
  "$BIN/ladder-accelerate" estimate-memory "${est[@]}" --strategy "$strategy" $estflags >"$OUT/$name.estimate.json" 2>>"$OUT/$name.log" || true
}
fitrun fit-l1-ddp ddp "" "$BIN/level1-raw-ddp" "${fit[@]}" --no-eval
fitrun fit-l1-ddp-ckpt ddp "--activation-checkpointing" "$BIN/level1-raw-ddp" "${fit[@]}" --no-eval --activation-checkpointing
fitrun fit-l1-fsdp fsdp-full-shard "" "$BIN/level1-raw-ddp" "${fit[@]}" --no-eval --strategy fsdp-full-shard
fitrun fit-l1-fsdp-offload fsdp-full-shard "--offload-params" "$BIN/level1-raw-ddp" "${fit[@]}" --no-eval --strategy fsdp-full-shard --cpu-offload
fitrun fit-l1-fsdp-offload-ckpt fsdp-full-shard "--offload-params --activation-checkpointing" \
  "$BIN/level1-raw-ddp" "${fit[@]}" --no-eval --strategy fsdp-full-shard --cpu-offload --activation-checkpointing
fitrun fit-l2-fsdp-offload-ckpt fsdp-full-shard "--offload-params --activation-checkpointing" \
  "$BIN/level2-accelerator" "${fit[@]}" --no-eval --strategy fsdp-full-shard --fsdp-offload-params --fsdp-activation-checkpointing
fitrun fit-l3-fsdp-offload-ckpt fsdp-full-shard "--offload-params --activation-checkpointing" \
  "$BIN/level3-trainer" "${fit[@]}" "${l3[@]}" --eval-strategy no --fsdp "full_shard offload" --gradient-checkpointing

# The PyTorch peers last: the tuned peer's start-up trial compiles (torch.compile), the longest
# part; what the deadline cuts short is said in its row.
run peer-tutorial-fp32 sh -c "$PY bench/reference/tutorial.py --device cuda --max-steps $STEPS | tail -n 1 >$OUT/peer-tutorial-fp32.json"
for p in fp32 bf16 fp16; do
  run "peer-tuned-$p" sh -c "$PY bench/reference/tuned.py --device cuda --precision $p --max-steps $STEPS | tail -n 1 >$OUT/peer-tuned-$p.json"
done

# The tables: one row per run; ours over the tutorial peer (fp32) and over the tuned peer at the
# same precision; then the fit rows with the estimate.
"$PY" - "$OUT" "$(printf '%s\n' "$gpus" | head -n 1)" "$STEPS" "$FIT_STEPS" "$FIT_WIDTH" "$FIT_BATCH" <<'EOF'
import json, pathlib, sys
out, gpu, steps, fit_steps, fit_width, fit_batch = pathlib.Path(sys.argv[1]), *sys.argv[2:]
def read(name):
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None
def mem(name):
    try:
        return float((out / f"{name}.mem").read_text())
    except (OSError, ValueError):
        return None
def failed(name):
    log = out / f"{name}.log"
    tail = log.read_text().strip().splitlines()[-1:] if log.exists() else ["not run"]
    return f"FAILED: {(tail[0] if tail else '')[:80]}"
mib = lambda v: f"{v:.0f}" if v else "—"
tutorial = read("peer-tutorial-fp32")
nccl = "passed" if (out / "nccl.ok").exists() else "FAILED (see nccl.log)"
rows = [f"# GPU check\n\n{gpu} · {steps} steps per run at W = 1\n",
        f"CUDA, a single-rank NCCL all-reduce and broadcast against closed forms, and the CUDA allocator's statistics "
        f"(shared/tests/gpu.rs): {nccl}.\n",
        "| run | precision | samples/s | data/fwd/bwd/opt ms | nvidia-smi MiB | allocator MiB | accuracy | ÷ tutorial | ÷ tuned |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|"]
names = [(f"l{l}-{p}", f"level {l}", p) for l, ps in ((1, ("fp32", "bf16")), (2, ("fp32", "bf16", "fp16")), (3, ("fp32", "bf16"))) for p in ps]
names += [("peer-tutorial-fp32", "PyTorch tutorial", "fp32")] + [(f"peer-tuned-{p}", "PyTorch tuned", p) for p in ("fp32", "bf16", "fp16")]
for name, what, p in names:
    r, m = read(name), mem(name)
    if r is None:
        rows.append(f"| {what} | {p} | {failed(name)} | | | | | | |")
        continue
    sps = r.get("samples_per_s", 0.0)
    tuned = read(f"peer-tuned-{p}")
    ratio = lambda peer: f"{sps / peer['samples_per_s']:.2f}×" if peer and peer.get("samples_per_s") and name.startswith("l") else "—"
    ph = r.get("timing", {}).get("phases", {})
    phases = "/".join(f"{1e3 * ph.get(k, 0.0):.2f}" for k in ("data_s", "forward_s", "backward_s", "optimizer_s")) if ph else "—"
    rows.append(f"| {what} | {p} | {sps:.0f} | {phases} | {mib(m)} | {mib(r.get('cuda_peak_mib'))} | {100 * r.get('accuracy', 0):.2f}% | "
                f"{ratio(tutorial)} | {ratio(tuned)} |")
rows.append("\nnvidia-smi MiB: the most nvidia-smi showed the process holding (CUDA context and the allocator's cache "
            "included), sampled every 0.2 s; allocator MiB: torch.cuda.max_memory_allocated over the training steps "
            "(ours: reset when training starts and after each evaluation, read as each step ends; the peers: over the run). "
            "Data/fwd/bwd/opt ms: the mean timed step's phases (the device synchronized at each phase's end, ours and the peers' alike). "
            "÷ tutorial, ÷ tuned: ours over the tutorial peer's samples/s (fp32) and over the tuned peer's at the same precision. "
            "The tuned peer's JSON also says what its start-up trial chose (`tuned`).\n")
rows += [f"## Will it fit on the GPU\n\nW = 1, fp32, width {fit_width}, batch {fit_batch}, {fit_steps} steps, no evaluation; "
         "L1, L2, L3: the levels; offload: FSDP's CPU offload; checkpointing: activation checkpointing; "
         "the estimate is `ladder-accelerate estimate-memory --device cuda` (parameters, gradients, optimizer state, "
         "activations, transients and MNIST on the device; host bytes under CPU offload apart); at start: what the allocator "
         "held when training started.\n",
         "| run | samples/s | allocator MiB | estimate MiB | measured ÷ estimate | at start MiB | host MiB (estimate) | nvidia-smi MiB |",
         "|---|---:|---:|---:|---:|---:|---:|---:|"]
fits = [("fit-l1-ddp", "L1 DDP"), ("fit-l1-ddp-ckpt", "L1 DDP, checkpointing"),
        ("fit-l1-fsdp", "L1 FULL_SHARD"), ("fit-l1-fsdp-offload", "L1 FULL_SHARD, offload"),
        ("fit-l1-fsdp-offload-ckpt", "L1 FULL_SHARD, offload, checkpointing"),
        ("fit-l2-fsdp-offload-ckpt", "L2 the same (Accelerate's keys)"),
        ("fit-l3-fsdp-offload-ckpt", "L3 the same (Transformers' arguments)")]
for name, what in fits:
    r, m = read(name), mem(name)
    if r is None:
        rows.append(f"| {what} | {failed(name)} | | | | | | |")
        continue
    try:
        e = json.loads((out / f"{name}.estimate.json").read_text())["strategies"][0]["ranks"][0]
        device, host = (e["total"] - e.get("host", 0)) / 2**20, e.get("host", 0) / 2**20
    except (OSError, ValueError, KeyError, IndexError):
        device, host = None, None
    peak = r.get("cuda_peak_mib")
    ratio = f"{peak / device:.2f}" if peak and device else "—"
    at_start = r.get("timing", {}).get("train_cuda_start_mib")
    rows.append(f"| {what} | {r.get('samples_per_s', 0):.0f} | {mib(peak)} | {mib(device)} | {ratio} | {mib(at_start)} | {mib(host)} | {mib(m)} |")
(out / "gpu-check.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
EOF
echo "gpu-check: done in $((SECONDS - start))s; table: $OUT/gpu-check.md"
if grep -q FAILED "$OUT/gpu-check.md"; then
  echo "gpu-check: some checks or runs FAILED (their logs are in $OUT)" >&2
  exit 1
fi
