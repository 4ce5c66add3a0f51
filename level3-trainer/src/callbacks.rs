//! Callbacks, as Transformers' `TrainerCallback`: hooks the Trainer calls at fixed points of
//! the loop, each receiving the arguments, the state and a [`TrainerControl`] whose flags steer
//! the loop. [`DefaultFlowCallback`] turns the logging/eval/save strategies into those flags
//! (the Trainer always runs it first); [`EarlyStoppingCallback`] stops training when the best
//! metric stops improving; [`CallbackHandler`] holds a Trainer's callbacks and calls each event
//! on all of them.

use crate::args::{IntervalStrategy, TrainingArguments};
use crate::error::{Error, Result};
use crate::state::{LogEntry, Metrics, TrainerState};

/// Flags callbacks set to steer the loop (Transformers' `TrainerControl`). The Trainer acts on
/// them right after the hook and resets the ones it acted on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrainerControl {
    /// Stop training after this step (the end-of-training steps still run).
    pub should_training_stop: bool,
    /// Stop the current epoch after this step.
    pub should_epoch_stop: bool,
    /// Write a checkpoint now.
    pub should_save: bool,
    /// Evaluate now.
    pub should_evaluate: bool,
    /// Log the training loss now.
    pub should_log: bool,
}

/// Hooks into the Trainer's loop; every method has a no-op default. Called on every process,
/// in the order the callbacks were added (after [`DefaultFlowCallback`]).
pub trait TrainerCallback {
    /// A short name for messages.
    fn name(&self) -> &'static str {
        "TrainerCallback"
    }
    /// Before the first step (after planning: `state.max_steps` is set).
    ///
    /// # Errors
    /// A callback may refuse arguments it cannot work with; training does not start.
    fn on_train_begin(&mut self, _args: &TrainingArguments, _state: &TrainerState, _control: &mut TrainerControl) -> Result<()> {
        Ok(())
    }
    /// After each optimization step (`state.global_step` counts it).
    fn on_step_end(&mut self, _args: &TrainingArguments, _state: &TrainerState, _control: &mut TrainerControl) {}
    /// After each epoch's last step.
    fn on_epoch_end(&mut self, _args: &TrainingArguments, _state: &TrainerState, _control: &mut TrainerControl) {}
    /// After an entry was added to the log history.
    fn on_log(&mut self, _args: &TrainingArguments, _state: &TrainerState, _control: &mut TrainerControl, _logs: &LogEntry) {}
    /// After an evaluation, before the best metric is updated (`state.best_metric` is the
    /// previous best).
    fn on_evaluate(&mut self, _args: &TrainingArguments, _state: &TrainerState, _control: &mut TrainerControl, _metrics: &Metrics) {}
    /// After a checkpoint was written.
    fn on_save(&mut self, _args: &TrainingArguments, _state: &TrainerState, _control: &mut TrainerControl) {}
    /// After the last step and the end-of-training work.
    fn on_train_end(&mut self, _args: &TrainingArguments, _state: &TrainerState, _control: &mut TrainerControl) {}
}

/// Sets `should_log`, `should_evaluate`, `should_save` and `should_training_stop` from the
/// strategies, as Transformers' `DefaultFlowCallback`:
/// * steps strategies fire when `global_step` is a multiple of logging/eval/save_steps;
///   logging_first_step also logs step 1;
/// * epoch strategies fire at each epoch's end;
/// * at `max_steps` training stops; with the steps strategies the final weights are also
///   evaluated and saved (unless that step already was an evaluation/save step, which is the
///   same thing).
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultFlowCallback;

impl TrainerCallback for DefaultFlowCallback {
    fn name(&self) -> &'static str {
        "DefaultFlowCallback"
    }
    fn on_step_end(&mut self, args: &TrainingArguments, state: &TrainerState, control: &mut TrainerControl) {
        let step = state.global_step;
        let every = |n: usize| n > 0 && step % n as u64 == 0;
        if step == 1 && args.logging_first_step {
            control.should_log = true;
        }
        if args.logging_strategy == IntervalStrategy::Steps && every(args.logging_steps) {
            control.should_log = true;
        }
        if args.eval_strategy == IntervalStrategy::Steps && every(args.eval_steps()) {
            control.should_evaluate = true;
        }
        if args.save_strategy == IntervalStrategy::Steps && every(args.save_steps) {
            control.should_save = true;
        }
        if step >= state.max_steps {
            control.should_training_stop = true;
            if args.eval_strategy == IntervalStrategy::Steps {
                control.should_evaluate = true;
            }
            if args.save_strategy == IntervalStrategy::Steps {
                control.should_save = true;
            }
        }
    }
    fn on_epoch_end(&mut self, args: &TrainingArguments, _state: &TrainerState, control: &mut TrainerControl) {
        if args.logging_strategy == IntervalStrategy::Epoch {
            control.should_log = true;
        }
        if args.eval_strategy == IntervalStrategy::Epoch {
            control.should_evaluate = true;
        }
        if args.save_strategy == IntervalStrategy::Epoch {
            control.should_save = true;
        }
    }
}

/// Stops training when metric_for_best_model has not improved for `patience` evaluations in a
/// row, as Transformers' `EarlyStoppingCallback(early_stopping_patience,
/// early_stopping_threshold)`: an evaluation improves when it is better than
/// `state.best_metric` (in the direction greater_is_better says) by more than `threshold`, or
/// when there is no best yet. Needs load_best_model_at_end, a metric_for_best_model (or its
/// `loss` default) and an eval_strategy other than `no`.
#[derive(Debug, Clone, PartialEq)]
pub struct EarlyStoppingCallback {
    /// Evaluations without improvement that stop training.
    pub patience: usize,
    /// The least change that counts as an improvement.
    pub threshold: f64,
    /// Evaluations without improvement so far.
    pub patience_counter: usize,
}

impl EarlyStoppingCallback {
    /// A callback with `patience` (Transformers' default 1) and `threshold` (default 0.0).
    pub fn new(patience: usize, threshold: f64) -> Self {
        Self { patience, threshold, patience_counter: 0 }
    }
}

impl TrainerCallback for EarlyStoppingCallback {
    fn name(&self) -> &'static str {
        "EarlyStoppingCallback"
    }
    fn on_train_begin(&mut self, args: &TrainingArguments, _state: &TrainerState, _control: &mut TrainerControl) -> Result<()> {
        let problem = if !args.load_best_model_at_end {
            Some("needs load_best_model_at_end = true")
        } else if args.eval_strategy == IntervalStrategy::No {
            Some("needs an eval_strategy of `steps` or `epoch`")
        } else if !(self.threshold.is_finite() && self.threshold >= 0.0) {
            Some("needs a finite threshold ≥ 0")
        } else {
            None
        };
        match problem {
            Some(p) => Err(Error::Callback { callback: "EarlyStoppingCallback", problem: p.into() }),
            None => Ok(()),
        }
    }
    fn on_evaluate(&mut self, args: &TrainingArguments, state: &TrainerState, control: &mut TrainerControl, metrics: &Metrics) {
        let Some(value) = args.best_metric_key().and_then(|k| metrics.get(&k).copied()) else {
            return;
        };
        let improved = match state.best_metric {
            None => true,
            Some(best) => {
                let better = if args.greater_is_better() { value > best } else { value < best };
                better && (value - best).abs() > self.threshold
            }
        };
        self.patience_counter = if improved { 0 } else { self.patience_counter + 1 };
        if self.patience_counter >= self.patience {
            control.should_training_stop = true;
        }
    }
}

/// The callbacks of one Trainer, as Transformers' `CallbackHandler`: [`DefaultFlowCallback`]
/// first, then the callbacks added, in order. Each event is called on every callback with the
/// same [`TrainerControl`], so a callback sees the flags the ones before it set; the event
/// returns the control they leave.
pub struct CallbackHandler {
    callbacks: Vec<Box<dyn TrainerCallback>>,
}

impl Default for CallbackHandler {
    fn default() -> Self {
        Self { callbacks: vec![Box::new(DefaultFlowCallback)] }
    }
}

impl std::fmt::Debug for CallbackHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.callbacks.iter().map(|cb| cb.name())).finish()
    }
}

impl CallbackHandler {
    /// Adds a callback after the ones already held (Transformers' `add_callback`).
    pub fn add_callback(&mut self, callback: impl TrainerCallback + 'static) {
        self.callbacks.push(Box::new(callback));
    }

    /// The callbacks' names, in calling order (Transformers' `callback_list`, as a list).
    pub fn callback_list(&self) -> Vec<&'static str> {
        self.callbacks.iter().map(|cb| cb.name()).collect()
    }

    fn call_event(
        &mut self,
        mut control: TrainerControl,
        mut event: impl FnMut(&mut dyn TrainerCallback, &mut TrainerControl),
    ) -> TrainerControl {
        for cb in &mut self.callbacks {
            event(cb.as_mut(), &mut control);
        }
        control
    }

    /// [`TrainerCallback::on_train_begin`] on every callback.
    ///
    /// # Errors
    /// The first callback's refusal; the callbacks after it are not called.
    pub fn on_train_begin(
        &mut self,
        args: &TrainingArguments,
        state: &TrainerState,
        mut control: TrainerControl,
    ) -> Result<TrainerControl> {
        for cb in &mut self.callbacks {
            cb.on_train_begin(args, state, &mut control)?;
        }
        Ok(control)
    }

    /// [`TrainerCallback::on_step_end`] on every callback.
    #[must_use]
    pub fn on_step_end(&mut self, args: &TrainingArguments, state: &TrainerState, control: TrainerControl) -> TrainerControl {
        self.call_event(control, |cb, c| cb.on_step_end(args, state, c))
    }

    /// [`TrainerCallback::on_epoch_end`] on every callback.
    #[must_use]
    pub fn on_epoch_end(&mut self, args: &TrainingArguments, state: &TrainerState, control: TrainerControl) -> TrainerControl {
        self.call_event(control, |cb, c| cb.on_epoch_end(args, state, c))
    }

    /// [`TrainerCallback::on_log`] on every callback.
    #[must_use]
    pub fn on_log(&mut self, args: &TrainingArguments, state: &TrainerState, control: TrainerControl, logs: &LogEntry) -> TrainerControl {
        self.call_event(control, |cb, c| cb.on_log(args, state, c, logs))
    }

    /// [`TrainerCallback::on_evaluate`] on every callback.
    #[must_use]
    pub fn on_evaluate(
        &mut self,
        args: &TrainingArguments,
        state: &TrainerState,
        control: TrainerControl,
        metrics: &Metrics,
    ) -> TrainerControl {
        self.call_event(control, |cb, c| cb.on_evaluate(args, state, c, metrics))
    }

    /// [`TrainerCallback::on_save`] on every callback.
    #[must_use]
    pub fn on_save(&mut self, args: &TrainingArguments, state: &TrainerState, control: TrainerControl) -> TrainerControl {
        self.call_event(control, |cb, c| cb.on_save(args, state, c))
    }

    /// [`TrainerCallback::on_train_end`] on every callback.
    #[must_use]
    pub fn on_train_end(&mut self, args: &TrainingArguments, state: &TrainerState, control: TrainerControl) -> TrainerControl {
        self.call_event(control, |cb, c| cb.on_train_end(args, state, c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn steps_args() -> TrainingArguments {
        TrainingArguments {
            logging_steps: 10,
            logging_first_step: true,
            eval_strategy: IntervalStrategy::Steps,
            eval_steps: Some(20),
            save_steps: 40,
            ..TrainingArguments::default()
        }
    }

    fn flags_at(args: &TrainingArguments, step: u64, max_steps: u64) -> TrainerControl {
        let state = TrainerState { global_step: step, max_steps, ..Default::default() };
        let mut c = TrainerControl::default();
        DefaultFlowCallback.on_step_end(args, &state, &mut c);
        c
    }

    #[test]
    fn default_flow_fires_on_multiples_and_at_the_end() {
        let a = steps_args();
        let c = |log, evaluate, save, stop| TrainerControl {
            should_log: log,
            should_evaluate: evaluate,
            should_save: save,
            should_training_stop: stop,
            ..Default::default()
        };
        assert_eq!(flags_at(&a, 1, 50), c(true, false, false, false)); // logging_first_step
        assert_eq!(flags_at(&a, 2, 50), c(false, false, false, false));
        assert_eq!(flags_at(&a, 10, 50), c(true, false, false, false));
        assert_eq!(flags_at(&a, 20, 50), c(true, true, false, false));
        assert_eq!(flags_at(&a, 40, 50), c(true, true, true, false));
        // The last step (50) is neither an eval nor a save step: evaluated and saved anyway.
        assert_eq!(flags_at(&a, 50, 50), c(true, true, true, true));
        let epochs = TrainingArguments {
            logging_strategy: IntervalStrategy::Epoch,
            eval_strategy: IntervalStrategy::Epoch,
            save_strategy: IntervalStrategy::Epoch,
            ..TrainingArguments::default()
        };
        assert_eq!(flags_at(&epochs, 500, 938), c(false, false, false, false));
        let mut ctl = TrainerControl::default();
        DefaultFlowCallback.on_epoch_end(&epochs, &TrainerState::default(), &mut ctl);
        assert_eq!(ctl, c(true, true, true, false));
    }

    fn evaluate(cb: &mut EarlyStoppingCallback, args: &TrainingArguments, best: Option<f64>, value: f64) -> bool {
        let state = TrainerState { best_metric: best, ..Default::default() };
        let mut c = TrainerControl::default();
        let metrics: Metrics = [(args.best_metric_key().unwrap(), value)].into_iter().collect();
        cb.on_evaluate(args, &state, &mut c, &metrics);
        c.should_training_stop
    }

    #[test]
    fn early_stopping_counts_evaluations_without_improvement_beyond_threshold() {
        let args = TrainingArguments {
            load_best_model_at_end: true,
            eval_strategy: IntervalStrategy::Epoch,
            save_strategy: IntervalStrategy::Epoch,
            ..Default::default()
        };
        let mut cb = EarlyStoppingCallback::new(2, 0.01);
        cb.on_train_begin(&args, &TrainerState::default(), &mut TrainerControl::default()).unwrap();
        // eval_loss, lower is better.
        assert!(!evaluate(&mut cb, &args, None, 1.0)); // first: improves
        assert!(!evaluate(&mut cb, &args, Some(1.0), 0.995)); // better by 0.005 ≤ threshold: 1
        assert_eq!(cb.patience_counter, 1);
        assert!(!evaluate(&mut cb, &args, Some(1.0), 0.5)); // improves: counter back to 0
        assert_eq!(cb.patience_counter, 0);
        assert!(!evaluate(&mut cb, &args, Some(0.5), 0.6)); // worse: 1
        assert!(evaluate(&mut cb, &args, Some(0.5), 0.5)); // equal: 2 = patience → stop
                                                           // accuracy, greater is better (default from the name).
        let acc = TrainingArguments { metric_for_best_model: Some("accuracy".into()), ..args.clone() };
        let mut cb = EarlyStoppingCallback::new(1, 0.0);
        assert!(!evaluate(&mut cb, &acc, Some(0.9), 0.95));
        assert!(evaluate(&mut cb, &acc, Some(0.95), 0.94));
    }

    /// Records the should_log it sees at each event, then clears it.
    struct Probe {
        name: &'static str,
        seen: std::rc::Rc<std::cell::RefCell<Vec<(&'static str, bool)>>>,
    }

    impl TrainerCallback for Probe {
        fn on_train_begin(&mut self, _: &TrainingArguments, _: &TrainerState, control: &mut TrainerControl) -> Result<()> {
            self.seen.borrow_mut().push((self.name, control.should_log));
            Ok(())
        }
        fn on_step_end(&mut self, _: &TrainingArguments, _: &TrainerState, control: &mut TrainerControl) {
            self.seen.borrow_mut().push((self.name, control.should_log));
            control.should_log = false;
        }
    }

    #[test]
    fn handler_runs_default_flow_first_then_the_callbacks_in_order_on_one_control() {
        let seen = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
        let mut handler = CallbackHandler::default();
        handler.add_callback(Probe { name: "a", seen: seen.clone() });
        handler.add_callback(Probe { name: "b", seen: seen.clone() });
        assert_eq!(handler.callback_list(), ["DefaultFlowCallback", "TrainerCallback", "TrainerCallback"]);
        let state = TrainerState { global_step: 10, max_steps: 50, ..Default::default() };
        // DefaultFlowCallback asks for a log at step 10; `a` sees it and clears it, `b` sees it cleared.
        let control = handler.on_step_end(&steps_args(), &state, TrainerControl::default());
        assert_eq!(*seen.borrow(), [("a", true), ("b", false)]);
        assert_eq!(control, TrainerControl::default());
        // A refusal in on_train_begin stops the event: the callbacks after it are not called.
        handler.add_callback(EarlyStoppingCallback::new(1, 0.0));
        handler.add_callback(Probe { name: "c", seen: seen.clone() });
        seen.borrow_mut().clear();
        let err = handler.on_train_begin(&TrainingArguments::default(), &TrainerState::default(), TrainerControl::default()).unwrap_err();
        assert_eq!(err.to_string(), "EarlyStoppingCallback: needs load_best_model_at_end = true");
        assert_eq!(*seen.borrow(), [("a", false), ("b", false)]);
    }

    #[test]
    fn early_stopping_refuses_runs_without_best_model_tracking() {
        let mut cb = EarlyStoppingCallback::new(1, 0.0);
        let err = cb.on_train_begin(&TrainingArguments::default(), &TrainerState::default(), &mut TrainerControl::default()).unwrap_err();
        assert_eq!(err.to_string(), "EarlyStoppingCallback: needs load_best_model_at_end = true");
    }
}
