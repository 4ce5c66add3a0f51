#!/usr/bin/env bash
# Two hosts against one: level 1 for STEPS steps at 2 ranks, on two namespace hosts of one core
# each (scripts/cluster.sh, Open MPI over TCP) and on this machine alone (2 ranks, shared
# memory), REPEATS times each, interleaved; then the all-reduce bus bandwidth both ways
# (examples/allreduce_bench). Writes the table to book/src/generated/cluster.md (or $1).
# Needs root and the release binaries (make build). Run it on an idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-book/src/generated/cluster.md}
STEPS=${STEPS:-300}
REPEATS=${REPEATS:-2}
BIN=target/release
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for b in ladder-run level1-raw-ddp examples/allreduce_bench; do
    [[ -x $BIN/$b ]] || { echo "cluster-bench: $BIN/$b is not built; run: make build" >&2; exit 1; }
done
[[ $(nproc) -ge 2 ]] || { echo "cluster-bench: needs 2 cores (one per host), this machine has $(nproc)" >&2; exit 1; }
WORK=$(mktemp -d)
CL=(bash scripts/cluster.sh --name bench)
trap '"${CL[@]}" down >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
"${CL[@]}" up 2 --cpus-per-node 1 >/dev/null
HF=$("${CL[@]}" hostfile)
L1=("$BIN/level1-raw-ddp" --device cpu --max-steps "$STEPS" --log-interval 0)
loads=()
for ((r = 1; r <= REPEATS; r++)); do
    echo "repeat $r/$REPEATS: two hosts"
    "${CL[@]}" exec 0 "$BIN/ladder-run" --nnodes 2 --nproc-per-node 1 --hostfile "$HF" \
        "${L1[@]}" --metrics-json "$WORK/two-$r.json" >"$WORK/two-$r.log" 2>&1 ||
        { cat "$WORK/two-$r.log" >&2; exit 1; }
    echo "repeat $r/$REPEATS: one host"
    taskset -c 0,1 "$BIN/ladder-run" --nproc-per-node 2 \
        "${L1[@]}" --metrics-json "$WORK/one-$r.json" >"$WORK/one-$r.log" 2>&1 ||
        { cat "$WORK/one-$r.log" >&2; exit 1; }
    loads+=("$(cut -d' ' -f1 /proc/loadavg)")
done
echo "all-reduce: two hosts, then one"
"${CL[@]}" exec 0 "$BIN/ladder-run" --nnodes 2 --nproc-per-node 1 --hostfile "$HF" \
    "$BIN/examples/allreduce_bench" --json "$WORK/ar-two.json" >"$WORK/ar-two.log" 2>&1
taskset -c 0,1 "$BIN/ladder-run" --nproc-per-node 2 \
    "$BIN/examples/allreduce_bench" --json "$WORK/ar-one.json" >"$WORK/ar-one.log" 2>&1
python3 - "$WORK" "$OUT" "$STEPS" "$REPEATS" "${loads[*]}" <<'EOF'
import json, statistics, sys, platform, datetime, os
work, out, steps, repeats, loads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
sps = lambda kind: [json.load(open(f"{work}/{kind}-{r}.json"))["samples_per_s"] for r in range(1, repeats + 1)]
two, one = sps("two"), sps("one")
ratios = [t / o for t, o in zip(two, one)]
acc = lambda kind: json.load(open(f"{work}/{kind}-1.json"))["accuracy"]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
ar = {k: {row["bytes"]: row for row in json.load(open(f"{work}/ar-{k}.json"))["rows"]} for k in ("two", "one")}
def size(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
lines = [
    f"Level 1, DDP, {steps} steps at 2 ranks × batch 64, median of {repeats} interleaved repeats; "
    f"{cpu}, {os.cpu_count()} cores, {datetime.date.today()} (`scripts/cluster-bench.sh`; load average "
    f"after each repeat: {loads}).",
    "",
    "| run | how the ranks talk | samples/s (each repeat) | accuracy |",
    "|---|---|---:|---:|",
    f"| 2 hosts × 1 rank, 1 core each | Open MPI TCP over veth | {statistics.median(two):,.0f} ({', '.join(f'{v:,.0f}' for v in two)}) | {acc('two'):.2%} |",
    f"| 1 host × 2 ranks, 2 cores | Open MPI shared memory | {statistics.median(one):,.0f} ({', '.join(f'{v:,.0f}' for v in one)}) | {acc('one'):.2%} |",
    "",
    f"In this run two hosts reached {statistics.median(ratios):.2f}× the samples/s of one (per repeat: "
    f"{', '.join(f'{r:.2f}' for r in ratios)}; a ratio of this run only, at its load and build). All-reduce (f32, Sum, `ProcessGroup::all_reduce`) at 2 ranks, "
    "busbw = algbw × 2(n−1)/n:",
    "",
    "| bytes | " + " | ".join(size(b) for b in sorted(ar["two"])) + " |",
    "|---|" + "---:|" * len(ar["two"]),
    "| 2 hosts, TCP: busbw GB/s | " + " | ".join(f"{ar['two'][b]['ours_busbw_gbps']:.2f}" for b in sorted(ar["two"])) + " |",
    "| 1 host, shared memory: busbw GB/s | " + " | ".join(f"{ar['one'][b]['ours_busbw_gbps']:.2f}" for b in sorted(ar["two"])) + " |",
    "| TCP / shared memory | " + " | ".join(f"{ar['two'][b]['ours_busbw_gbps'] / ar['one'][b]['ours_busbw_gbps']:.2f}" for b in sorted(ar["two"])) + " |",
]
open(out, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
