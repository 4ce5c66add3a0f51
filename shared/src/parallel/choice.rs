//! How a choice of the vocabulary is read and written: every spelling its users know parses to
//! one value, and each value is written one way.
//!
//! A choice is a `clap::ValueEnum` whose `#[value(name = …, alias = …)]` attributes hold every
//! spelling, once: `name` is the command-line spelling (kebab-case, what `--help` lists) and the
//! aliases are the references' (PyTorch's `FULL_SHARD` and `ShardingStrategy.FULL_SHARD`,
//! Accelerate's numbers, …). Reading is case-insensitive and takes `_` for `-` (Transformers'
//! `full_shard`); [`impl_choice!`](crate::impl_choice) derives `FromStr`, `Display` (the
//! reference's spelling, [`Choice::name`]) and serde (written as `name`, read as any spelling)
//! from it, so no level converts between spellings.

use clap::ValueEnum;

/// A choice of the vocabulary: its values carry their spellings (see the module docs).
pub trait Choice: ValueEnum + Copy + PartialEq + Send + Sync + 'static {
    /// What the choice is called in messages (`sharding strategy`).
    const WHAT: &'static str;

    /// The spelling written to files, reports and banners: the reference's (`FULL_SHARD`).
    fn name(self) -> &'static str;

    /// The command-line spelling (`full-shard`), as `--help` lists it.
    fn cli_name(self) -> String {
        self.to_possible_value().map_or_else(String::new, |v| v.get_name().to_string())
    }

    /// Why a spelling the references know is refused here (`fp8`: not supported), if
    /// it is one of those.
    fn unsupported(_text: &str) -> Option<&'static str> {
        None
    }
}

/// A spelling that names no value of a choice.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} {value:?}: expected {expected}")]
pub struct ChoiceError {
    /// The choice (`sharding strategy`).
    pub what: &'static str,
    /// The text given.
    pub value: String,
    /// What was expected: the command-line spellings, and why a known but refused spelling is
    /// refused.
    pub expected: String,
    /// The values as the references write them (`FULL_SHARD, SHARD_GRAD_OP or NO_SHARD`), for
    /// messages about a config file or an environment variable in the references' words.
    pub names: String,
}

/// Parses `text` as a value of `T`: any of its spellings, in any case, `_` and `-` alike,
/// surrounding blanks ignored.
///
/// # Errors
/// [`ChoiceError`] listing the command-line spellings (and, for a spelling the references know
/// but ddp-ladder does not implement, why it is refused).
pub fn parse<T: Choice>(text: &str) -> Result<T, ChoiceError> {
    let t = text.trim();
    let found = [t.to_string(), t.replace('_', "-"), t.replace('-', "_")]
        .iter()
        .find_map(|candidate| T::from_str(candidate, true).ok().filter(|_| !candidate.is_empty()));
    if let Some(v) = found {
        return Ok(v);
    }
    let cli: Vec<String> = T::value_variants().iter().map(|v| v.cli_name()).collect();
    let reference: Vec<&str> = T::value_variants().iter().map(|v| v.name()).collect();
    let (mut expected, mut names) = (one_of(&cli), one_of(&reference));
    if let Some(why) = T::unsupported(t) {
        expected.push_str(&format!(" ({why})"));
        names.push_str(&format!(" ({why})"));
    }
    Err(ChoiceError { what: T::WHAT, value: text.to_string(), expected, names })
}

/// serde visitor of a [`Choice`]: the error is raised inside the deserializer, so that formats
/// that track positions (YAML, TOML, JSON) name the key and the line.
#[derive(Debug)]
pub struct Visitor<T>(std::marker::PhantomData<T>);

impl<T> Default for Visitor<T> {
    fn default() -> Self {
        Visitor(std::marker::PhantomData)
    }
}

impl<T: Choice> serde::de::Visitor<'_> for Visitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a {}", T::WHAT)
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<T, E> {
        parse(v).map_err(|e| E::custom(e.to_string()))
    }
}

/// `a, b or c`.
pub(crate) fn one_of<S: AsRef<str>>(names: &[S]) -> String {
    let names: Vec<&str> = names.iter().map(AsRef::as_ref).collect();
    match names.as_slice() {
        [] => String::new(),
        [one] => (*one).to_string(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

/// Implements `FromStr` ([`parse`]), `Display` ([`Choice::name`]) and serde (written as the name,
/// read as any spelling) for a [`Choice`].
#[macro_export]
macro_rules! impl_choice {
    ($t:ty) => {
        impl ::std::str::FromStr for $t {
            type Err = $crate::parallel::ChoiceError;
            fn from_str(s: &str) -> ::std::result::Result<Self, Self::Err> {
                $crate::parallel::choice::parse(s)
            }
        }
        impl ::std::fmt::Display for $t {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str($crate::parallel::Choice::name(*self))
            }
        }
        impl ::serde::Serialize for $t {
            fn serialize<S: ::serde::Serializer>(&self, s: S) -> ::std::result::Result<S::Ok, S::Error> {
                s.serialize_str($crate::parallel::Choice::name(*self))
            }
        }
        impl<'de> ::serde::Deserialize<'de> for $t {
            fn deserialize<D: ::serde::Deserializer<'de>>(d: D) -> ::std::result::Result<Self, D::Error> {
                d.deserialize_str($crate::parallel::choice::Visitor::<$t>::default())
            }
        }
    };
}
