"""The PyTorch MNIST example loop, single process — the peer of `ladder-baseline`.

    .venv/bin/python bench/reference/tutorial.py [--max-steps N] [--threads T] [--device cpu|cuda]

Prints one JSON line: samples_per_s (timed steps, warm-up excluded), accuracy, eval_samples, wall_s,
peak RSS (whole process and training phase), step timing (common.StepTimer).
"""
import json
import time

import torch
import torch.nn.functional as F

from common import peer_arguments, BasicNet, StepTimer, datasets, device_fields, evaluate, gathered_timing_fields


def main():
    a = peer_arguments(
        ("--epochs", dict(type=int, default=1)),
        ("--threads", dict(type=int, default=None, help="intra-op threads (default: all cores)")),
        ("--device", dict(default="cpu", help="cpu or cuda (the GPU check)")),
    )
    start = time.perf_counter()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    train, test = datasets()
    train_loader = torch.utils.data.DataLoader(train, batch_size=a.batch_size, shuffle=True)
    test_loader = torch.utils.data.DataLoader(test, batch_size=1000)
    model = BasicNet().to(a.device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    steps, samples, train_s = 0, 0, 0.0
    done = False
    timer = StepTimer()
    for _ in range(a.epochs):
        model.train()
        t0 = time.perf_counter()
        timer.resume()
        for x, y in train_loader:
            x, y = x.to(a.device), y.to(a.device)
            timer.lap("data")
            opt.zero_grad()
            loss = F.nll_loss(model(x), y)
            timer.lap("forward")
            loss.backward()
            timer.lap("backward")
            opt.step()
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
            timer.end_step("optimizer", len(y))
            steps += 1
            samples += len(y)
            if a.max_steps and steps >= a.max_steps:
                done = True
                break
        train_s += time.perf_counter() - t0
        if done:
            break
    timing = gathered_timing_fields(timer)
    correct, loss_sum, n = evaluate(model, test_loader, a.device)
    print(json.dumps(dict(timing, **device_fields(a.device), **{
        "impl": "pytorch-tutorial", "world_size": 1, "threads": torch.get_num_threads(),
        "steps": steps, "accuracy": correct / n,
        "eval_samples": n, "test_loss": loss_sum / n, "wall_s": time.perf_counter() - start,
    })))


if __name__ == "__main__":
    main()
