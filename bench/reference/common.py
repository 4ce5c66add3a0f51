"""Shared by the PyTorch peers: the tutorial's BasicNet and MNIST from the repository's IDX files.

torchvision's MNIST reads the decompressed IDX files from <root>/MNIST/raw; they are unpacked once
from data/mnist/*.gz into a cache directory (no network).
"""
import argparse
import gzip
import math
import os
import pathlib
import shutil
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = pathlib.Path(__file__).resolve().parents[2]
FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]


class BasicNet(nn.Module):
    """PyTorch's MNIST example network (1,199,882 parameters)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def peer_arguments(*extra):
    """The flags every peer takes, as our levels name them: --batch-size (64, per process),
    --lr (AdamW, 1e-3), --seed (1), --max-steps (all of one epoch when absent). `extra` are
    (flag, kwargs) pairs a peer adds. Returns the parsed namespace."""
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=None)
    for flag, kwargs in extra:
        p.add_argument(flag, **kwargs)
    return p.parse_args()


def mnist_root():
    """A torchvision root holding MNIST/raw/<the four decompressed files>."""
    src = pathlib.Path(os.environ.get("MNIST_DIR", REPO / "data" / "mnist"))
    root = pathlib.Path(os.environ.get("LADDER_TORCHVISION_ROOT", REPO / "target" / "torchvision-mnist"))
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        dst = raw / name
        if not dst.exists():
            # Per-process temporary name: every rank of a first run decompresses at once, and
            # each renames its own complete copy into place (the same bytes).
            tmp = dst.with_suffix(f".tmp{os.getpid()}")
            with gzip.open(src / (name + ".gz"), "rb") as f, open(tmp, "wb") as g:
                shutil.copyfileobj(f, g)
            os.replace(tmp, dst)
    return str(root)


def datasets():
    from torchvision import datasets, transforms

    t = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    root = mnist_root()
    return datasets.MNIST(root, train=True, download=False, transform=t), datasets.MNIST(
        root, train=False, download=False, transform=t
    )


def evaluate(model, loader, device="cpu"):
    model.eval()
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            out = model(x)
            loss += F.nll_loss(out, y, reduction="sum").item()
            correct += (out.argmax(1) == y).sum().item()
            n += len(y)
    return correct, loss, n


# --- Step timing, as ladder_core::timing::StepTimer (same warm-up, same step boundaries) ---------

WARMUP_STEPS = 2
PHASES = ("data_s", "forward_s", "backward_s", "comm_s", "optimizer_s")


def _status_kib(key):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


_PEAK_BEFORE_RESET_KIB = 0


def peak_rss_mib():
    """Whole-process peak RSS since start-up (VmHWM, or what it was before StepTimer reset it),
    MiB."""
    return max(_status_kib("VmHWM:"), _PEAK_BEFORE_RESET_KIB) / 1024.0


class StepTimer:
    """Step times and phases of a training loop; the training phase's peak RSS.

    As ddp-ladder's StepTimer: a step runs from the end of the previous one (or start/resume)
    to the end of its optimizer step; the first WARMUP_STEPS steps are warm-up (time to first
    step; left out of throughput, percentiles and phases). Starting resets VmHWM through
    /proc/self/clear_refs. PyTorch runs the DDP all-reduce inside backward (overlapped through
    hooks), so the peers' comm phase stays 0 and backward includes it.
    """

    def __init__(self):
        global _PEAK_BEFORE_RESET_KIB
        _PEAK_BEFORE_RESET_KIB = max(_PEAK_BEFORE_RESET_KIB, _status_kib("VmHWM:"))
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.rss_scope = "clear-refs" if _status_kib("VmHWM:") <= _status_kib("VmRSS:") + 1024 else "none"
        except OSError:
            self.rss_scope = "none"
        self.start = self.mark = time.perf_counter()
        self.current = dict.fromkeys(PHASES, 0.0)
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.step_times = []
        self.samples = self.timed_samples = 0
        self.first_step_s = 0.0

    def resume(self):
        self.mark = time.perf_counter()

    def lap(self, phase):
        now = time.perf_counter()
        self.current[phase + "_s"] += now - self.mark
        self.mark = now

    def end_step(self, phase, samples):
        self.lap(phase)
        step, self.current = self.current, dict.fromkeys(PHASES, 0.0)
        if not self.step_times:
            self.first_step_s = self.mark - self.start
        if len(self.step_times) >= WARMUP_STEPS:
            for k in PHASES:
                self.phases[k] += step[k]
            self.timed_samples += samples
        self.step_times.append(sum(step.values()))
        self.samples += samples

    def finish(self):
        n = len(self.step_times)
        warmup = min(n, WARMUP_STEPS)
        timed = sorted(self.step_times[warmup:])
        k = len(timed)

        def pick(q):
            return timed[min(max(math.ceil(q * k), 1), k) - 1] if k else 0.0

        per = 1.0 / k if k else 0.0
        return {
            "steps": n, "warmup_steps": warmup, "timed_steps": k, "samples": self.samples,
            "timed_samples": self.timed_samples, "steps_s": sum(self.step_times), "timed_s": sum(timed),
            "first_step_s": self.first_step_s, "step_p50_s": pick(0.5), "step_p95_s": pick(0.95),
            "phases": {p: v * per for p, v in self.phases.items()}, "comm_bytes_per_step": 0.0,
            "train_peak_rss_mib": _status_kib("VmHWM:") / 1024.0 if self.rss_scope == "clear-refs" else 0.0,
            "rss_scope": self.rss_scope,
        }


def timing_fields(timings):
    """The report fields from every rank's StepTimer.finish(): the slowest rank's timing,
    samples/s over the timed steps (all ranks' samples over the slowest rank's timed interval),
    peak RSS (whole process and training phase) as the maximum over ranks."""
    slowest = max(timings, key=lambda t: t["timed_s"])
    if all(t["timed_steps"] > 0 for t in timings):
        sps = sum(t["timed_samples"] for t in timings) / max(slowest["timed_s"], 1e-9)
    else:
        sps = sum(t["samples"] for t in timings) / max(max(t["steps_s"] for t in timings), 1e-9)
    return {
        "samples_per_s": sps, "samples": sum(t["samples"] for t in timings), "timing": slowest,
        "peak_rss_mib": max(t["peak_rss_mib"] for t in timings),
        "train_peak_rss_mib": max(t["train_peak_rss_mib"] for t in timings),
    }


def gathered_timing_fields(timer):
    """timing_fields over every rank (torch.distributed initialised); call it on every rank."""
    import torch.distributed as dist

    mine = dict(timer.finish(), peak_rss_mib=peak_rss_mib())
    if dist.is_available() and dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    return timing_fields(every)


def device_fields(device):
    """The report fields a CUDA run adds: the CUDA caching allocator's peak (torch.cuda
    .max_memory_allocated, MiB) and the GPU's name; nothing on CPU."""
    if not str(device).startswith("cuda"):
        return {}
    return {"cuda_peak_mib": torch.cuda.max_memory_allocated() / 2**20, "gpu": torch.cuda.get_device_name()}


def finish():
    """Ends a peer once its report is printed: every rank meets at a barrier (a distributed run),
    then the process leaves with os._exit(0): no destructor and no interpreter teardown runs.

    Call it on success only (an exception must still reach the interpreter: traceback, non-zero
    exit), from the function that holds the model, before that function returns. Returning first
    frees the DDP wrapper, whose Reducer holds the gloo process group: ProcessGroupGloo's
    destructor joins its worker threads while this thread holds the GIL, and a worker that is
    still destroying a finished collective (a barrier's, an all-gather's) waits for the GIL to
    drop a Python tensor: a deadlock, rank 0 blocked for good after printing its report, torchrun
    and the bench waiting with it (seen in CI, 1 run in 6 of trainer.py at 2 ranks here; py-spy:
    main thread in ~ProcessGroupGloo -> std::thread::join, worker in ~AsyncAllgatherWork ->
    gil_scoped_acquire). destroy_process_group() is skipped for the same reason, and
    Accelerate's end_training() with it. The barrier keeps a rank from leaving while another
    still runs a collective with it."""
    import sys
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
