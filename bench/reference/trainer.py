"""🤗 Transformers `Trainer` — the peer of level3-trainer: BasicNet as the model, a `compute_loss`
override, `TrainingArguments`, under torchrun (N processes, gloo on CPU).

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \
        bench/reference/trainer.py [--max-steps N]

The recipe is level 3's `recipe_arguments()`: per-device batch 64, AdamW (adamw_torch) lr 1e-3,
weight_decay 0.01, constant schedule, no warm-up, no clipping (max_grad_norm 0), seed 1. Where it
differs: no checkpoints (save_strategy "no"; level 3 saves model.safetensors at the end, outside the
timed steps), no logging during training, and one `trainer.evaluate()` after training instead of
eval_strategy "epoch" (the same evaluation for a one-epoch or --max-steps run). Step timing comes
from a TrainerCallback plus laps in compute_loss (common.StepTimer); rank 0 prints one JSON line.
"""
import json
import os
import shutil
import tempfile
import time

import torch
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback, TrainingArguments

from common import peer_arguments, BasicNet, StepTimer, datasets, gathered_timing_fields, finish

TIMER = {}


class MyTrainer(Trainer):
    """The tutorial's MyTrainer: compute_loss = nll_loss(model(x), labels)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        timer = TIMER.get("t")
        if timer is not None and model.training:
            timer.lap("data")
            TIMER["samples"] = len(inputs["labels"])
        outputs = model(inputs["x"])
        loss = F.nll_loss(outputs, inputs["labels"])
        if timer is not None and model.training:
            timer.lap("forward")
        # A dict, so that prediction_step takes the logits whole (a bare tensor would be sliced
        # as if it were a (loss, logits, ...) tuple: outputs[1:]).
        return (loss, {"logits": outputs}) if return_outputs else loss


class Timing(TrainerCallback):
    """Starts the StepTimer with training; backward ends before the optimizer step."""

    def on_train_begin(self, args, state, control, **kw):
        TIMER["t"] = StepTimer()

    def on_pre_optimizer_step(self, args, state, control, **kw):
        TIMER["t"].lap("backward")

    def on_step_end(self, args, state, control, **kw):
        TIMER["t"].end_step("optimizer", TIMER.get("samples", 0))


def collate_fn(examples):
    return {"x": torch.stack([x for x, _ in examples]), "labels": torch.tensor([y for _, y in examples])}


def compute_metrics(p):
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}


def main():
    a = peer_arguments()
    start = time.perf_counter()
    out = tempfile.mkdtemp(prefix="hf-trainer-peer-")
    try:
        run(a, start, out)  # ends the process on success (common.finish)
    finally:
        shutil.rmtree(out, ignore_errors=True)  # on failure; save_strategy "no": nothing in it is kept


def run(a, start, out):
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=a.batch_size, per_device_eval_batch_size=1000,
        num_train_epochs=1, max_steps=a.max_steps or -1, learning_rate=a.lr, weight_decay=0.01,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0, optim="adamw_torch",
        seed=a.seed, eval_strategy="no", save_strategy="no", logging_strategy="no", report_to="none",
        disable_tqdm=True, use_cpu=True, label_names=["labels"], remove_unused_columns=False,
        dataloader_num_workers=0, ddp_find_unused_parameters=False,
    )
    world = args.world_size
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    torch.manual_seed(a.seed)
    train, test = datasets()
    trainer = MyTrainer(model=BasicNet(), args=args, train_dataset=train, eval_dataset=test,
                        data_collator=collate_fn, compute_metrics=compute_metrics, callbacks=[Timing()])
    result = trainer.train()
    timing = gathered_timing_fields(TIMER["t"])
    metrics = trainer.evaluate()
    if args.process_index == 0:
        print(json.dumps(dict(timing, **{
            "impl": "hf-trainer", "transformers": __import__("transformers").__version__, "world_size": world,
            "threads": torch.get_num_threads(), "steps": result.global_step, "accuracy": metrics["eval_accuracy"],
            "eval_samples": len(test), "test_loss": metrics["eval_loss"], "wall_s": time.perf_counter() - start,
        })), flush=True)
    shutil.rmtree(out, ignore_errors=True)
    finish()  # while the trainer (and its DDP model) is still referenced: see common.finish


if __name__ == "__main__":
    main()
