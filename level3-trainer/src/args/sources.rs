//! Where TrainingArguments come from besides [`TrainingArguments::default`]: an arguments file
//! (JSON or TOML, keys are the field names) laid over the defaults, command-line flags given
//! laid over the file; and where they go: `output_dir/training_args.json`.

use super::{spellings, TrainingArguments};
use crate::error::{Error, Result};
use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches};
use std::path::{Path, PathBuf};

impl TrainingArguments {
    /// Parses command-line arguments (the first item is the program name), reading
    /// `--args-file` if given: defaults < file < flags given on the command line.
    ///
    /// # Errors
    /// [`Error::CommandLine`] for unknown flags or bad values, [`Error::ArgsFile`] for an unreadable or unknown-key file, and
    /// [`TrainingArguments::validate`]'s errors.
    pub fn parse_from_cli<I, T>(args: I) -> Result<Self>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let (words, warnings) = spellings::rewrite_renamed_flags(args);
        let cmd = spellings::with_snake_case_flags(Self::command());
        let matches = cmd.try_get_matches_from(words).map_err(|e| Error::CommandLine { message: e.render().to_string() })?;
        warnings.iter().for_each(|w| spellings::warn(w));
        Self::from_matches(&matches)
    }

    /// [`Self::parse_from_cli`] from clap matches of a command that flattens
    /// `TrainingArguments` (`#[command(flatten)]`): the file (if any) with every flag whose
    /// value came from the command line laid over it.
    ///
    /// # Errors
    /// As [`Self::parse_from_cli`].
    pub fn from_matches(matches: &ArgMatches) -> Result<Self> {
        let cli =
            <Self as FromArgMatches>::from_arg_matches(matches).map_err(|e| Error::CommandLine { message: e.render().to_string() })?;
        let base = match &cli.args_file {
            None => Self::default(),
            Some(file) => Self::from_file(file)?,
        };
        let args = base.overlay_given(&cli, |key| matches!(matches.value_source(key), Some(ValueSource::CommandLine)));
        args.validate()?;
        Ok(args)
    }

    /// These arguments with each field for which `given(field)` holds replaced by `flags`'
    /// value (the flags a user typed over the defaults and the file); `args_file` is `flags'`.
    /// Not validated.
    pub fn overlay_given(&self, flags: &Self, given: impl Fn(&str) -> bool) -> Self {
        let mut merged = serde_json::to_value(self).expect("TrainingArguments serialise");
        let typed = serde_json::to_value(flags).expect("TrainingArguments serialise");
        let (merged_map, typed_map) = (merged.as_object_mut().expect("an object"), typed.as_object().expect("an object"));
        for (key, value) in typed_map {
            if given(key) {
                merged_map.insert(key.clone(), value.clone());
            }
        }
        let mut out: Self = serde_json::from_value(merged).expect("a merge of two valid argument sets");
        out.args_file = flags.args_file.clone();
        out
    }

    /// Reads arguments from a JSON file, or a TOML file when the name ends in `.toml`; missing
    /// keys take their defaults, unknown keys are errors. Not validated.
    ///
    /// # Errors
    /// [`Error::ArgsFile`] naming the file and the parser's complaint.
    pub fn from_file(file: &Path) -> Result<Self> {
        Self::default().overlay_file(file)
    }

    /// These arguments with every key present in `file` (JSON, or TOML when the name ends in
    /// `.toml`) replaced by the file's value. Not validated.
    ///
    /// # Errors
    /// [`Error::ArgsFile`] naming the file and the parser's complaint (unknown key, bad value).
    pub fn overlay_file(&self, file: &Path) -> Result<Self> {
        let bad = |problem: String| Error::ArgsFile { file: file.into(), problem };
        let keys = Self::read_table(file, true)?;
        // Unknown keys and bad values, reported against the file alone.
        serde_json::from_value::<Self>(serde_json::Value::Object(keys.clone())).map_err(|e| bad(e.to_string()))?;
        let mut merged = serde_json::to_value(self).expect("TrainingArguments serialise");
        let map = merged.as_object_mut().expect("an object");
        for (k, v) in keys {
            map.insert(k, v);
        }
        let mut out: Self = serde_json::from_value(merged).map_err(|e| bad(e.to_string()))?;
        out.args_file = self.args_file.clone();
        Ok(out)
    }

    /// The fields an arguments file sets (older names given as the new ones).
    ///
    /// # Errors
    /// [`Error::ArgsFile`] naming the file and the parser's complaint.
    pub fn fields_in_file(file: &Path) -> Result<Vec<String>> {
        Ok(Self::read_table(file, false)?.keys().cloned().collect())
    }

    /// The table of an arguments file (JSON, or TOML when the name ends in `.toml`), with
    /// Transformers' older names renamed (a deprecation warning each, when `warn`).
    fn read_table(file: &Path, warn: bool) -> Result<serde_json::Map<String, serde_json::Value>> {
        let bad = |problem: String| Error::ArgsFile { file: file.into(), problem };
        let text = std::fs::read_to_string(file).map_err(|e| bad(e.to_string()))?;
        let value: serde_json::Value = if file.extension().is_some_and(|e| e == "toml") {
            let t: toml::Value = toml::from_str(&text).map_err(|e| bad(e.message().to_string()))?;
            serde_json::to_value(t).map_err(|e| bad(e.to_string()))?
        } else {
            serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?
        };
        let serde_json::Value::Object(mut keys) = value else {
            return Err(bad("expected a table of TrainingArguments fields".into()));
        };
        // Transformers' older names, read as the new ones (both given: which one?).
        for (old, new) in spellings::RENAMED {
            if let Some(v) = keys.remove(*old) {
                if keys.contains_key(*new) {
                    return Err(bad(format!("both `{old}` and `{new}` are given; `{old}` is the older name of `{new}`: keep one")));
                }
                if warn {
                    spellings::warn(&format!("{}: {}", file.display(), spellings::deprecation(old, new)));
                }
                keys.insert(new.to_string(), v);
            }
        }
        Ok(keys)
    }

    /// Writes the arguments as pretty JSON to `output_dir/training_args.json` (atomically),
    /// creating output_dir.
    ///
    /// # Errors
    /// [`Error::Io`] naming the directory or file.
    pub fn write_json(&self) -> Result<PathBuf> {
        std::fs::create_dir_all(&self.output_dir).map_err(|e| Error::io(&self.output_dir, e))?;
        let path = self.output_dir.join("training_args.json");
        let json = serde_json::to_string_pretty(self).expect("TrainingArguments serialise");
        ladder_core::atomic::write_atomic(&path, json.as_bytes())?;
        Ok(path)
    }
}
