"""PyTorch DDP over gloo under torchrun — the peer of level1-raw-ddp.

    .venv/bin/torchrun --nproc-per-node 2 bench/reference/ddp_gloo.py [--max-steps N]

torchrun sets OMP_NUM_THREADS=1 per rank; this script sets cores // LOCAL_WORLD_SIZE threads, as
ddp-ladder's ranks do. Rank 0 prints one JSON line (samples_per_s over all ranks' timed steps, accuracy with
exact distributed evaluation, peak RSS and step timing from common.StepTimer; comm share unknown to
PyTorch and left out).
"""
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from common import peer_arguments, BasicNet, StepTimer, datasets, gathered_timing_fields, finish


def main():
    a = peer_arguments()
    start = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    torch.manual_seed(a.seed)
    train, test = datasets()
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=a.seed)
    loader = torch.utils.data.DataLoader(train, batch_size=a.batch_size, sampler=sampler)
    model = DDP(BasicNet())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    sampler.set_epoch(0)
    model.train()
    steps, samples = 0, 0
    timer = StepTimer()
    for x, y in loader:
        timer.lap("data")
        opt.zero_grad()
        loss = F.nll_loss(model(x), y)
        timer.lap("forward")
        loss.backward()  # the gradient all-reduce runs inside, overlapped through DDP's hooks
        timer.lap("backward")
        opt.step()
        timer.end_step("optimizer", len(y))
        steps += 1
        samples += len(y)
        if a.max_steps and steps >= a.max_steps:
            break
    timing = gathered_timing_fields(timer)
    # Exact evaluation: disjoint unpadded slices, sums all-reduced.
    n = len(test)
    lo, hi = rank * n // world, (rank + 1) * n // world
    sub = torch.utils.data.Subset(test, range(lo, hi))
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for x, y in torch.utils.data.DataLoader(sub, batch_size=1000):
            out = model.module(x)
            sums += torch.tensor([(out.argmax(1) == y).sum().item(), F.nll_loss(out, y, reduction="sum").item(), len(y)], dtype=torch.float64)
    dist.all_reduce(sums)
    if rank == 0:
        print(json.dumps(dict(timing, **{
            "impl": "pytorch-ddp-gloo", "world_size": world, "threads": torch.get_num_threads(), "steps": steps,
            "accuracy": sums[0].item() / sums[2].item(),
            "eval_samples": int(sums[2].item()), "test_loss": sums[1].item() / sums[2].item(),
            "wall_s": time.perf_counter() - start,
        })), flush=True)
    finish()  # while the DDP model is still referenced: see common.finish


if __name__ == "__main__":
    main()
