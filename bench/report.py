"""Prints the bench table from bench/results/*.json: ours next to PyTorch, with ratios."""
import json
import pathlib
import sys

out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results")


def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.exists() else None


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


rows = []
for label, ours, theirs in [
    ("single process", "baseline", "pytorch-tutorial"),
    ("DDP, 2 ranks", "level1-ddp-2", "pytorch-ddp-gloo-2"),
]:
    pairs = []
    i = 1
    while (out / f"{ours}-{i}.json").exists() and (out / f"{theirs}-{i}.json").exists():
        pairs.append((load(f"{ours}-{i}.json"), load(f"{theirs}-{i}.json")))
        i += 1
    if not pairs:
        continue
    a_s = [a["samples_per_s"] for a, _ in pairs]
    b_s = [b["samples_per_s"] for _, b in pairs]
    ratios = [x / y for x, y in zip(a_s, b_s)]
    comm = ""
    if pairs[0][0].get("ranks"):
        comm = f"{100 * median([max(r['comm_s'] / r['train_s'] for r in a['ranks']) for a, _ in pairs]):.1f}%"
    rows.append((label, median(a_s), median(b_s), median(ratios), min(ratios), max(ratios), len(pairs),
                 100 * median([a["accuracy"] for a, _ in pairs]), 100 * median([b["accuracy"] for _, b in pairs]), comm))

print()
print(f"{'run':<16} {'ours samples/s':>15} {'PyTorch samples/s':>18} {'ratio (median, range, n)':>26} {'ours acc':>9} {'PyTorch acc':>12} {'comm share':>11}")
for r in rows:
    rng = f"{r[3]:.2f}x ({r[4]:.2f}-{r[5]:.2f}, {r[6]})"
    print(f"{r[0]:<16} {r[1]:>15.0f} {r[2]:>18.0f} {rng:>26} {r[7]:>8.2f}% {r[8]:>11.2f}% {r[9]:>11}")

ar = load("allreduce-2.json")
if ar:
    print()
    print(f"{'bytes':>10} {'ours busbw GB/s':>16} {'raw rsmpi GB/s':>15} {'ratio':>6} {'ours lat us':>12}")
    for r in ar["rows"]:
        print(f"{r['bytes']:>10} {r['ours_busbw_gbps']:>16.2f} {r['raw_busbw_gbps']:>15.2f} {r['ratio']:>6.2f} {r['ours_latency_us']:>12.1f}")

strategies = [(s, load(f"strategy-{s}-2.json")) for s in ["ddp", "fsdp-full-shard", "fsdp-shard-grad-op", "fsdp-no-shard"]]
strategies = [(s, r) for s, r in strategies if r]
if strategies:
    base = strategies[0][1]["samples_per_s"] if strategies[0][0] == "ddp" else None
    print()
    print(f"{'strategy (2 ranks)':<20} {'samples/s':>10} {'vs ddp':>7} {'accuracy':>9} {'comm share':>11} {'state MiB/rank':>15}")
    for s, r in strategies:
        share = max(x["comm_s"] / x["train_s"] for x in r["ranks"])
        ms = r["ranks"][0]["model_state"]
        state = (ms["parameters"] + ms["gradients"] + ms["optimizer"]) / 2**20
        rel = f"{r['samples_per_s'] / base:.2f}x" if base else ""
        print(f"{s:<20} {r['samples_per_s']:>10.0f} {rel:>7} {100 * r['accuracy']:>8.2f}% {100 * share:>10.1f}% {state:>15.1f}")

mem = [(s, load(f"memory-{s}-w4096-2.json")) for s in ["ddp", "fsdp-full-shard"]]
mem = [(s, r) for s, r in mem if r]
if mem:
    print()
    print(f"{'width 4096, 2 ranks':<20} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} {'gathered peak MiB':>18} {'peak RSS MiB (r0, r1)':>22}")
    for s, r in mem:
        ms = r["ranks"][0]["model_state"]
        rss = ", ".join(f"{x['peak_rss_mib']:.0f}" for x in r["ranks"])
        print(f"{s:<20} {ms['parameters'] / 2**20:>11.1f} {ms['gradients'] / 2**20:>10.1f} {ms['optimizer'] / 2**20:>10.1f} {ms['gathered_peak'] / 2**20:>18.1f} {rss:>22}")
