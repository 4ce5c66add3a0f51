//! How one table of settings ([`settings!`]) becomes everything that handles a setting: the
//! struct a user fills in and its file keys ([`AcceleratorConfig`](super::AcceleratorConfig),
//! serde), its flags (clap), the resolved values ([`ResolvedConfig`](super::ResolvedConfig)),
//! the launcher's variables ([`SETTINGS`](super::SETTINGS)), and one parser per setting that
//! reads a variable, reads a flag, and checks a value given by the program or a file.

use ladder_core::parallel::{BackwardPrefetch, Choice, ChoiceError, OffloadDevice, Precision, ShardingStrategy};

/// A setting's value as text: what the banner shows and the launcher exports, in the spelling
/// the setting's parser reads back (`bf16`, `4`, `true`, `FULL_SHARD`; `not set` for a seed
/// nobody gave).
pub trait Show {
    /// The text.
    fn show(&self) -> String;
}

macro_rules! show_by_display {
    ($($t:ty),*) => {$(
        impl Show for $t {
            fn show(&self) -> String {
                self.to_string()
            }
        }
    )*};
}
show_by_display!(
    bool,
    u16,
    u64,
    usize,
    String,
    Precision,
    ShardingStrategy,
    BackwardPrefetch,
    OffloadDevice,
    super::DistributedType,
    super::LogWith
);

impl Show for std::path::PathBuf {
    fn show(&self) -> String {
        self.display().to_string()
    }
}

impl Show for Option<std::path::PathBuf> {
    fn show(&self) -> String {
        self.as_ref().map_or_else(|| "not set".into(), Show::show)
    }
}

impl Show for Option<super::LogWith> {
    fn show(&self) -> String {
        self.map_or_else(|| "not set".into(), |v| v.to_string())
    }
}

impl Show for Option<u64> {
    fn show(&self) -> String {
        self.map_or_else(|| "not set".into(), |v| v.to_string())
    }
}

impl Show for Option<usize> {
    fn show(&self) -> String {
        self.map_or_else(|| "not set".into(), |v| v.to_string())
    }
}

/// How a setting's flag reads its value: a choice lists its spellings (clap's possible values);
/// any other type goes through the setting's own parser (so a flag, a variable and a file value
/// obey one rule), its message prefixed with `expected`.
pub trait Flag: Sized + Clone + Send + Sync + 'static {
    /// The clap value parser of a flag whose setting parses with `parse`.
    fn value_parser(parse: fn(&str) -> Result<Self, String>) -> clap::builder::ValueParser {
        clap::builder::ValueParser::new(move |s: &str| parse(s).map_err(|e| format!("expected {e}")))
    }
}

impl Flag for bool {}
impl Flag for u16 {}
impl Flag for u64 {}
impl Flag for usize {}
impl Flag for String {}
impl Flag for std::path::PathBuf {}

macro_rules! flag_by_spelling {
    ($($t:ty),*) => {$(
        impl Flag for $t {
            fn value_parser(_: fn(&str) -> Result<Self, String>) -> clap::builder::ValueParser {
                clap::builder::ValueParser::new(ladder_core::cli::spelling::<$t>())
            }
        }
    )*};
}
flag_by_spelling!(Precision, ShardingStrategy, BackwardPrefetch, OffloadDevice, super::DistributedType, super::LogWith);

/// The parsers of the table: each returns what was expected on bad text.
pub mod parse {
    use super::{Choice, ChoiceError};

    /// A choice of the vocabulary, the error naming the values in Accelerate's spelling
    /// (`FULL_SHARD, SHARD_GRAD_OP or NO_SHARD`).
    ///
    /// # Errors
    /// What was expected.
    pub fn choice<T: Choice>(s: &str) -> Result<T, String> {
        ladder_core::parallel::choice::parse(s).map_err(|e: ChoiceError| e.names)
    }

    /// Accelerate's `str_to_bool`: `y yes t true on 1` / `n no f false off 0`, any case.
    ///
    /// # Errors
    /// What was expected, for any other text.
    pub fn bool(s: &str) -> Result<bool, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "y" | "yes" | "t" | "true" | "on" | "1" => Ok(true),
            "n" | "no" | "f" | "false" | "off" | "0" => Ok(false),
            _ => Err("a boolean: true or false (also 1/0, yes/no, on/off)".into()),
        }
    }

    /// A count of at least 1.
    ///
    /// # Errors
    /// What was expected.
    pub fn positive(s: &str) -> Result<usize, String> {
        match s.trim().parse::<usize>() {
            Ok(n) if n >= 1 => Ok(n),
            _ => Err("a whole number of at least 1".into()),
        }
    }

    /// A count, 0 included.
    ///
    /// # Errors
    /// What was expected.
    pub fn count(s: &str) -> Result<usize, String> {
        s.trim().parse::<usize>().map_err(|_| "a whole number ≥ 0".into())
    }

    /// A DeepSpeed ZeRO stage: 0, 1, 2 or 3.
    ///
    /// # Errors
    /// What was expected.
    pub fn zero_stage(s: &str) -> Result<usize, String> {
        match s.trim().parse::<usize>() {
            Ok(n) if n <= 3 => Ok(n),
            _ => {
                Err("a DeepSpeed ZeRO stage: 0 (off), 1 (optimizer state sharded over DDP), 2 (FSDP SHARD_GRAD_OP) or 3 (FSDP FULL_SHARD)"
                    .into())
            }
        }
    }

    /// A seed: any `u64`.
    ///
    /// # Errors
    /// What was expected.
    pub fn seed(s: &str) -> Result<u64, String> {
        s.trim().parse::<u64>().map_err(|_| "a whole number in 0..=18446744073709551615".into())
    }

    /// A TCP port, 1..=65535.
    ///
    /// # Errors
    /// What was expected.
    pub fn port(s: &str) -> Result<u16, String> {
        match s.trim().parse::<u16>() {
            Ok(p) if p >= 1 => Ok(p),
            _ => Err("a port in 1..=65535 (leave it out to pick a free port)".into()),
        }
    }

    /// A directory path: any text that is not blank (kept as given; whether it can be written
    /// is checked before training).
    ///
    /// # Errors
    /// What was expected.
    pub fn path(s: &str) -> Result<std::path::PathBuf, String> {
        if s.trim().is_empty() {
            Err("a directory path".into())
        } else {
            Ok(std::path::PathBuf::from(s))
        }
    }

    /// A host name or address: any text that is not blank (kept as given).
    ///
    /// # Errors
    /// What was expected.
    pub fn address(s: &str) -> Result<String, String> {
        if s.trim().is_empty() {
            Err("the address of machine 0 (a host name or IP address)".into())
        } else {
            Ok(s.to_string())
        }
    }
}

/// Declares the settings, once each, and derives from that one table:
///
/// * [`AcceleratorConfig`](super::AcceleratorConfig): one `Option` field per setting (`None` =
///   not given), its serde key (the field's name) and its clap flag (`--field-name`, also
///   `--field_name`); the first paragraph of a setting's doc comment is the flag's help;
/// * `merged_over`, `is_given`, `to_env_vars` and the per-setting part of `validate` (a given
///   value must read back through the setting's parser);
/// * for the settings a program resolves (the `resolved` block, each with its variable and
///   default): [`ResolvedConfig`](super::ResolvedConfig)'s fields, `value_of`, the resolution
///   builder > variable > file > default, and [`SETTINGS`](super::SETTINGS).
///
/// A `launch` row is `name: Type, parse PARSER;`; a `resolved` row is
/// `name: Type => Resolved = DEFAULT, env "VAR", parse PARSER;` (`Resolved` is `Type`, or
/// `Option<Type>` for a setting without a default). Each row's doc comment is followed by its
/// flag's `#[arg(..)]` (value name, and for a boolean the optional value) and, optionally, a
/// `#[serde(..)]` (a key alias), both applied to the field.
macro_rules! settings {
    (
        launch {
            $( $(#[doc = $ldoc:literal])* #[arg($($larg:tt)*)] $(#[serde($($lserde:tt)*)])?
               $lname:ident : $lty:ty, parse $lparse:expr; )*
        }
        resolved {
            $( $(#[doc = $rdoc:literal])* #[arg($($rarg:tt)*)] $(#[serde($($rserde:tt)*)])?
               $rname:ident : $rty:ty => $rres:ty = $rdefault:expr, env $renv:literal, parse $rparse:expr; )*
        }
    ) => {
        /// Everything a user can set; every field `Option`: `None` = "not given" (never confused
        /// with "given as the default"). The config file holds exactly the fields that are
        /// `Some`, under these names (Accelerate's; `use_cpu` is read as `cpu`); any other key
        /// is an error. Also `ladder-accelerate`'s setting flags (`--num-processes`, also
        /// Accelerate's `--num_processes`; a boolean flag alone means true).
        #[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize, clap::Args)]
        #[serde(deny_unknown_fields)]
        pub struct AcceleratorConfig {
            $(
                $(#[doc = $ldoc])*
                #[arg($($larg)*)]
                $(#[serde($($lserde)*)])?
                #[serde(default, skip_serializing_if = "Option::is_none")]
                #[arg(long, alias = stringify!($lname), long_help = None::<&str>,
                      value_parser = <$lty as $crate::config::table::Flag>::value_parser($lparse))]
                pub $lname: Option<$lty>,
            )*
            $(
                $(#[doc = $rdoc])*
                #[arg($($rarg)*)]
                $(#[serde($($rserde)*)])?
                #[serde(default, skip_serializing_if = "Option::is_none")]
                #[arg(long, alias = stringify!($rname), long_help = None::<&str>,
                      value_parser = <$rty as $crate::config::table::Flag>::value_parser($rparse))]
                pub $rname: Option<$rty>,
            )*
        }

        /// Concrete values + the source of each, after precedence builder > launcher env >
        /// config file > default.
        #[derive(Debug, Clone, PartialEq)]
        pub struct ResolvedConfig {
            $( $(#[doc = $rdoc])* pub $rname: $rres, )*
            /// The config file that was read (named by `ACCELERATE_CONFIG_FILE`), if any.
            pub config_file: Option<std::path::PathBuf>,
            /// Where each setting of [`SETTINGS`] came from, by setting name.
            pub sources: std::collections::BTreeMap<&'static str, $crate::config::Source>,
        }

        /// The settings [`ResolvedConfig`] resolves, each with its environment variable
        /// (Accelerate's name), in banner order.
        pub const SETTINGS: [(&str, &str); [$(stringify!($rname)),*].len()] = [$((stringify!($rname), $renv)),*];

        impl AcceleratorConfig {
            /// `self`'s given values, and `base`'s where `self` gives none (e.g. launch flags
            /// over the config file).
            pub fn merged_over(&self, base: &AcceleratorConfig) -> AcceleratorConfig {
                AcceleratorConfig {
                    $( $lname: self.$lname.clone().or_else(|| base.$lname.clone()), )*
                    $( $rname: self.$rname.clone().or_else(|| base.$rname.clone()), )*
                }
            }

            /// Whether the field named `setting` (a field name of this struct) is `Some`.
            pub fn is_given(&self, setting: &str) -> bool {
                match setting {
                    $( stringify!($lname) => self.$lname.is_some(), )*
                    $( stringify!($rname) => self.$rname.is_some(), )*
                    _ => false,
                }
            }

            /// The variables `ladder-accelerate launch` exports for the given settings of
            /// [`SETTINGS`] (only those that are `Some`; `use_fsdp` also from
            /// `distributed_type: FSDP`), in the spelling [`ResolvedConfig::resolve`] reads
            /// back: `bf16`, `4`, `true`, `FULL_SHARD`.
            pub fn to_env_vars(&self) -> Vec<(&'static str, String)> {
                use $crate::config::table::Show;
                let implied = self.with_implied();
                let mut vars = Vec::new();
                $( if let Some(v) = &implied.$rname { vars.push(($renv, v.show())); } )*
                vars
            }

            /// Checks each given value with its setting's parser (the rule a variable or a
            /// flag obeys), naming `origin`.
            pub(super) fn validate_each(&self, origin: &$crate::config::Origin) -> $crate::Result<()> {
                $( $crate::config::table::check::<$lty>(stringify!($lname), &self.$lname, $lparse, origin)?; )*
                $( $crate::config::table::check::<$rty>(stringify!($rname), &self.$rname, $rparse, origin)?; )*
                Ok(())
            }
        }

        impl ResolvedConfig {
            /// Each setting from the first source that gives it (see `resolve`).
            pub(super) fn pick_all(
                builder: &AcceleratorConfig,
                file: &AcceleratorConfig,
                env: &dyn Fn(&str) -> Option<String>,
                config_file: Option<std::path::PathBuf>,
            ) -> $crate::Result<ResolvedConfig> {
                use $crate::config::table::pick;
                let (builder, file) = (builder.with_implied(), file.with_implied());
                let mut sources = std::collections::BTreeMap::new();
                $(
                    let parse: fn(&str) -> Result<$rty, String> = $rparse;
                    let $rname: $rres = pick(
                        &mut sources, env, stringify!($rname), $renv,
                        builder.$rname.clone().map(<$rres>::from),
                        file.$rname.clone().map(<$rres>::from),
                        $rdefault,
                        |s| parse(s).map(<$rres>::from),
                    )?;
                )*
                Ok(ResolvedConfig { $($rname,)* config_file, sources })
            }

            /// The value of `setting` as text (`bf16`, `4`, `true`, `FULL_SHARD`,
            /// `NO_PREFETCH`, `not set`); empty for a name that is not a setting.
            pub fn value_of(&self, setting: &str) -> String {
                use $crate::config::table::Show;
                match setting {
                    $( stringify!($rname) => self.$rname.show(), )*
                    _ => String::new(),
                }
            }
        }
    };
}

/// One setting: the builder's value, else its variable (parsed), else the file's, else the
/// default; records where it came from.
#[allow(clippy::too_many_arguments)]
pub(crate) fn pick<T>(
    sources: &mut std::collections::BTreeMap<&'static str, super::Source>,
    env: &dyn Fn(&str) -> Option<String>,
    setting: &'static str,
    var: &'static str,
    builder: Option<T>,
    file: Option<T>,
    default: T,
    parse: impl Fn(&str) -> Result<T, String>,
) -> crate::Result<T> {
    use super::Source;
    let (v, src) = if let Some(v) = builder {
        (v, Source::Builder)
    } else if let Some(raw) = env(var) {
        let v = parse(&raw).map_err(|expected| crate::Error::InvalidSetting {
            setting: setting.into(),
            value: raw.clone(),
            origin: format!("environment variable {var}"),
            expected: if raw.trim().is_empty() { format!("{expected} (or leave the variable unset)") } else { expected },
        })?;
        (v, Source::Env)
    } else if let Some(v) = file {
        (v, Source::ConfigFile)
    } else {
        (default, Source::Default)
    };
    sources.insert(setting, src);
    Ok(v)
}

/// A given value must read back through its setting's parser (`gradient_accumulation_steps: 0`
/// is refused as `ACCELERATE_GRADIENT_ACCUMULATION_STEPS=0` is).
pub(crate) fn check<T: Show>(
    setting: &str,
    value: &Option<T>,
    parse: fn(&str) -> Result<T, String>,
    origin: &super::Origin,
) -> crate::Result<()> {
    let Some(v) = value else { return Ok(()) };
    let text = v.show();
    parse(&text).map(drop).map_err(|expected| crate::Error::InvalidSetting {
        setting: setting.to_string(),
        value: text,
        origin: origin.describe(setting),
        expected,
    })
}
