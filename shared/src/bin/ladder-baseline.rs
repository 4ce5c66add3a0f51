//! ladder-baseline — the single-process reference: PyTorch's MNIST example loop on BasicNet,
//! one process, all cores, no process group. What the three levels are measured against.
//!
//! Launch: `ladder-baseline` (or `make demo`). One epoch reaches ~98% test accuracy.

use clap::Parser;
use ladder_core::data::DataLoader;
use ladder_core::eval::{evaluate, EvalSums};
use ladder_core::metrics::Report;
use ladder_core::model::{BasicNet, BasicNetConfig};
use ladder_core::recipe::{adamw, batch_loss, end_of_epoch, save_weights, seed_batch, TrainArgs, WEIGHTS_FILE};
use ladder_core::timing::Phase;
use ladder_core::{Error, Result};
use std::process::ExitCode;
use std::time::Instant;
use tch::nn;

/// Single-process BasicNet on MNIST (the baseline every level is compared with).
#[derive(Debug, Parser)]
#[command(
    name = "ladder-baseline",
    version,
    allow_negative_numbers = true,
    // The shared flags' texts mention ranks; the baseline has none.
    mut_arg("batch_size", |a| a.help("Samples per optimizer step")),
    mut_arg("device", |a| a.help("Device to train on: cpu, or cuda (the first GPU). Default: cuda if available, else cpu").hide_possible_values(true)),
    // One process: no collective to time out; the tutorial's loop has no divergence check.
    mut_arg("timeout", |a| a.hide(true)),
    mut_arg("allow_non_finite", |a| a.hide(true)),
    mut_arg("save_model", |a| a.help("Save the trained weights to this file as safetensors (keys `conv1.weight`, …), as the tutorial's `--save-model`")),
    after_help = "Environment:\n  MNIST_DIR, MNIST_MIRRORS\n      see --data-dir and --mirror\n  WORLD_SIZE\n      above 1 (set by a launcher), refused: the baseline is one process;\n      level1-raw-ddp trains with several"
)]
struct Cli {
    #[command(flatten)]
    train: TrainArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = run(&cli.train);
    ladder_core::metrics::finish(result, |r| r.figures_line())
}

/// Runs the single-process baseline: BasicNet on MNIST, the tutorial's loop, then evaluation
/// over the whole test set. Intra-op threads = all cores.
///
/// # Errors
/// Invalid flags, data errors, an unavailable device.
fn run(args: &TrainArgs) -> Result<Report> {
    let start = Instant::now();
    args.validate()?;
    let env = ladder_core::dist::DistEnv::from_env()?;
    if env.world_size > 1 {
        return Err(Error::Env(format!(
            "ladder-baseline is the single-process reference, but this process was started as rank {} of {} \
             (WORLD_SIZE={}); it would train {} unrelated copies. Start level1-raw-ddp (or level 2, 3) under the launcher instead",
            env.rank, env.world_size, env.world_size, env.world_size
        )));
    }
    args.check_device()?;
    let device = args.device_kind().resolve(0)?;
    ladder_core::device::set_threads_per_rank(1);
    ladder_core::device::tune_malloc_for_training();
    // ANCHOR: user_code
    tch::manual_seed(args.seed as i64);
    let mnist = args.load_mnist()?;
    // ANCHOR_END: user_code
    args.check_batch_size(mnist.train.len(), 1)?; // the binary's checks of its flags
    args.check_batch_memory(BasicNetConfig::default().width, 1, device)?;
    // ANCHOR: user_code (continued)
    let (train, test) = (mnist.train.to_device(device), mnist.test.to_device(device));

    let vs = nn::VarStore::new(device);
    let net = BasicNet::new(&vs.root(), BasicNetConfig::default());
    let mut opt = adamw(&vs, args.lr)?;
    let mut loader = DataLoader::shuffled(&train, args.batch_size, args.seed)?;

    let mut steps = 0usize;
    let mut train_loss = 0.0;
    let mut history = Vec::new();
    let mut eval = EvalSums::default();
    // ANCHOR_END: user_code
    // The harness's clock, as level 1's: step times by phase (no communication here).
    let (mut timer, no_comm) = (ladder_core::timing::StepTimer::start(device), ladder_core::timing::Comm::default());
    // ANCHOR: user_code (continued)
    for epoch in 1..=args.epochs {
        loader.set_epoch(epoch as u64 - 1);
        let (mut loss_sum, mut n_batches) = (0.0, 0usize);
        let mut stop = false;
        let batches = loader.iter();
        // ANCHOR_END: user_code
        let batches = timer.timed(batches, no_comm); // each batch one timed step
                                                     // ANCHOR: user_code (continued)
        for (batch_idx, (images, labels)) in batches.enumerate() {
            // The same dropout masks as level 1 at world size 1: one computation.
            seed_batch(args.seed, 0, steps as u64);
            opt.zero_grad();
            let loss = batch_loss(&net, &images, &labels);
            // ANCHOR_END: user_code
            timer.lap(Phase::Forward, no_comm);
            // ANCHOR: user_code (continued)
            loss.backward();
            // ANCHOR_END: user_code
            timer.lap(Phase::Backward, no_comm);
            // ANCHOR: user_code (continued)
            opt.step();
            let l = loss.double_value(&[]);
            loss_sum += l;
            n_batches += 1;
            steps += 1;
            if args.log_interval > 0 && batch_idx % args.log_interval == 0 {
                println!(
                    "Train Epoch: {epoch} [{}/{} ({:.0}%)]\tLoss: {l:.6}",
                    batch_idx * args.batch_size,
                    loader.num_samples(),
                    100.0 * batch_idx as f64 / loader.len() as f64
                );
            }
            if args.max_steps.is_some_and(|m| steps >= m) {
                stop = true;
                break;
            }
        }
        train_loss = loss_sum / n_batches.max(1) as f64;
        eval = evaluate(&net, &test, 1000);
        history.push(end_of_epoch(None, epoch, n_batches, train_loss, &eval)?);
        if stop {
            break;
        }
    }
    // ANCHOR_END: user_code

    if let Some(path) = &args.save_model {
        save_weights(path, &ladder_core::model::Model::named_parameters(&net))
            .map_err(|e| e.named_by(&[(WEIGHTS_FILE, "--save-model")]))?;
    }
    let peak = ladder_core::memory::peak_rss_bytes().map(ladder_core::memory::mib).unwrap_or(0.0);
    let timing = timer.finish();
    let samples = timing.samples;
    let report = Report {
        accuracy: eval.accuracy(),
        eval_samples: eval.count as u64,
        test_loss: eval.mean_loss(),
        train_loss,
        samples_per_s: if timing.timed_steps > 0 { timing.samples_per_s() } else { samples as f64 / timer.loops_s().max(1e-9) },
        wall_s: start.elapsed().as_secs_f64(),
        peak_rss_mib: peak,
        train_peak_rss_mib: timing.train_peak_rss_mib,
        cuda_peak_mib: timing.train_cuda_peak_mib,
        samples,
        timing,
        steps: steps as u64,
        world_size: 1,
        strategy: "single".into(),
        ranks: Vec::new(),
        history,
        extra: serde_json::Map::new(),
    };
    args.write_metrics_json(&report)?;
    Ok(report)
}
