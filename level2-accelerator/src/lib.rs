//! Level 2: 🤗 Accelerate in Rust. The training loop is written as if for one device; the
//! [`Accelerator`] makes the same loop run on one CPU, N processes, or GPUs, without a code
//! change: [`Accelerator::prepare_model`] wraps the model (DDP or FSDP, from the config),
//! [`Accelerator::prepare_data_loader`] shards the data, [`Accelerator::backward`] syncs the
//! gradients, [`Accelerator::gather_for_metrics`] collects exact evaluation results.
//!
//! Settings come from [`config`] (builder > `ladder-accelerate launch`'s environment > config
//! file > default). The binary `level2-accelerator` is the tutorial's loop written this way
//! ([`run`]); `ladder-accelerate` is the `accelerate config | launch | env` CLI.

pub mod accelerator;
pub mod config;
pub mod error;
pub mod scaler;
pub mod tracking;
mod train;

pub use accelerator::{
    AcceleratedDataLoader, AcceleratedOptimizer, Accelerator, DataLoaderOptions, DistributedDataParallelKwargs, InitProcessGroupKwargs,
    PreparedModel,
};
pub use config::{AcceleratorConfig, ResolvedConfig};
pub use error::{Error, Result};
pub use train::{run, Config};
