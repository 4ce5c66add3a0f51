//! Command-line pieces the binaries share.

use clap::builder::{PossibleValue, TypedValueParser};
use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::ValueEnum;
use std::ffi::OsStr;
use std::marker::PhantomData;

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
        if let Some(v) = found {
            return Ok(v.clone());
        }
        let mut err = clap::Error::new(ErrorKind::InvalidValue).with_cmd(cmd);
        let name = arg.map(ToString::to_string).unwrap_or_else(|| "...".to_string());
        err.insert(ContextKind::InvalidArg, ContextValue::String(name));
        err.insert(ContextKind::InvalidValue, ContextValue::String(text.into_owned()));
        let valid = E::value_variants()
            .iter()
            .filter_map(|v| v.to_possible_value())
            .filter(|p| !p.is_hide_set())
            .map(|p| p.get_name().to_string())
            .collect();
        err.insert(ContextKind::ValidValue, ContextValue::Strings(valid));
        Err(err)
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = PossibleValue> + '_>> {
        Some(Box::new(E::value_variants().iter().filter_map(|v| v.to_possible_value())))
    }
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
}
