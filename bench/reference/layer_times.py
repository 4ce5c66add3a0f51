"""BasicNet's segments in eager PyTorch, timed forward and backward — the peer half of
`cargo run --release -p bench --example layer_times` (which runs this script and prints the table).

    .venv/bin/python bench/reference/layer_times.py [--reps 30]

The segments are ddp-ladder's (see examples/layer_times.rs): [conv1, relu], [conv2, relu,
max_pool2d 2] (the tutorial's order), [dropout 0.25, flatten], [fc1, relu], [dropout 0.5],
[fc2, log_softmax], then nll_loss. Batch 64, all cores, the tutorial's BasicNet. Each forward is
timed on the input the real forward gives it; each backward is out.sum().backward() (a gradient of ones), as ours. Prints one JSON
line: {"rows": [[forward ms, backward ms], ...]} (medians over --reps).
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F

from common import BasicNet


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    torch.manual_seed(0)
    net = BasicNet()
    net.train()
    x = torch.randn(64, 1, 28, 28)
    y = torch.randint(0, 10, (64,))
    segments = [
        lambda t: F.relu(net.conv1(t)),
        lambda t: F.max_pool2d(F.relu(net.conv2(t)), 2),
        lambda t: torch.flatten(net.dropout1(t), 1),
        lambda t: F.relu(net.fc1(t)),
        lambda t: net.dropout2(t),
        lambda t: F.log_softmax(net.fc2(t), dim=1),
        lambda t: F.nll_loss(t, y),
    ]
    inputs = [x]
    with torch.no_grad():
        for seg in segments[:-1]:
            inputs.append(seg(inputs[-1]))
    rows = []
    for i, seg in enumerate(segments):
        inp = inputs[i] if i == 0 else inputs[i].detach().requires_grad_(True)
        fwd, bwd = [], []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            out = seg(inp)
            t1 = time.perf_counter()
            total = out.sum()
            t2 = time.perf_counter()
            total.backward()
            t3 = time.perf_counter()
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t3 - t2) * 1e3)
        rows.append([sorted(fwd)[len(fwd) // 2], sorted(bwd)[len(bwd) // 2]])
    print(json.dumps({"rows": rows, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
