//! Transformers' `fsdp` argument: a space-separated list of FSDP options (`"full_shard"`,
//! `"full_shard offload"`, `"shard_grad_op auto_wrap"`), as `TrainingArguments.__post_init__`
//! splits it into `FSDPOption`s; in an arguments file also the list form
//! (`["full_shard", "offload"]`).

use ladder_core::parallel::Choice as _;
use ladder_core::parallel::{FsdpOptions, ShardingStrategy, Strategy};
use serde::{Deserialize, Serialize};

/// The options this Trainer takes beside the sharding strategies, as Transformers spells them.
const OPTIONS: &str = "full_shard, shard_grad_op, no_shard, hybrid_shard, hybrid_shard_zero2, offload or auto_wrap";

/// Transformers' `fsdp` argument, read: one sharding strategy (`full_shard`, `shard_grad_op`,
/// `no_shard`, `hybrid_shard`, `hybrid_shard_zero2`, any spelling of the core's
/// [`ShardingStrategy`]) and the options `offload` and `auto_wrap`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsdpArg {
    /// The sharding strategy.
    pub sharding_strategy: ShardingStrategy,
    /// `offload`: FSDP's CPU offload of the parameters (PyTorch's
    /// `CPUOffload(offload_params=True)`, the Accelerator's `fsdp_offload_params`).
    pub offload: bool,
    /// `auto_wrap`: Transformers' switch for the auto-wrap policy. Accepted and written back;
    /// this Trainer always applies the size-based policy of `fsdp_min_num_params` (whose
    /// default, 1e8, makes BasicNet one unit, as Transformers without `auto_wrap`).
    pub auto_wrap: bool,
}

impl From<ShardingStrategy> for FsdpArg {
    fn from(sharding_strategy: ShardingStrategy) -> Self {
        Self { sharding_strategy, offload: false, auto_wrap: false }
    }
}

impl FsdpArg {
    /// Reads the words of `text` (blank-separated), as Transformers' `[FSDPOption(s) for s in
    /// fsdp.split()]`, with its checks.
    ///
    /// # Errors
    /// What was expected: no words; an unknown word (the options are listed); `offload` or
    /// `auto_wrap` without a sharding strategy (Transformers: "`--fsdp offload` can't work on
    /// its own"); two sharding strategies.
    pub fn from_words<'a>(words: impl IntoIterator<Item = &'a str>) -> std::result::Result<Self, String> {
        let (mut sharding, mut offload, mut auto_wrap) = (None::<ShardingStrategy>, false, false);
        for word in words {
            match word.to_ascii_lowercase().as_str() {
                "offload" => offload = true,
                "auto_wrap" | "auto-wrap" => auto_wrap = true,
                _ => {
                    let s = ladder_core::parallel::choice::parse::<ShardingStrategy>(word)
                        .map_err(|_| format!("fsdp option {word:?} is not one of {OPTIONS}"))?;
                    if let Some(first) = sharding.filter(|&f| f != s) {
                        return Err(format!(
                            "fsdp names two sharding strategies, {} and {}: give one (with offload and auto_wrap if wanted)",
                            word_of(first),
                            word_of(s)
                        ));
                    }
                    sharding = Some(s);
                }
            }
        }
        match sharding {
            Some(sharding_strategy) => Ok(Self { sharding_strategy, offload, auto_wrap }),
            None if offload || auto_wrap => Err(format!(
                "fsdp {:?} has no sharding strategy: offload and auto_wrap can't work on their own; add one, e.g. \"full_shard offload\" (as Transformers)",
                [offload.then_some("offload"), auto_wrap.then_some("auto_wrap")].into_iter().flatten().collect::<Vec<_>>().join(" ")
            )),
            None => Err(format!("fsdp is empty: expected a sharding strategy and options, from {OPTIONS}")),
        }
    }

    /// The `--fsdp` value: the options separated by blanks (`"full_shard offload"`).
    ///
    /// # Errors
    /// As [`from_words`](Self::from_words).
    pub fn from_arg(text: &str) -> std::result::Result<Self, String> {
        Self::from_words(text.split_whitespace())
    }

    /// The strategy it names: FSDP with its sharding strategy and, with `offload`,
    /// `offload_params`; PyTorch's other defaults.
    pub fn strategy(&self) -> Strategy {
        Strategy::Fsdp(FsdpOptions { offload_params: self.offload, ..FsdpOptions::with_sharding(self.sharding_strategy) })
    }
}

/// Transformers' word for a sharding strategy (`full_shard`).
fn word_of(s: ShardingStrategy) -> String {
    s.cli_name().replace('-', "_")
}

impl std::fmt::Display for FsdpArg {
    /// The sharding strategy as the core writes it (`FULL_SHARD`), then the options given
    /// (`FULL_SHARD offload`): read back by [`FsdpArg::from_arg`].
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.sharding_strategy)?;
        if self.offload {
            f.write_str(" offload")?;
        }
        if self.auto_wrap {
            f.write_str(" auto_wrap")?;
        }
        Ok(())
    }
}

impl Serialize for FsdpArg {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for FsdpArg {
    /// A string of blank-separated options, or a list of them (Transformers' list form).
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum TextOrList {
            Text(String),
            List(Vec<String>),
        }
        let words: Vec<String> = match TextOrList::deserialize(d)
            .map_err(|_| serde::de::Error::custom(format!("invalid fsdp: expected a string or a list of {OPTIONS}")))?
        {
            TextOrList::Text(t) => t.split_whitespace().map(str::to_string).collect(),
            TextOrList::List(l) => l,
        };
        FsdpArg::from_words(words.iter().map(String::as_str)).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transformers_spellings_read_and_write_back() {
        let read = |t: &str| FsdpArg::from_arg(t);
        assert_eq!(read("full_shard").unwrap(), FsdpArg::from(ShardingStrategy::FullShard));
        let off = read("full_shard offload").unwrap();
        assert_eq!(off, FsdpArg { sharding_strategy: ShardingStrategy::FullShard, offload: true, auto_wrap: false });
        assert_eq!(read("  offload   SHARD_GRAD_OP auto_wrap ").unwrap().to_string(), "SHARD_GRAD_OP offload auto_wrap");
        assert_eq!(read(&off.to_string()).unwrap(), off, "Display reads back");
        let Strategy::Fsdp(o) = off.strategy() else { panic!("FSDP") };
        assert!(o.offload_params && o.sharding_strategy == ShardingStrategy::FullShard);
        let json: FsdpArg = serde_json::from_str(r#"["hybrid_shard", "offload"]"#).unwrap();
        assert_eq!((json.sharding_strategy, json.offload), (ShardingStrategy::HybridShard, true));
        assert_eq!(serde_json::to_string(&off).unwrap(), r#""FULL_SHARD offload""#);
        let errors: Vec<String> =
            ["offload", "full_shard shard_grad_op", "full_shard cpu", ""].iter().map(|t| read(t).unwrap_err()).collect();
        assert_eq!(
            errors,
            [
                "fsdp \"offload\" has no sharding strategy: offload and auto_wrap can't work on their own; add one, e.g. \"full_shard offload\" (as Transformers)",
                "fsdp names two sharding strategies, full_shard and shard_grad_op: give one (with offload and auto_wrap if wanted)",
                "fsdp option \"cpu\" is not one of full_shard, shard_grad_op, no_shard, hybrid_shard, hybrid_shard_zero2, offload or auto_wrap",
                "fsdp is empty: expected a sharding strategy and options, from full_shard, shard_grad_op, no_shard, hybrid_shard, hybrid_shard_zero2, offload or auto_wrap",
            ]
        );
    }
}
