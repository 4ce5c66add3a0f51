"""Prints the bench table from bench/results/*.json: ours next to PyTorch, with ratios."""
import json
import pathlib
import sys

out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results")


def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.exists() else None


rows = []
for label, ours, theirs in [
    ("single process", "baseline.json", "pytorch-tutorial.json"),
    ("DDP, 2 ranks", "level1-ddp-2.json", "pytorch-ddp-gloo-2.json"),
]:
    a, b = load(ours), load(theirs)
    if not (a and b):
        continue
    comm = ""
    if a.get("ranks"):
        share = [r["comm_s"] / r["train_s"] for r in a["ranks"] if r["train_s"] > 0]
        comm = f"{100 * max(share):.1f}%"
    rows.append((label, a["samples_per_s"], b["samples_per_s"], a["samples_per_s"] / b["samples_per_s"],
                 100 * a["accuracy"], 100 * b["accuracy"], comm))

print()
print(f"{'run':<16} {'ours samples/s':>15} {'PyTorch samples/s':>18} {'ratio':>6} {'ours acc':>9} {'PyTorch acc':>12} {'comm share':>11}")
for r in rows:
    print(f"{r[0]:<16} {r[1]:>15.0f} {r[2]:>18.0f} {r[3]:>5.2f}x {r[4]:>8.2f}% {r[5]:>11.2f}% {r[6]:>11}")

ar = load("allreduce-2.json")
if ar:
    print()
    print(f"{'bytes':>10} {'ours busbw GB/s':>16} {'raw rsmpi GB/s':>15} {'ratio':>6} {'ours lat us':>12}")
    for r in ar["rows"]:
        print(f"{r['bytes']:>10} {r['ours_busbw_gbps']:>16.2f} {r['raw_busbw_gbps']:>15.2f} {r['ratio']:>6.2f} {r['ours_latency_us']:>12.1f}")
