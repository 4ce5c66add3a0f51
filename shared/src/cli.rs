//! Command-line pieces the binaries share.

use clap::builder::{PossibleValue, TypedValueParser};
use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::ValueEnum;
use std::ffi::OsStr;
use std::marker::PhantomData;

/// The `Environment:` section of the `--help` of every training binary that joins a process
/// group (levels 1, 2 and 3): the torchrun and mpirun variables that place the process in the
/// job ([`crate::dist::DistEnv`]), the shutdown timeout, and the data variables of
/// [`TrainArgs`](crate::recipe::TrainArgs). A binary puts it in its `after_help` and may add its
/// own variables after it, one per line, indented as these.
pub const ENVIRONMENT_HELP: &str = "Environment:\n  RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT\n      this process's place in the job, as torchrun (and ladder-run) set them\n  OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_[RANK|SIZE]\n      the same under mpirun (they win; torchrun's must agree)\n  LADDER_SHUTDOWN_TIMEOUT_S\n      seconds a rank waits for the others at shutdown, then aborts the job [default: 30]\n  MNIST_DIR, MNIST_MIRRORS\n      see --data-dir and --mirror";

/// clap value parser for a [`ValueEnum`] flag: a wrong value is answered with the list of
/// possible values, without clap's "a similar value exists" tip. That tip goes by spelling
/// alone, so it misleads on short names: `--strategy fsdp` would suggest `fsdp-no-shard` and
/// `--device gpu` would suggest `cpu`. Use it as
/// `#[arg(long, value_enum, value_parser = ladder_core::cli::choice::<Strategy>())]`.
pub fn choice<E: ValueEnum + Clone + Send + Sync + 'static>() -> Choice<E> {
    Choice(PhantomData)
}

/// See [`choice`].
#[derive(Debug)]
pub struct Choice<E>(PhantomData<E>);

impl<E> Clone for Choice<E> {
    fn clone(&self) -> Self {
        Choice(PhantomData)
    }
}

impl<E: ValueEnum + Clone + Send + Sync + 'static> TypedValueParser for Choice<E> {
    type Value = E;

    fn parse_ref(&self, cmd: &clap::Command, arg: Option<&clap::Arg>, value: &OsStr) -> Result<E, clap::Error> {
        let ignore_case = arg.is_some_and(|a| a.is_ignore_case_set());
        let text = value.to_string_lossy();
        let found = E::value_variants().iter().find(|v| v.to_possible_value().is_some_and(|p| p.matches(&text, ignore_case)));
        found.cloned().ok_or_else(|| invalid_value(cmd, arg, &text, E::value_variants()))
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = PossibleValue> + '_>> {
        Some(Box::new(E::value_variants().iter().filter_map(|v| v.to_possible_value())))
    }
}

/// clap value parser for a choice of the vocabulary ([`crate::parallel::Choice`]: strategy,
/// sharding strategy, backward prefetch, precision): every spelling the references use is
/// read, in any case, `_` and `-` alike ([`crate::parallel::choice::parse`]); `--help` and a
/// wrong value list the command-line spellings, as [`choice`] does, and a spelling the
/// references know but ddp-ladder refuses (offload device `cpu`) gets the reason
/// ([`Choice::unsupported`](crate::parallel::Choice::unsupported)) as a tip. Use it as
/// `#[arg(long, value_parser = ladder_core::cli::spelling::<Precision>())]`.
pub fn spelling<T: crate::parallel::Choice>() -> Spelling<T> {
    Spelling { among: T::value_variants() }
}

/// [`spelling`] restricted to some of the choice's values (level 1's `--mixed-precision` takes
/// `no` and `bf16`: fp16 needs the Accelerator's loss scaling): the others are refused as a
/// wrong value is, and `--help` lists only these.
pub fn spelling_among<T: crate::parallel::Choice>(among: &'static [T]) -> Spelling<T> {
    Spelling { among }
}

/// See [`spelling`].
#[derive(Debug, Clone)]
pub struct Spelling<T: 'static> {
    among: &'static [T],
}

impl<T: crate::parallel::Choice> TypedValueParser for Spelling<T> {
    type Value = T;

    fn parse_ref(&self, cmd: &clap::Command, arg: Option<&clap::Arg>, value: &OsStr) -> Result<T, clap::Error> {
        let text = value.to_string_lossy();
        let found = crate::parallel::choice::parse::<T>(&text).ok().filter(|v| self.among.contains(v));
        found.ok_or_else(|| {
            let mut err = invalid_value(cmd, arg, &text, self.among);
            // A spelling the references know but ddp-ladder refuses: say why.
            if let Some(why) = T::unsupported(&text) {
                let why = format!("'{}' is refused: {why}", text.trim());
                err.insert(ContextKind::Suggested, ContextValue::StyledStrs(vec![why.into()]));
            }
            err
        })
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = PossibleValue> + '_>> {
        Some(Box::new(self.among.iter().filter_map(|v| v.to_possible_value())))
    }
}

/// clap's "invalid value" error for `text`, listing the visible values of `among` (no "similar
/// value" tip).
fn invalid_value<E: ValueEnum>(cmd: &clap::Command, arg: Option<&clap::Arg>, text: &str, among: &[E]) -> clap::Error {
    let mut err = clap::Error::new(ErrorKind::InvalidValue).with_cmd(cmd);
    let name = arg.map(ToString::to_string).unwrap_or_else(|| "...".to_string());
    err.insert(ContextKind::InvalidArg, ContextValue::String(name));
    err.insert(ContextKind::InvalidValue, ContextValue::String(text.to_string()));
    let valid = among.iter().filter_map(|v| v.to_possible_value()).filter(|p| !p.is_hide_set()).map(|p| p.get_name().to_string()).collect();
    err.insert(ContextKind::ValidValue, ContextValue::Strings(valid));
    err
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
    enum Strategy {
        Ddp,
        FsdpFullShard,
        FsdpNoShard,
    }

    #[derive(Debug, Parser)]
    struct Cli {
        #[arg(long, value_enum, value_parser = choice::<Strategy>(), default_value_t = Strategy::Ddp)]
        strategy: Strategy,
        #[arg(long, value_enum, value_parser = choice::<Strategy>(), ignore_case = true)]
        loose: Option<Strategy>,
    }

    #[test]
    fn wrong_values_get_the_list_and_no_tip() {
        let cli = Cli::try_parse_from(["t", "--strategy", "fsdp-no-shard", "--loose", "DDP"]).unwrap();
        assert_eq!((cli.strategy, cli.loose), (Strategy::FsdpNoShard, Some(Strategy::Ddp)));
        assert_eq!(Cli::try_parse_from(["t"]).unwrap().strategy, Strategy::Ddp);
        let err = Cli::try_parse_from(["t", "--strategy", "fsdp"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidValue);
        assert_eq!(
            err.render().to_string(),
            "error: invalid value 'fsdp' for '--strategy <STRATEGY>'\n  [possible values: ddp, fsdp-full-shard, fsdp-no-shard]\n\nFor more information, try '--help'.\n"
        );
        // clap's own parser would have added "tip: a similar value exists: 'fsdp-no-shard'".
        assert!(!err.render().to_string().contains("tip"));
    }

    #[derive(Debug, Parser)]
    struct Offload {
        #[arg(long, value_parser = spelling::<crate::parallel::OffloadDevice>(), hide_possible_values = true)]
        offload: crate::parallel::OffloadDevice,
    }

    #[test]
    fn a_refused_spelling_gets_its_reason() {
        assert_eq!(Offload::try_parse_from(["t", "--offload", "NVMe"]).unwrap().offload, crate::parallel::OffloadDevice::Nvme);
        let err = Offload::try_parse_from(["t", "--offload", "cpu"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidValue);
        let text = err.render().to_string();
        let why = <crate::parallel::OffloadDevice as crate::parallel::Choice>::unsupported("cpu").unwrap();
        assert!(text.starts_with("error: invalid value 'cpu' for '--offload <OFFLOAD>'\n  [possible values: none, nvme]\n"), "{text}");
        assert!(text.contains(&format!("tip: 'cpu' is refused: {why}")), "{text}");
        // An unknown spelling gets no reason.
        let text = Offload::try_parse_from(["t", "--offload", "disk"]).unwrap_err().render().to_string();
        assert!(!text.contains("tip"), "{text}");
    }
}
