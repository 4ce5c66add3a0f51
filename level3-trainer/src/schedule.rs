//! Planning (how many optimization steps a run takes) and the learning-rate schedules, as
//! Transformers' `Trainer._inner_training_loop` and `transformers.optimization.get_scheduler`.
//!
//! # Planning
//! Each of `W` processes sees `ceil(len / W)` samples per epoch (a `DistributedSampler` pads
//! the last ranks with repeated samples), in `ceil(ceil(len / W) / B)` micro-batches
//! (`floor` with `dataloader_drop_last`). `A` micro-batches make one optimization step, and the
//! short last window of every epoch is a step too: `ceil(batches / A)` updates per epoch. The
//! run takes `max_steps` updates if that is > 0, else `ceil(num_train_epochs × updates per
//! epoch)`. Example: 60,000 images, W = 1, B = 64, A = 4, 3 epochs → 938 batches → 235
//! updates per epoch → 705.
//!
//! # Warm-up and step convention
//! Updates are numbered from 0. Update `k` uses `learning_rate × λ(k)`, where `λ` is
//! Transformers' lambda for the schedule, so the first update of a warm-up runs at rate 0
//! (λ(0) = 0/warmup) exactly as a PyTorch `LambdaLR` stepped after each `optimizer.step()`.
//! The warm-up length is `warmup_steps` if > 0, else `ceil(warmup_ratio × total)`.
//! The `learning_rate` logged for global step `s` (1-based, the count after the update) is
//! the rate that step's update used: `learning_rate × λ(s − 1)` (Transformers logs the rate
//! of the *next* update; this Trainer does not).

use crate::args::{SchedulerType, TrainingArguments};
use serde::{Deserialize, Serialize};

/// How long a run is, in Transformers' terms.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TrainingPlan {
    /// Training examples in the dataset (before any sharding).
    pub num_examples: usize,
    /// Processes training (the world size).
    pub world_size: usize,
    /// Samples each process sees per epoch: `ceil(num_examples / world_size)`.
    pub samples_per_rank: usize,
    /// Micro-batches per process per epoch.
    pub batches_per_epoch: usize,
    /// Optimization steps per epoch (the short last accumulation window counts).
    pub updates_per_epoch: usize,
    /// Optimization steps of the whole run ("Total optimization steps").
    pub max_steps: usize,
    /// Epochs the run starts (`ceil(max_steps / updates_per_epoch)`; the last may be partial).
    pub num_epochs: usize,
    /// Samples per optimization step over all processes: `B × A × W`.
    pub total_train_batch_size: usize,
}

impl TrainingPlan {
    /// Plans a run over `num_examples` training samples on `world_size` processes.
    ///
    /// Expects validated arguments (`TrainingArguments::validate`); `num_examples` and
    /// `world_size` ≥ 1. An epoch with no full batch under `dataloader_drop_last` plans 0 steps.
    pub fn new(args: &TrainingArguments, num_examples: usize, world_size: usize) -> Self {
        let (w, b, a) = (world_size.max(1), args.per_device_train_batch_size.max(1), args.gradient_accumulation_steps.max(1));
        let samples_per_rank = num_examples.div_ceil(w);
        let batches_per_epoch = if args.dataloader_drop_last { samples_per_rank / b } else { samples_per_rank.div_ceil(b) };
        let updates_per_epoch = batches_per_epoch.div_ceil(a);
        let max_steps =
            if args.max_steps > 0 { args.max_steps as usize } else { (args.num_train_epochs * updates_per_epoch as f64).ceil() as usize };
        let num_epochs = if updates_per_epoch == 0 { 0 } else { max_steps.div_ceil(updates_per_epoch) };
        Self {
            num_examples,
            world_size: w,
            samples_per_rank,
            batches_per_epoch,
            updates_per_epoch,
            max_steps,
            num_epochs,
            total_train_batch_size: b * a * w,
        }
    }

    /// The micro-batches of update `k` (0-based within its epoch): `A`, except the short last
    /// window of the epoch.
    pub fn batches_in_update(&self, k: usize, accumulation: usize) -> usize {
        let start = k * accumulation;
        accumulation.min(self.batches_per_epoch.saturating_sub(start))
    }
}

/// A learning-rate schedule over a planned run: `rate(k)` for update `k` (0-based), as
/// Transformers' `get_scheduler(name, optimizer, num_warmup_steps, num_training_steps)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    /// Which schedule.
    pub kind: SchedulerType,
    /// The peak (base) learning rate.
    pub base_lr: f64,
    /// Warm-up steps.
    pub warmup_steps: usize,
    /// Total optimization steps.
    pub total_steps: usize,
}

impl LrSchedule {
    /// The schedule `args` ask for over `total_steps` updates; warm-up is `warmup_steps` if
    /// > 0, else `ceil(warmup_ratio × total_steps)` (Transformers' `get_warmup_steps`).
    pub fn new(args: &TrainingArguments, total_steps: usize) -> Self {
        let warmup_steps = if args.warmup_steps > 0 { args.warmup_steps } else { (args.warmup_ratio * total_steps as f64).ceil() as usize };
        Self { kind: args.lr_scheduler_type, base_lr: args.learning_rate, warmup_steps, total_steps }
    }

    /// The multiplier λ(k) of update `k` (0-based), Transformers' lambdas:
    /// * warm-up (`k < warmup`, all but `constant`): `k / max(1, warmup)`;
    /// * `linear`: `max(0, (total − k) / max(1, total − warmup))`;
    /// * `cosine`: `max(0, ½(1 + cos(π · (k − warmup) / max(1, total − warmup))))`;
    /// * `constant`, `constant_with_warmup` after warm-up: 1.
    pub fn lambda(&self, k: usize) -> f64 {
        let (k, warmup, total) = (k as f64, self.warmup_steps as f64, self.total_steps as f64);
        if self.kind != SchedulerType::Constant && k < warmup {
            return k / warmup.max(1.0);
        }
        match self.kind {
            SchedulerType::Constant | SchedulerType::ConstantWithWarmup => 1.0,
            SchedulerType::Linear => ((total - k) / (total - warmup).max(1.0)).max(0.0),
            SchedulerType::Cosine => {
                let progress = (k - warmup) / (total - warmup).max(1.0);
                (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0)
            }
        }
    }

    /// The learning rate update `k` (0-based) uses: `base_lr × λ(k)`.
    pub fn rate(&self, k: usize) -> f64 {
        self.base_lr * self.lambda(k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(b: usize, a: usize) -> TrainingArguments {
        TrainingArguments { per_device_train_batch_size: b, gradient_accumulation_steps: a, ..TrainingArguments::default() }
    }

    #[test]
    fn three_epochs_accumulation_four_is_705_updates() {
        let plan = TrainingPlan::new(&args(64, 4), 60_000, 1);
        assert_eq!((plan.batches_per_epoch, plan.updates_per_epoch, plan.max_steps), (938, 235, 705));
        assert_eq!(plan.total_train_batch_size, 256);
        assert_eq!(plan.num_epochs, 3);
        // 938 = 234 × 4 + 2: the short last window holds 2 micro-batches.
        assert_eq!(plan.batches_in_update(233, 4), 4);
        assert_eq!(plan.batches_in_update(234, 4), 2);
    }

    #[test]
    fn one_epoch_batch_64_is_938_steps_and_world_size_shards() {
        let mut a = args(64, 1);
        a.num_train_epochs = 1.0;
        assert_eq!(TrainingPlan::new(&a, 60_000, 1).max_steps, 938);
        // W = 2: 30,000 per rank → 469 batches. W = 3: 20,000 → 313. W = 7: ceil(60000/7) = 8572 → 134.
        assert_eq!(TrainingPlan::new(&a, 60_000, 2).max_steps, 469);
        assert_eq!(TrainingPlan::new(&a, 60_000, 3).max_steps, 313);
        assert_eq!(TrainingPlan::new(&a, 60_000, 7).samples_per_rank, 8572);
        assert_eq!(TrainingPlan::new(&a, 60_000, 7).max_steps, 134);
        a.dataloader_drop_last = true;
        assert_eq!(TrainingPlan::new(&a, 60_000, 1).max_steps, 937);
        a.gradient_accumulation_steps = 3; // 469 batches at W=2 → 157 updates (last window 1 batch)
        a.dataloader_drop_last = false;
        assert_eq!(TrainingPlan::new(&a, 60_000, 2).max_steps, 157);
        assert_eq!(TrainingPlan::new(&a, 60_000, 2).total_train_batch_size, 64 * 3 * 2);
    }

    #[test]
    fn max_steps_overrides_epochs_and_fractional_epochs_round_up() {
        let mut a = args(64, 4);
        a.max_steps = 500;
        let plan = TrainingPlan::new(&a, 60_000, 1);
        assert_eq!((plan.max_steps, plan.num_epochs), (500, 3)); // 235 + 235 + 30
        a.max_steps = -1;
        a.num_train_epochs = 0.5;
        assert_eq!(TrainingPlan::new(&a, 60_000, 1).max_steps, 118); // ceil(117.5)
    }

    #[test]
    fn linear_with_warmup_closed_form() {
        let mut a = args(8, 1);
        a.learning_rate = 1.0;
        a.warmup_steps = 4;
        let s = LrSchedule::new(&a, 10);
        let rates: Vec<f64> = (0..11).map(|k| s.rate(k)).collect();
        // warm-up 0, 1/4, 2/4, 3/4; then (10 − k)/6 for k = 4..10.
        let want = [0.0, 0.25, 0.5, 0.75, 1.0, 5.0 / 6.0, 4.0 / 6.0, 0.5, 2.0 / 6.0, 1.0 / 6.0, 0.0];
        for (k, (r, w)) in rates.iter().zip(want).enumerate() {
            assert!((r - w).abs() < 1e-15, "k={k}: {r} vs {w}");
        }
    }

    #[test]
    fn warmup_ratio_rounds_up_and_warmup_steps_wins() {
        let mut a = args(8, 1);
        a.warmup_ratio = 0.1;
        assert_eq!(LrSchedule::new(&a, 705).warmup_steps, 71); // ceil(70.5)
        a.warmup_steps = 3;
        assert_eq!(LrSchedule::new(&a, 705).warmup_steps, 3);
    }

    #[test]
    fn cosine_constant_and_constant_with_warmup_closed_form() {
        let mut a = args(8, 1);
        a.learning_rate = 2.0;
        a.warmup_steps = 2;
        a.lr_scheduler_type = SchedulerType::Cosine;
        let s = LrSchedule::new(&a, 10);
        assert_eq!((s.rate(0), s.rate(1), s.rate(2)), (0.0, 1.0, 2.0));
        // k = 6: progress 4/8 = ½ → ½(1 + cos(π/2)) = ½.
        assert!((s.rate(6) - 1.0).abs() < 1e-15);
        assert!((s.rate(4) - (1.0 + (std::f64::consts::PI / 4.0).cos())).abs() < 1e-15);
        assert!(s.rate(10).abs() < 1e-15);
        a.lr_scheduler_type = SchedulerType::ConstantWithWarmup;
        let s = LrSchedule::new(&a, 10);
        assert_eq!((0..5).map(|k| s.rate(k)).collect::<Vec<_>>(), [0.0, 1.0, 2.0, 2.0, 2.0]);
        a.lr_scheduler_type = SchedulerType::Constant; // warm-up ignored, as Transformers' `constant`
        let s = LrSchedule::new(&a, 10);
        assert!((0..10).all(|k| s.rate(k) == 2.0));
    }

    #[test]
    fn linear_without_warmup_ends_at_zero_on_the_last_planned_step() {
        let a = TrainingArguments { learning_rate: 5e-5, ..args(64, 4) };
        let plan = TrainingPlan::new(&a, 60_000, 1);
        let s = LrSchedule::new(&a, plan.max_steps);
        assert_eq!(s.rate(0), 5e-5);
        // The last update (k = 704) runs at 5e-5 × 1/705; after it the schedule is at 0.
        assert!((s.rate(704) - 5e-5 / 705.0).abs() < 1e-20);
        assert_eq!(s.rate(705), 0.0);
    }
}
