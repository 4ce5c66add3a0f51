"""The 🤗 blog tutorial "From PyTorch DDP to Accelerate to Trainer" run as published, on CPU, at
world sizes 1, 2 and 3: what its three programs actually do.

    .venv/bin/python bench/reference/tutorial_as_published.py \
        [--world-sizes 1,2,3] [--max-steps 200] [--out book/src/generated/tutorial-as-published.md]

The tutorial (https://huggingface.co/blog/pytorch-ddp-accelerate-transformers) gives three programs:
`train_ddp` (raw torch.distributed + DDP), `train_ddp_accelerate` (an Accelerator) and a `Trainer`
subclass. Each worker below follows its program statement for statement. Where the published code
cannot run at all, or cannot run on a CPU, the smallest change that makes it run is marked
`# CHANGED:`; what this script measures besides, reading only what the program computed, is marked
`# ADDED:`. Nothing marked ADDED changes what the program trains or prints.

The driver starts each program with `torchrun --standalone --nproc-per-node W` (the tutorial's
launcher), collects one JSON record per rank, and writes a Markdown report with the run's
provenance (date, commit, command, versions) for the book (`book/src/generated/`). The Accelerate
and Transformers peers must be importable (`bench run --install-peers` puts them in `.venv`).
Short runs (`--max-steps`, per rank) are enough: the effects are structural, and the report says
how many steps ran.
"""
import argparse
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import traceback

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
PROGRAMS = ("train_ddp", "train_ddp_accelerate", "trainer")


# --- The workers: one rank of one program ------------------------------------------------------


def _result_path(a):
    return pathlib.Path(a.result_dir) / f"{a.worker}-w{os.environ.get('WORLD_SIZE', '1')}-rank{os.environ.get('RANK', '0')}.json"


def _flat_parameters(model):
    import torch

    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def _spread_across_ranks(model):
    """ADDED: the largest |parameter of rank r - parameter of rank 0| over every rank and element
    (0.0 when the replicas are bit-identical). A collective after the program's own work."""
    import torch
    import torch.distributed as dist

    mine = _flat_parameters(model)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return max(float((p - every[0]).abs().max()) for p in every)


def _true_accuracy(model, test_dset):
    """ADDED: the accuracy of this rank's model over the 10,000 test images, each counted once."""
    import torch

    model.eval()
    correct = 0
    with torch.no_grad():
        for data, target in torch.utils.data.DataLoader(test_dset, batch_size=1000):
            correct += (model(data).argmax(dim=1) == target).sum().item()
    return 100.0 * correct / len(test_dset)


def worker_train_ddp(a):
    """The tutorial's `train_ddp(rank, world_size)` (section "🤗 Accelerate", first listing)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import torch.optim as optim
    from torch.nn.parallel import DistributedDataParallel as DDP

    from common import BasicNet, datasets

    # CHANGED: torchrun passes rank and world size in the environment; the tutorial's function
    # takes them as arguments (and its notebook_launcher call passes none).
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = "cpu"  # CHANGED: the tutorial's global `device = "cuda"`; this machine has no GPU.

    # setup(rank, world_size): the process group. CHANGED: gloo at torchrun's MASTER_ADDR/PORT
    # (the tutorial sets localhost:12355 itself, which torchrun has already set).
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    # Build DataLoaders. CHANGED: the repository's MNIST files (common.datasets: the tutorial's
    # ToTensor + Normalize((0.1307), (0.3081))) instead of a download.
    train_dset, test_dset = datasets()
    train_loader = torch.utils.data.DataLoader(train_dset, shuffle=True, batch_size=64)
    test_loader = torch.utils.data.DataLoader(test_dset, shuffle=False, batch_size=64)
    # Build model. CHANGED: the tutorial writes `model = model.to(rank)` with no `model` in scope
    # (UnboundLocalError); BasicNet() is the model the tutorial means. `.to(rank)` is a GPU index.
    model = BasicNet().to(device)
    ddp_model = DDP(model)  # CHANGED: no device_ids on CPU
    # Build optimizer
    optimizer = optim.AdamW(ddp_model.parameters(), lr=1e-3)
    # Train for a single epoch
    model.train()
    batches = 0  # ADDED
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        batches += 1  # ADDED
        if a.max_steps and batches >= a.max_steps:  # ADDED: a short run
            break
    # Evaluate
    model.eval()
    correct = 0
    counted = 0  # ADDED
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()
            counted += len(target)  # ADDED
    printed = f"Accuracy: {100. * correct / len(test_loader.dataset)}"
    print(printed)
    record = {  # ADDED
        "rank": rank, "world_size": world_size, "printed": printed,
        "printed_accuracy": 100.0 * correct / len(test_loader.dataset),
        "train_batches_per_epoch": len(train_loader), "train_batches_run": batches,
        "test_images_counted": counted, "test_images_divided_by": len(test_loader.dataset),
        "parameter_spread": _spread_across_ranks(model),
    }
    _result_path(a).write_text(json.dumps(record))
    dist.destroy_process_group()  # cleanup()


def worker_train_ddp_accelerate(a):
    """The tutorial's `train_ddp_accelerate()` (section "🤗 Accelerate", second listing)."""
    import torch
    import torch.nn.functional as F
    import torch.optim as optim
    from accelerate import Accelerator

    from common import BasicNet, datasets

    device = "cpu"  # CHANGED: the tutorial's global `device = "cuda"`, used again in its evaluation.
    # CHANGED: `Accelerator()` on a machine without a GPU runs every torchrun process as a world of
    # one (each trains alone, nothing is synchronised); `cpu=True` makes it the multi-process run
    # over gloo that the tutorial's `Accelerator()` is on GPUs.
    accelerator = Accelerator(cpu=True)
    # Build DataLoaders (CHANGED: the repository's MNIST files, as above)
    train_dset, test_dset = datasets()
    train_loader = torch.utils.data.DataLoader(train_dset, shuffle=True, batch_size=64)
    test_loader = torch.utils.data.DataLoader(test_dset, shuffle=False, batch_size=64)
    # Build model. CHANGED: the tutorial writes `BasicModel()`, a name it never defines (NameError).
    model = BasicNet()
    # Build optimizer
    optimizer = optim.AdamW(model.parameters(), lr=1e-3)
    # Send everything through `accelerator.prepare`
    train_loader, test_loader, model, optimizer = accelerator.prepare(train_loader, test_loader, model, optimizer)
    # Train for a single epoch
    model.train()
    batches = 0  # ADDED
    for batch_idx, (data, target) in enumerate(train_loader):
        output = model(data)
        loss = F.nll_loss(output, target)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        batches += 1  # ADDED
        if a.max_steps and batches >= a.max_steps:  # ADDED: a short run
            break
    # Evaluate
    model.eval()
    correct = 0
    counted = 0  # ADDED
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()
            counted += len(target)  # ADDED
    printed = f"Accuracy: {100. * correct / len(test_loader.dataset)}"
    print(printed)
    unwrapped = accelerator.unwrap_model(model)  # ADDED (from here on)
    record = {
        "rank": accelerator.process_index, "world_size": accelerator.num_processes, "printed": printed,
        "printed_accuracy": 100.0 * correct / len(test_loader.dataset),
        "train_batches_per_epoch": len(train_loader), "train_batches_run": batches,
        "test_images_counted": counted, "test_images_divided_by": len(test_loader.dataset),
        "parameter_spread": _spread_across_ranks(unwrapped) if accelerator.num_processes > 1 else 0.0,
        "true_accuracy": _true_accuracy(unwrapped, test_dset),
        "distributed_type": str(accelerator.distributed_type),
    }
    _result_path(a).write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    accelerator.end_training()


def worker_trainer(a):
    """The tutorial's Trainer listing (section "Using 🤗 Trainer"), in three stages: as published;
    with the argument Transformers has since renamed (`evaluation_strategy` → `eval_strategy`);
    and with `compute_loss` also accepting the keyword arguments Transformers now passes it. Each
    stage records how far it got."""
    import torch
    import torch.nn.functional as F
    from transformers import Trainer, TrainingArguments

    from common import BasicNet, datasets

    rank = int(os.environ.get("RANK", "0"))
    train_dset, test_dset = datasets()  # CHANGED: the repository's MNIST files
    out_dir = tempfile.mkdtemp(prefix="basic-trainer-")  # CHANGED: not ./basic-trainer

    def collate_fn(examples):
        pixel_values = torch.stack([example[0] for example in examples])
        labels = torch.tensor([example[1] for example in examples])
        return {"x": pixel_values, "labels": labels}

    class MyTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False):
            outputs = model(inputs["x"])
            target = inputs["labels"]
            loss = F.nll_loss(outputs, target)
            return (loss, outputs) if return_outputs else loss

    class MyTrainerKwargs(MyTrainer):
        """CHANGED (stage 3): compute_loss also accepts what Transformers now passes."""

        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            return super().compute_loss(model, inputs, return_outputs)

    def stage(name, eval_key, cls=MyTrainer):
        torch.manual_seed(0)  # ADDED: the same start for both stages
        model = BasicNet()
        try:
            training_args = TrainingArguments(
                out_dir,
                per_device_train_batch_size=64,
                per_device_eval_batch_size=64,
                num_train_epochs=1,
                remove_unused_columns=False,
                max_steps=a.max_steps or -1,  # ADDED: a short run
                report_to="none",  # ADDED: no experiment tracker
                save_strategy="no",  # ADDED: no checkpoint files
                **{eval_key: "epoch"},
            )
        except Exception as e:  # ADDED: how far the stage got
            return {"stage": name, "failed_at": "TrainingArguments(...)", "error": _one_line(e)}
        trainer = cls(model, training_args, train_dataset=train_dset, eval_dataset=test_dset, data_collator=collate_fn)
        try:
            trainer.train()
        except Exception as e:
            return {"stage": name, "failed_at": "trainer.train()", "error": _one_line(e), "where": _where(e)}
        last = [h for h in trainer.state.log_history if "eval_loss" in h]
        return {"stage": name, "failed_at": None, "eval": last[-1] if last else None}

    record = {"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")), "stages": [
        stage("1. as published", "evaluation_strategy"),
        stage("2. `evaluation_strategy` renamed `eval_strategy`", "eval_strategy"),
        stage("3. and `compute_loss` takes `**kwargs`", "eval_strategy", MyTrainerKwargs),
    ]}
    _result_path(a).write_text(json.dumps(record))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _one_line(e):
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0] if text else type(e).__name__


def _where(e):
    """The innermost frame of the traceback inside the tutorial's code or Transformers."""
    frames = traceback.extract_tb(e.__traceback__)
    for f in reversed(frames):
        if "transformers" in f.filename or f.filename == __file__:
            return f"{pathlib.Path(f.filename).name}:{f.lineno} in {f.name}"
    return ""


# --- The driver -------------------------------------------------------------------------------


def run_program(program, world_size, a, result_dir):
    torchrun = pathlib.Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(world_size), __file__, "--worker", program, "--result-dir", result_dir]
    if a.max_steps:
        cmd += ["--max-steps", str(a.max_steps)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    print(f"tutorial_as_published: {program} at W = {world_size}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    records = []
    for r in range(world_size):
        path = pathlib.Path(result_dir) / f"{program}-w{world_size}-rank{r}.json"
        if path.exists():
            records.append(json.loads(path.read_text()))
    if done.returncode != 0 or len(records) != world_size:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        records.append({"launch_failed": done.returncode, "tail": tail})
    return records


def pct(x):
    return f"{x:.2f}%"


def spread(x):
    return "bit-identical" if x == 0.0 else f"differ (up to {x:.2g})"


def markdown(results, a, argv, versions):
    ws = a.world_sizes
    out = ["<!-- written by bench/reference/tutorial_as_published.py; do not edit -->", ""]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "bench/reference"], cwd=REPO).returncode != 0
    out.append(
        f"Run on {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}, {versions['cpu']}, "
        f"{os.cpu_count()} cores, commit `{commit}`{' (bench/reference modified)' if dirty else ''}: "
        f"`{argv}`; torch {versions['torch']}, accelerate {versions['accelerate']}, transformers {versions['transformers']}; "
        f"{('at most ' + str(a.max_steps) + ' training steps per rank') if a.max_steps else 'one full epoch'}."
    )
    out.append("")

    def table(program, title, extra):
        if not results[program]:
            return
        out.append(f"**{title}**")
        out.append("")
        head = ["W", "batches per rank per epoch", "each rank printed", "images each rank counted", "replicas after training"] + [h for h, _ in extra]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---:|" * 2 + "---|" + "---:|" + "---|" + "---:|" * len(extra))
        for w in ws:
            recs = results[program][w]
            if any("launch_failed" in r for r in recs):
                fail = next(r for r in recs if "launch_failed" in r)
                out.append(f"| {w} | failed (exit {fail['launch_failed']}) | | | |" + " |" * len(extra))
                continue
            recs = sorted(recs, key=lambda r: r["rank"])
            batches = sorted({r["train_batches_per_epoch"] for r in recs})
            printed = ", ".join(pct(r["printed_accuracy"]) for r in recs)
            counted = ", ".join(f"{r['test_images_counted']:,}" for r in recs)
            divided = recs[0]["test_images_divided_by"]
            row = [str(w), " / ".join(f"{b:,}" for b in batches), printed, f"{counted} (÷ {divided:,})", spread(max(r["parameter_spread"] for r in recs))]
            row += [f(recs) for _, f in extra]
            out.append("| " + " | ".join(row) + " |")
        out.append("")

    table("train_ddp", "`train_ddp`, launched with `torchrun --nproc-per-node W`", [])
    table(
        "train_ddp_accelerate",
        "`train_ddp_accelerate`, launched with `torchrun --nproc-per-node W`",
        [("the model's accuracy, each image once", lambda recs: pct(recs[0]["true_accuracy"]))],
    )
    if not results["trainer"]:
        return "\n".join(out)
    out.append("**The Trainer listing** (one process; the stages run one after the other)")
    out.append("")
    out.append("| stage | outcome |")
    out.append("|---|---|")
    recs = results["trainer"][1]
    rec = next((r for r in recs if "stages" in r), None)
    if rec is None:
        out.append(f"| — | the launch failed: {recs[-1].get('tail', '').splitlines()[-1:]} |")
    else:
        for s in rec["stages"]:
            if s["failed_at"]:
                where = f" ({s['where']})" if s.get("where") else ""
                outcome = f"fails in `{s['failed_at']}`{where}: `{s['error']}`"
            elif s.get("eval"):
                outcome = f"trains and evaluates (eval_loss {s['eval']['eval_loss']:.4f})"
            else:
                outcome = "trains; no evaluation ran"
            out.append(f"| {s['stage']} | {outcome.replace('|', '&#124;')} |")
    out.append("")
    return "\n".join(out)


def versions():
    v = {}
    for mod in ("torch", "accelerate", "transformers"):
        try:
            v[mod] = __import__(mod).__version__
        except ImportError:
            v[mod] = "not installed"
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = " ".join(line.split(":", 1)[1].split()[:2])
                break
    except OSError:
        pass
    v["cpu"] = cpu
    return v


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", default="1,2,3", help="comma-separated world sizes (default 1,2,3)")
    p.add_argument("--max-steps", type=int, default=200, help="training steps per rank; 0 = one full epoch (default 200)")
    p.add_argument("--programs", default=",".join(PROGRAMS), help=f"comma-separated, of {', '.join(PROGRAMS)} (default: all)")
    p.add_argument("--out", default=None, help="the Markdown report (default: stdout)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per launch (default 1800)")
    p.add_argument("--worker", choices=PROGRAMS, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        sys.path.insert(0, str(HERE))
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        {"train_ddp": worker_train_ddp, "train_ddp_accelerate": worker_train_ddp_accelerate, "trainer": worker_trainer}[a.worker](a)
        return
    try:
        a.world_sizes = [int(w) for w in a.world_sizes.split(",")]
        if any(w < 1 for w in a.world_sizes):
            raise ValueError
    except ValueError:
        p.error(f"--world-sizes {a.world_sizes!r}: expected comma-separated integers of at least 1")
    argv = " ".join(["bench/reference/tutorial_as_published.py"] + [shlex.quote(x) for x in sys.argv[1:]])
    programs = a.programs.split(",")
    if not set(programs) <= set(PROGRAMS):
        p.error(f"--programs {a.programs!r}: expected some of {', '.join(PROGRAMS)}")
    results = {prog: {} for prog in PROGRAMS}
    with tempfile.TemporaryDirectory(prefix="tutorial-as-published-") as tmp:
        for program in ("train_ddp", "train_ddp_accelerate"):
            for w in a.world_sizes if program in programs else []:
                results[program][w] = run_program(program, w, a, tmp)
        if "trainer" in programs:
            results["trainer"][1] = run_program("trainer", 1, a, tmp)
    text = markdown(results, a, argv, versions())
    if a.out:
        pathlib.Path(a.out).write_text(text + "\n")
        print(f"tutorial_as_published: wrote {a.out}", file=sys.stderr)
    else:
        print(text)
    failed = [f"{p} at W = {w}" for p in ("train_ddp", "train_ddp_accelerate") for w, recs in results[p].items() if any("launch_failed" in r for r in recs)]
    if failed:
        for p_ in ("train_ddp", "train_ddp_accelerate"):
            for w, recs in results[p_].items():
                for r in recs:
                    if "launch_failed" in r:
                        print(f"--- {p_} at W = {w}:\n{r['tail']}", file=sys.stderr)
        sys.exit(f"tutorial_as_published: {', '.join(failed)} failed")


if __name__ == "__main__":
    main()
