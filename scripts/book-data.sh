#!/usr/bin/env bash
# make book-data: the measured tables and plots of the book, from one reference run on this
# machine. Runs `bench demo` (the three levels, one epoch each at 2 ranks) and a small `bench run`
# matrix, then copies their markdown output into book/src/generated/ with a provenance
# note (machine, commit, date, commands). Over an hour on a 2-core machine (the fit sweep alone
# 43 minutes on an AMD EPYC Zen 5); run it when the
# machine is otherwise idle, since the figures are throughput measurements.
#
# Then the "Will it fit?" sweep: a second `bench run` over strategy × fc1 width × batch size at
# 2 ranks (memory, estimate and samples/s), copied to book/src/generated/fit.md with its own
# provenance (fit-provenance.md).
#
# Environment: RELEASE (target/release), BOOK_BENCH_ARGS (the `bench run` matrix),
# BOOK_DEMO_ARGS (extra `bench demo` flags), BOOK_REUSE_DEMO=1 (keep the last demo),
# BOOK_FIT_ARGS (the sweep), BOOK_DATA_ONLY=fit (run the sweep alone; the demo and matrix
# tables and their provenance stay as they are).
set -euo pipefail
cd "$(dirname "$0")/.."
RELEASE="${RELEASE:-target/release}"
BOOK_BENCH_ARGS="${BOOK_BENCH_ARGS:---levels 1,2,3 --strategies single,ddp,fsdp-full-shard,fsdp-shard-grad-op --world-sizes 2 --widths 128,4096 --precisions fp32,bf16 --steps 200 --wide-steps 20 --repeats 1 --install-peers}"
BOOK_DEMO_ARGS="${BOOK_DEMO_ARGS:-}"
# BOOK_REUSE_DEMO=1 keeps the demo of the previous run (target/book-data/demo) and reruns only the
# bench matrix.
BOOK_REUSE_DEMO="${BOOK_REUSE_DEMO:-0}"
BOOK_FIT_ARGS="${BOOK_FIT_ARGS:---levels 1 --strategies ddp,zero1,fsdp-shard-grad-op,fsdp-full-shard --world-sizes 2 --widths 128,4096,8192 --precisions fp32 --batch-sizes 64,512 --steps 300 --wide-steps 20 --repeats 3 --wide-repeats 3 --no-peers --no-allreduce}"
BOOK_DATA_ONLY="${BOOK_DATA_ONLY:-}"
OUT=book/src/generated
# The commit, read before this run rewrites its own outputs (which would look like local changes).
commit_line="\`$(git rev-parse --short HEAD 2>/dev/null || echo unknown)\`$(git diff --quiet HEAD -- 2>/dev/null || echo ' (with uncommitted changes)')"
WORK=target/book-data
mkdir -p "$OUT" "$WORK"

provenance() { # provenance ROWS...: the machine and commit, then one `| name | command |` row each
    echo "<!-- written by scripts/book-data.sh (make book-data); do not edit -->"
    echo
    echo "| | |"
    echo "|---|---|"
    echo "| date (UTC) | $(date -u +%Y-%m-%dT%H:%M:%SZ) |"
    echo "| commit | $commit_line |"
    echo "| CPU | $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//' || echo unknown) |"
    echo "| cores | $(nproc) |"
    echo "| memory | $(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo 2>/dev/null) |"
    echo "| kernel | $(uname -sr) |"
    echo "| rustc | $(rustc --version 2>/dev/null || echo unknown) |"
    for row in "$@"; do echo "$row"; done
}

# The one-minute load average decays for a minute after a run ends: before each measurement, wait
# (at most 2 minutes) until the previous one's ranks no longer count, so that the bench's
# start-of-run load check sees this machine, not the run before.
wait_for_idle() {
    local waited=0
    while awk -v c="$(nproc)" '{ exit !($1 >= c / 2) }' /proc/loadavg && (( waited < 120 )); do
        sleep 5
        waited=$((waited + 5))
    done
    echo "book-data: load average $(cut -d' ' -f1 /proc/loadavg) after waiting ${waited} s"
}

# The "Will it fit?" sweep: memory per strategy × width × batch, its own provenance.
fit_status=0
if [[ "$BOOK_DATA_ONLY" == "" || "$BOOK_DATA_ONLY" == fit ]]; then
    rm -rf "$WORK/fit"
    fit_cmd="$RELEASE/bench run $BOOK_FIT_ARGS --out-dir $WORK/fit"
    wait_for_idle
    echo "book-data: $fit_cmd"
    $fit_cmd || fit_status=$?
    if [[ -f "$WORK/fit/bench.md" ]]; then
        cp "$WORK/fit/bench.md" "$OUT/fit.md"
        provenance "| fit | \`$fit_cmd\` (exit $fit_status) |" > "$OUT/fit-provenance.md"
        echo "book-data: wrote $OUT/fit.md and $OUT/fit-provenance.md"
    else
        echo "book-data: $WORK/fit/bench.md was not written" >&2
        fit_status=1
    fi
fi
if [[ "$BOOK_DATA_ONLY" == fit ]]; then
    "$RELEASE/book-check" generate
    exit "$fit_status"
fi
rm -rf "$WORK/bench"

demo_cmd="$RELEASE/bench demo --out-dir $WORK/demo $BOOK_DEMO_ARGS"
bench_cmd="$RELEASE/bench run $BOOK_BENCH_ARGS --out-dir $WORK/bench"
# A failed level is a FAILED row in the table (and a non-zero exit): keep the table, say so.
demo_status=0
if [[ "$BOOK_REUSE_DEMO" == 1 && -f "$WORK/demo/demo.md" && -f "$WORK/demo/command" ]]; then
    demo_cmd="$(cat "$WORK/demo/command")"
    demo_status="$(cat "$WORK/demo/status" 2>/dev/null || echo unknown)"
    echo "book-data: reusing the demo of $(date -u -r "$WORK/demo/demo.md" +%Y-%m-%dT%H:%M:%SZ): $demo_cmd"
else
    rm -rf "$WORK/demo"
    wait_for_idle
    echo "book-data: $demo_cmd"
    $demo_cmd || demo_status=$?
    echo "$demo_cmd" > "$WORK/demo/command"
    echo "$demo_status" > "$WORK/demo/status"
fi
wait_for_idle
echo "book-data: $bench_cmd"
bench_status=0
$bench_cmd || bench_status=$?

copy() { # copy SRC DEST: a file the bench was expected to write
    if [[ -f "$1" ]]; then cp "$1" "$2"; else echo "book-data: $1 was not written" >&2; return 1; fi
}
copy "$WORK/demo/demo.md" "$OUT/demo.md"
copy "$WORK/bench/bench.md" "$OUT/bench.md"

provenance "| demo | \`$demo_cmd\` (exit $demo_status) |" "| bench | \`$bench_cmd\` (exit $bench_status) |" > "$OUT/provenance.md"
echo "book-data: wrote $OUT/demo.md, $OUT/bench.md and $OUT/provenance.md"

# Every table, plot and the README's `make demo` block are generated from this run by
# book-check (small tables per question, full tables, plots; each with the run's provenance line).
"$RELEASE/book-check" generate
if [[ "$demo_status" != 0 || "$bench_status" != 0 || "$fit_status" != 0 ]]; then
    echo "book-data: a run failed (demo exit $demo_status, bench exit $bench_status, fit exit $fit_status); its rows say FAILED" >&2
    exit 1
fi
