#!/usr/bin/env bash
# The GPU check (issue #25), for a machine with one NVIDIA GPU — the CPU suite cannot reach one:
#   1. build levels 1–3 with the `nccl` feature (and the core's GPU tests);
#   2. CUDA loads, and a single-rank NCCL all-reduce and broadcast match their closed forms
#      (shared/tests/gpu.rs);
#   3. levels 1–3 at W = 1 on CUDA in fp32, bf16 and fp16, $STEPS steps each;
#   4. the PyTorch peers on the same GPU: the tutorial loop (fp32, as the tutorial) and the tuned
#      loop (bench/reference/tuned.py) in fp32, bf16 and fp16;
#   5. one markdown table, $OUT/gpu-check.md: samples/s, GPU memory peak (nvidia-smi, sampled) and
#      the CUDA allocator peak (the peers report it), accuracy, ours / each peer.
# It keeps to DEADLINE_S seconds (default 480: 8 minutes including the build): a step that would
# run past it is cut short and its row says so.
# Exit status: 0 all passed; 1 a check or run failed (its row says so); 2 refused: without an
# NVIDIA GPU it refuses at once, before building anything, with one line saying why.
#
# Usage: bash scripts/gpu-check.sh
# Environment: STEPS (300), DEADLINE_S (480), GPU_CHECK_OUT (target/gpu-check),
#              NVIDIA_SMI (the nvidia-smi to ask; default: nvidia-smi on PATH).
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
DEADLINE_S=${DEADLINE_S:-480}
OUT=${GPU_CHECK_OUT:-target/gpu-check}
start=$SECONDS
left() { echo $((DEADLINE_S - (SECONDS - start))); }
mkdir -p "$OUT"
rm -f "$OUT"/*.json "$OUT"/*.mem "$OUT/nccl.ok"
echo "gpu-check: $(printf '%s\n' "$gpus" | head -n 1); $STEPS steps per run; deadline ${DEADLINE_S}s; results in $OUT"

bash scripts/bootstrap.sh
export PATH="$HOME/.cargo/bin:$PATH" CARGO_PROFILE_RELEASE_DEBUG=false
PY=.venv/bin/python
timeout "$(left)" cargo build --release -p level1-raw-ddp -p level2-accelerator -p level3-trainer --features ladder-core/nccl --bins
# A failure here is reported in the table; the runs below still go.
if timeout "$(left)" cargo test --release -p ladder-core --features nccl --test gpu -- --ignored --nocapture --test-threads 1 \
  >"$OUT/nccl.log" 2>&1; then
  touch "$OUT/nccl.ok"
  echo "gpu-check: CUDA and single-rank NCCL all-reduce / broadcast: passed ($((SECONDS - start))s)"
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

bins=(level1-raw-ddp level2-accelerator level3-trainer)
for level in 1 2 3; do
  for p in fp32 bf16 fp16; do
    mp=$p
    [ "$p" = fp32 ] && mp=no
    run "l$level-$p" "target/release/${bins[$((level - 1))]}" --device cuda --mixed-precision "$mp" \
      --max-steps "$STEPS" --log-interval 0 --metrics-json "$OUT/l$level-$p.json"
  done
done
run peer-tutorial-fp32 sh -c "$PY bench/reference/tutorial.py --device cuda --max-steps $STEPS | tail -n 1 >$OUT/peer-tutorial-fp32.json"
for p in fp32 bf16 fp16; do
  run "peer-tuned-$p" sh -c "$PY bench/reference/tuned.py --device cuda --precision $p --max-steps $STEPS | tail -n 1 >$OUT/peer-tuned-$p.json"
done

# The table: one row per run; ours over the tutorial peer (fp32) and over the tuned peer at the
# same precision.
"$PY" - "$OUT" "$(printf '%s\n' "$gpus" | head -n 1)" "$STEPS" <<'EOF'
import json, pathlib, sys
out, gpu, steps = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
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
tutorial = read("peer-tutorial-fp32")
nccl = "passed" if (out / "nccl.ok").exists() else "FAILED (see nccl.log)"
rows = [f"# GPU check\n\n{gpu} · {steps} steps per run at W = 1\n",
        f"CUDA, and a single-rank NCCL all-reduce and broadcast against closed forms (shared/tests/gpu.rs): {nccl}.\n",
        "| run | precision | samples/s | GPU memory peak MiB (nvidia-smi) | CUDA allocator peak MiB | accuracy | ours / tutorial peer | ours / tuned peer |",
        "|---|---|---:|---:|---:|---:|---:|---:|"]
names = [(f"l{l}-{p}", f"level {l}", p) for l in (1, 2, 3) for p in ("fp32", "bf16", "fp16")]
names += [("peer-tutorial-fp32", "PyTorch tutorial", "fp32")] + [(f"peer-tuned-{p}", "PyTorch tuned", p) for p in ("fp32", "bf16", "fp16")]
for name, what, p in names:
    r, m = read(name), mem(name)
    if r is None:
        log = (out / f"{name}.log")
        tail = log.read_text().strip().splitlines()[-1:] if log.exists() else ["not run"]
        rows.append(f"| {what} | {p} | FAILED: {tail[0][:80] if tail else ''} | | | | | |")
        continue
    sps = r.get("samples_per_s", 0.0)
    tuned = read(f"peer-tuned-{p}")
    ratio = lambda peer: f"{sps / peer['samples_per_s']:.2f}×" if peer and peer.get("samples_per_s") and name.startswith("l") else "—"
    alloc = r.get("cuda_peak_mib")
    mib = lambda v: f"{v:.0f}" if v else "—"
    rows.append(f"| {what} | {p} | {sps:.0f} | {mib(m)} | {mib(alloc)} | {100 * r.get('accuracy', 0):.2f}% | "
                f"{ratio(tutorial)} | {ratio(tuned)} |")
rows.append("\nGPU memory peak: the most nvidia-smi showed the process holding (CUDA context included), sampled every 0.2 s; "
            "CUDA allocator peak: torch.cuda.max_memory_allocated (the peers only). The tuned peer's row also says "
            "what its start-up trial chose in its JSON (`tuned`).")
(out / "gpu-check.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
EOF
echo "gpu-check: done in $((SECONDS - start))s; table: $OUT/gpu-check.md"
if grep -q FAILED "$OUT/gpu-check.md"; then
  echo "gpu-check: some checks or runs FAILED (their logs are in $OUT)" >&2
  exit 1
fi
