"""The loop a speed-minded PyTorch user writes — the tuned peer of ladder-baseline (one process) and
of every level at W ranks (DDP over gloo under torchrun).

    .venv/bin/python bench/reference/tuned.py [--max-steps N] [--tune channels_last,bf16,compile|none]
    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 bench/reference/tuned.py
    .venv/bin/python bench/reference/tuned.py --device cuda --precision bf16     (scripts/gpu-check.sh)

Kept from tutorial.py / ddp_gloo.py: BasicNet and its initialisation (torch.manual_seed(seed), then
BasicNet()), AdamW lr 1e-3, batch 64 per rank, one epoch, the data-order rule of DistributedSampler
(randperm seeded with seed + epoch, padded to a multiple of W, rank r takes every W-th from r),
exact evaluation (every test image once), threads = cores / local ranks under torchrun.
What a performance-minded user changes:
- the images are decoded and normalised once into one float tensor [60000, 1, 28, 28]; a batch is
  an index_select of it (no Dataset, no per-sample transform, no DataLoader);
- AdamW(fused=True) where this build supports it on CPU; zero_grad(set_to_none=True);
- each of channels_last, bf16 autocast and torch.compile, kept when a short timed trial at start-up
  (TRIAL_WARMUP + TRIAL_STEPS steps of a throwaway copy, median step time, every rank's slowest)
  measures it at least 3% faster than what was kept before it, and only when one backward of it
  gives eager fp32's gradients (GRAD_TOLERANCE): a faster configuration that computes something
  else is rejected, with the parameter and error in "trial";
--precision fp32|bf16|fp16 fixes the precision instead (bf16 then leaves the trial; fp16 adds a
GradScaler); `bench run` always passes its row's, so that an fp32 row meets an fp32 peer. Prints one JSON line (rank 0), as the other peers, plus "tuned" (what it chose) and
"trial" (median ms per step of each configuration tried, or why it was rejected); on CUDA "cuda_peak_mib" and "gpu".
"""
import gzip
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import REPO, BasicNet, StepTimer, device_fields, gathered_timing_fields, peer_arguments, finish

MEAN, STD = 0.1307, 0.3081
TRIAL_WARMUP, TRIAL_STEPS = 3, 10
CANDIDATES = ("channels_last", "bf16", "compile")
# How far one backward of a candidate may be from eager fp32's (relative gradient error, per
# parameter) before the candidate is rejected whatever its speed: fp32 rearrangements round
# differently (channels_last, a fused kernel), by about 1e-6; bf16 keeps 8 bits of mantissa, and
# conv1's gradient, a sum over 64 × 26 × 26 products, comes out about 9% from fp32's under bf16
# autocast (2-core Zen 3) and still trains as well. The check is for a different computation,
# not for rounding: an error near 100% (a zero or unrelated gradient). PyTorch 2.13.0's
# inductor on CPU returns zero gradients for BasicNet's conv1 and conv2 (error 100%): compiled,
# the peer would train only fc1 and fc2 (92.55% against 96.71% after 150 steps, 2-core Zen 3).
GRAD_TOLERANCE = {"fp32": 1e-3, "low": 0.3}


def load(kind):
    """(images [n, 1, 28, 28] f32 normalised, labels [n] i64) from data/mnist/<kind>-*.gz."""
    src = os.environ.get("MNIST_DIR", str(REPO / "data" / "mnist"))
    with gzip.open(os.path.join(src, f"{kind}-images-idx3-ubyte.gz"), "rb") as f:
        images = np.frombuffer(f.read(), dtype=np.uint8, offset=16)
    with gzip.open(os.path.join(src, f"{kind}-labels-idx1-ubyte.gz"), "rb") as f:
        labels = np.frombuffer(f.read(), dtype=np.uint8, offset=8)
    x = torch.from_numpy(images.copy()).view(-1, 1, 28, 28).float().div_(255.0).sub_(MEAN).div_(STD)
    return x, torch.from_numpy(labels.astype(np.int64))


def rank_indices(n, seed, epoch, rank, world):
    """DistributedSampler(shuffle=True, drop_last=False)'s indices for `rank`."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    perm = torch.randperm(n, generator=g)
    total = -(-n // world) * world
    if total > n:
        perm = torch.cat([perm, perm[: total - n]])
    return perm[rank:total:world]


def fused_adamw(params, lr):
    """AdamW(fused=True) where the CPU build has it, else the default (foreach) AdamW."""
    try:
        return torch.optim.AdamW(params, lr=lr, fused=True), True
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, lr=lr), False


class Setup:
    """A model ready to train under `config` (a set among CANDIDATES): the eager module (for
    evaluation), what training calls (compiled or DDP-wrapped), its optimizer."""

    def __init__(self, module, config, world, lr, device):
        module = module.to(device)
        if "channels_last" in config:
            module = module.to(memory_format=torch.channels_last)
        self.device = torch.device(device)
        low = [k for k in ("bf16", "fp16") if k in config]
        self.autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}[low[0]] if low else None
        self.scaler = torch.amp.GradScaler(self.device.type) if "fp16" in config else None
        self.module = module
        self.config = config
        train = torch.nn.parallel.DistributedDataParallel(module) if world > 1 else module
        self.train = torch.compile(train) if "compile" in config else train
        self.opt, self.fused = fused_adamw(module.parameters(), lr)

    def loss(self, x, y):
        """The forward pass and loss of training (channels_last input, autocast if chosen)."""
        if "channels_last" in self.config:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            return F.nll_loss(self.train(x), y)

    def step(self, x, y, timer=None):
        """zero_grad(set_to_none) → forward (bf16 autocast if chosen) → backward → step, with the
        StepTimer's laps when one is given (as the other peers); the loss."""
        lap = timer.lap if timer else (lambda _: None)
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(x, y)
        lap("forward")
        # Under DDP the gradient all-reduce runs inside backward, overlapped through hooks.
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        lap("backward")
        if self.scaler:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return loss


def trial(x, y, config, world, lr, batch, device):
    """Median seconds per step of `config` on a throwaway model, the slowest rank's."""
    s = Setup(BasicNet(), config, world, lr, device)
    s.module.train()
    times = []
    for i in range(TRIAL_WARMUP + TRIAL_STEPS):
        lo = (i * batch) % (len(x) - batch)
        t0 = time.perf_counter()
        s.step(x[lo: lo + batch], y[lo: lo + batch])
        times.append(time.perf_counter() - t0)
    median = torch.tensor(sorted(times[TRIAL_WARMUP:])[TRIAL_STEPS // 2], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def gradient_error(x, y, config, world, device):
    """The largest relative gradient error, ‖g − g_eager‖ / ‖g_eager‖ over the parameters, of one
    backward of `config` against eager fp32 on the same model and batch, dropout off (the compiled
    graph draws its masks from another generator). Every rank's largest."""
    grads = []
    for cfg in (set(), config):
        torch.manual_seed(0)
        s = Setup(BasicNet(), cfg, 1, 1e-3, device)
        for m in s.module.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        s.module.train()
        s.loss(x[:64], y[:64]).backward()
        grads.append([(n, p.grad.float()) for n, p in s.module.named_parameters()])
    errors = [((g - r).norm() / r.norm()).item() for (_, r), (_, g) in zip(*grads)]
    worst = max(range(len(errors)), key=errors.__getitem__)
    error = torch.tensor(errors[worst], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
    return error.item(), grads[0][worst][0]


def choose(x, y, fixed, candidates, world, lr, batch, device, keep_all=False):
    """Greedy: start from `fixed` (eager, the precision asked for); keep each candidate whose
    gradients agree with eager fp32 (relative error ≤ GRAD_TOLERANCE, fp32 or low precision) and
    that is ≥ 3% faster than what is kept so far (any that agrees, with `keep_all`). Returns (the
    chosen set, {configuration: median ms per step, or why it was rejected})."""
    chosen = set(fixed)
    best = trial(x, y, chosen, world, lr, batch, device)
    tried = {"+".join(sorted(chosen)) or "eager fp32": round(best * 1e3, 3)}
    for c in candidates:
        name = "+".join(sorted(chosen | {c}))
        error, param = gradient_error(x, y, chosen | {c}, world, device)
        tolerance = GRAD_TOLERANCE["low" if {"bf16", "fp16"} & (chosen | {c}) else "fp32"]
        if not error <= tolerance:
            tried[name] = f"rejected: {param} gradient {100 * error:.3g}% from eager fp32 (tolerance {100 * tolerance:.3g}%)"
            continue
        t = trial(x, y, chosen | {c}, world, lr, batch, device)
        tried[name] = round(t * 1e3, 3)
        if keep_all or t < 0.97 * best:
            chosen, best = chosen | {c}, t
    return chosen, tried


def main():
    a = peer_arguments(
        ("--tune", dict(default=",".join(CANDIDATES), help="candidates for the start-up trial, comma-separated, or none")),
        ("--device", dict(default="cpu", help="cpu or cuda")),
        ("--precision", dict(default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                             help="auto: bf16 autocast when the trial measures it faster; else fixed")),
        ("--keep-all", dict(action="store_true",
                            help="keep every candidate whose gradients agree with eager fp32, faster or not")),
    )
    start = time.perf_counter()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world > 1:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    x, y = (t.to(a.device) for t in load("train"))
    tx, ty = (t.to(a.device) for t in load("t10k"))
    candidates = [c for c in a.tune.split(",") if c and c != "none"]
    unknown = [c for c in candidates if c not in CANDIDATES]
    if unknown:
        raise SystemExit(f"tuned.py: --tune {a.tune!r}: unknown {unknown}; expected some of {', '.join(CANDIDATES)} or none")
    fixed = set() if a.precision in ("auto", "fp32") else {a.precision}
    if a.precision != "auto":
        candidates = [c for c in candidates if c != "bf16"]
    if candidates:
        chosen, tried = choose(x, y, fixed, candidates, world, a.lr, a.batch_size, a.device, a.keep_all)
    else:
        chosen, tried = fixed, {}

    torch.manual_seed(a.seed)
    s = Setup(BasicNet(), chosen, world, a.lr, a.device)
    s.module.train()
    idx = rank_indices(len(x), a.seed, 0, rank, world).to(a.device)
    steps, samples = 0, 0
    timer = StepTimer()
    for lo in range(0, len(idx), a.batch_size):
        b = idx[lo: lo + a.batch_size]
        xb, yb = x.index_select(0, b), y.index_select(0, b)
        timer.lap("data")
        s.step(xb, yb, timer)
        timer.end_step("optimizer", len(b))
        steps += 1
        samples += len(b)
        if a.max_steps and steps >= a.max_steps:
            break
    timing = gathered_timing_fields(timer)
    # Exact evaluation on the eager module: disjoint unpadded slices, sums all-reduced.
    n = len(tx)
    lo, hi = rank * n // world, (rank + 1) * n // world
    s.module.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad(), torch.autocast(s.device.type, dtype=s.autocast or torch.bfloat16, enabled=s.autocast is not None):
        for i in range(lo, hi, 1000):
            xb, yb = tx[i: min(i + 1000, hi)], ty[i: min(i + 1000, hi)]
            out = s.module(xb).float()
            sums += torch.tensor([(out.argmax(1) == yb).sum().item(), F.nll_loss(out, yb, reduction="sum").item(), len(yb)],
                                 dtype=torch.float64)
    if world > 1:
        dist.all_reduce(sums)
    sums = sums.cpu()
    choice = ["preloaded tensors", "fused AdamW" if s.fused else "AdamW (no fused CPU kernel)"]
    choice += [c for c in CANDIDATES + ("fp16",) if c in chosen]
    if rank == 0:
        print(json.dumps(dict(timing, **device_fields(a.device), **{
            "impl": "pytorch-tuned", "world_size": world, "threads": torch.get_num_threads(), "steps": steps,
            "accuracy": sums[0].item() / sums[2].item(), "eval_samples": int(sums[2].item()),
            "test_loss": sums[1].item() / sums[2].item(), "wall_s": time.perf_counter() - start,
            "tuned": ", ".join(choice), "trial": tried,
        })), flush=True)
    finish()  # while the DDP model is still referenced: see common.finish


if __name__ == "__main__":
    main()
