//! The other ways Transformers users write a TrainingArguments field: the snake_case flags of
//! `HfArgumentParser` (`--per_device_train_batch_size`), the older names Transformers renamed
//! (`evaluation_strategy` → `eval_strategy`, read with a deprecation warning as Transformers 4.x
//! did), and report_to's list form (`"report_to": ["none"]`). One table, used by the flags and
//! by the args file.

use super::ReportTo;
use clap::Command;
use serde::Deserialize;

/// Older TrainingArguments names and the field each became (Transformers' renames:
/// `evaluation_strategy` in v4.41, `no_cuda` in v4.34, `per_gpu_*` in v2.9).
pub const RENAMED: &[(&str, &str)] = &[
    ("evaluation_strategy", "eval_strategy"),
    ("no_cuda", "use_cpu"),
    ("per_gpu_train_batch_size", "per_device_train_batch_size"),
    ("per_gpu_eval_batch_size", "per_device_eval_batch_size"),
];

/// The field an older name became, if `name` (snake_case) is one.
pub fn renamed(name: &str) -> Option<&'static str> {
    RENAMED.iter().find(|(old, _)| *old == name).map(|(_, new)| *new)
}

/// The deprecation warning for an older name, as Transformers 4.x printed it.
pub fn deprecation(old: &str, new: &str) -> String {
    format!("warning: `{old}` is deprecated and was renamed `{new}` (as in 🤗 Transformers); reading it as `{new}`")
}

/// Prints a warning on stderr once per job: on the process whose rank (`RANK`, or
/// `OMPI_COMM_WORLD_RANK` under mpirun) is 0 or unset — arguments are parsed before the process
/// group exists.
pub fn warn(message: &str) {
    let rank = std::env::var("OMPI_COMM_WORLD_RANK").or_else(|_| std::env::var("RANK")).unwrap_or_default();
    if rank.is_empty() || rank == "0" {
        eprintln!("{message}");
    }
}

/// Every long flag of `cmd` also under its snake_case spelling (`--per_device_train_batch_size`,
/// as `HfArgumentParser` writes them), hidden from `--help`.
pub fn with_snake_case_flags(cmd: Command) -> Command {
    cmd.mut_args(|arg| match arg.get_long().filter(|l| l.contains('-')).map(|l| l.replace('-', "_")) {
        Some(snake) => arg.alias(snake),
        None => arg,
    })
}

/// Command-line words with each older flag (`--evaluation-strategy`, `--evaluation_strategy`,
/// `=VALUE` forms too) replaced by its new name, and a deprecation warning for each.
pub fn rewrite_renamed_flags<T: Into<std::ffi::OsString>>(words: impl IntoIterator<Item = T>) -> (Vec<std::ffi::OsString>, Vec<String>) {
    let mut warnings = Vec::new();
    let mut past_separator = false;
    let out = words
        .into_iter()
        .map(|w| {
            let w: std::ffi::OsString = w.into();
            let text = w.to_str().unwrap_or_default();
            past_separator |= text == "--";
            let Some(flag) = text.strip_prefix("--").filter(|_| !past_separator) else { return w };
            let (name, value) = flag.split_once('=').map_or((flag, None), |(n, v)| (n, Some(v)));
            let Some(new) = renamed(&name.replace('-', "_")) else { return w };
            let new_flag = format!("--{}", new.replace('_', "-"));
            warnings.push(deprecation(&format!("--{name}"), &new_flag));
            value.map_or(new_flag.clone(), |v| format!("{new_flag}={v}")).into()
        })
        .collect();
    (out, warnings)
}

/// report_to as Transformers takes it: one name, or a list of names (`["none"]`, `[]` for
/// none, `["tensorboard"]`); this Trainer reports to one place besides trainer_state.json, so a list
/// names at most one other than `none`.
pub(super) fn report_to_one_or_list<'de, D: serde::Deserializer<'de>>(d: D) -> Result<ReportTo, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrList {
        One(ReportTo),
        List(Vec<ReportTo>),
    }
    let expected = "one of \"none\", \"jsonl\", \"csv\", \"tensorboard\", or a list of at most one of them (Transformers' list form)";
    match OneOrList::deserialize(d).map_err(|_| serde::de::Error::custom(format!("invalid report_to: expected {expected}")))? {
        OneOrList::One(r) => Ok(r),
        OneOrList::List(list) => {
            let mut named: Vec<ReportTo> = list.into_iter().filter(|r| *r != ReportTo::None).collect();
            named.dedup();
            match named.as_slice() {
                [] => Ok(ReportTo::None),
                [one] => Ok(*one),
                _ => {
                    let given = serde_json::to_string(&named).unwrap_or_default();
                    Err(serde::de::Error::custom(format!("invalid report_to {given}: expected {expected}")))
                }
            }
        }
    }
}
