//! The MNIST pipeline: IDX parsing ([`idx`]), download and verification ([`download`]), the
//! decompressed images shared between ranks ([`cache`]), the [`Dataset`] normalised as batches are
//! drawn ([`mnist`]), samplers ([`sampler`]) and the [`DataLoader`].
//!
//! ```no_run
//! use ladder_core::data::{resolve_data_dir, DataLoader, Mnist};
//! let mnist = Mnist::load(&resolve_data_dir(None))?;
//! let loader = DataLoader::shuffled(&mnist.train, 64, 0)?;
//! assert_eq!(loader.len(), 938); // 937 batches of 64 and one of 32
//! for (images, labels) in loader.iter() {
//!     // images: [64, 1, 28, 28] f32, labels: [64] i64
//! #   let _ = (images, labels);
//! }
//! # Ok::<(), ladder_core::Error>(())
//! ```

pub mod cache;
pub mod download;
pub mod idx;
pub mod loader;
pub mod mnist;
pub mod sampler;

pub use download::{default_mirrors, download_missing, mirrors_from_env};
pub use loader::DataLoader;
pub use mnist::{resolve_data_dir, Dataset, EpochOrder, Mnist, MNIST_MEAN, MNIST_STD};
pub use sampler::{eval_shard, DistributedSampler, DistributedSamplerOptions, RandomSampler, Sampler, SequentialSampler};
