"""🤗 Accelerate — the peer of level2-accelerator: the same BasicNet loop, prepared by an
`Accelerator`, launched so that it really starts N processes (gloo on CPU).

    .venv/bin/accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no bench/reference/accelerate_loop.py [--max-steps N]
    .venv/bin/accelerate launch --cpu --num_processes 1 bench/reference/accelerate_loop.py   # 1 process

(`--multi_gpu` is Accelerate's torchrun launcher; on a machine without GPUs, `Accelerator(cpu=True)`
makes it a MULTI_CPU run over gloo.) The recipe is level 2's: batch 64 per process, AdamW lr 1e-3
weight_decay 0.01, seed 1, a shuffled training loader sharded by the Accelerator, one evaluation at
the end over the whole test set (gather_for_metrics drops the padding). Threads per process:
cores // local processes, as ddp-ladder's ranks. Rank 0 prints one JSON line: samples_per_s over
all processes' timed steps, accuracy, peak RSS (whole process and training phase), step timing
(common.StepTimer, in this script: Accelerate does not time steps itself).
"""
import json
import os
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed

from common import peer_arguments, BasicNet, StepTimer, datasets, gathered_timing_fields, finish


def main():
    a = peer_arguments()
    start = time.perf_counter()
    accelerator = Accelerator(cpu=True)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    set_seed(a.seed)
    train, test = datasets()
    train_loader = torch.utils.data.DataLoader(train, batch_size=a.batch_size, shuffle=True)
    test_loader = torch.utils.data.DataLoader(test, batch_size=1000)
    model = BasicNet()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    model, opt, train_loader, test_loader = accelerator.prepare(model, opt, train_loader, test_loader)
    model.train()
    steps = 0
    timer = StepTimer()
    for x, y in train_loader:
        timer.lap("data")
        opt.zero_grad()
        loss = F.nll_loss(model(x), y)
        timer.lap("forward")
        accelerator.backward(loss)
        timer.lap("backward")
        opt.step()
        timer.end_step("optimizer", len(y))
        steps += 1
        if a.max_steps and steps >= a.max_steps:
            break
    timing = gathered_timing_fields(timer)
    model.eval()
    correct, loss_sum, n = 0, 0.0, 0
    with torch.no_grad():
        for x, y in test_loader:
            out = model(x)
            losses, hits = accelerator.gather_for_metrics((F.nll_loss(out, y, reduction="none"), out.argmax(1) == y))
            loss_sum += losses.sum().item()
            correct += hits.sum().item()
            n += len(losses)
    if accelerator.is_main_process:
        print(json.dumps(dict(timing, **{
            "impl": "hf-accelerate", "accelerate": __import__("accelerate").__version__,
            "world_size": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
            "threads": torch.get_num_threads(), "steps": steps, "accuracy": correct / n,
            "eval_samples": n, "test_loss": loss_sum / n, "wall_s": time.perf_counter() - start,
        })), flush=True)
    finish()  # not end_training(): see common.finish


if __name__ == "__main__":
    main()
