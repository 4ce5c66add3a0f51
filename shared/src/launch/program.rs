//! The first word after a launcher's own flags, which it runs as PROGRAM: refused when it is a
//! flag the launcher does not know (everything after the known flags goes to PROGRAM, so
//! `ladder-run --standalone prog` would read `--standalone` as PROGRAM), with what the
//! reference launcher's flag is here; and a program named without a `/` that is not in PATH
//! but exists in the working directory, named as such.

use crate::{Error, Result};
use std::path::Path;

/// A reference launcher's flag that a launcher here does not take, and what does its job.
pub type FlagHint = (&'static str, &'static str);

/// torchrun's flags that `ladder-run` does not take, and what does their job here.
pub const TORCHRUN_HINTS: &[FlagHint] = &[
    (
        "--standalone",
        "ladder-run on one node (--nnodes 1, the default) already does what torchrun's --standalone does, a local \
         rendezvous on a free port: leave it out",
    ),
    ("--rdzv-backend", "ladder-run's rendezvous is static (torchrun's --rdzv-backend static): give --master-addr and --master-port"),
    ("--rdzv-endpoint", "give the rendezvous as --master-addr ADDR --master-port PORT"),
    ("--rdzv-id", "not needed: the rendezvous is --master-addr and --master-port"),
    ("--no-python", "not needed: ladder-run always runs PROGRAM as an executable (torchrun's --no-python)"),
    ("--module", "ladder-run runs an executable, not a Python module: give its path"),
    ("-m", "ladder-run runs an executable, not a Python module: give its path"),
];

/// Checks that `word`, the first word after `launcher`'s own flags, is not a flag.
///
/// # Errors
/// [`Error::UnknownFlag`] for a word starting with `-`, naming the launcher and the flag, with
/// the hint `hints` gives for it (spelled with `-` or `_`, with or without `=VALUE`), else the
/// nearest of the launcher's `known` long flags (`--num-procs`: `--num-processes`), else where
/// flags go.
pub fn check_not_a_flag(launcher: &str, word: &str, known: &[String], hints: &[FlagHint]) -> Result<()> {
    if !word.starts_with('-') || word == "-" {
        return Ok(());
    }
    let name = word.split('=').next().unwrap_or(word);
    let key = |f: &str| f.trim_start_matches('-').replace('_', "-");
    let hint = hints.iter().find(|(f, _)| key(f) == key(name)).map(|(_, h)| h.to_string());
    let hint = hint.or_else(|| {
        known
            .iter()
            .map(|k| (strsim::jaro_winkler(&key(name), k), k))
            .filter(|(score, _)| *score > 0.8)
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, k)| format!("did you mean --{k}?"))
    });
    Err(Error::UnknownFlag {
        launcher: launcher.to_string(),
        flag: name.to_string(),
        hint: hint.unwrap_or_else(|| "it is none of its flags, see its --help".into()),
    })
}

/// Why `program`, named without a `/`, was not found in PATH when the working directory holds
/// a file of that name (a name without `/` is looked up in PATH only, as the shell does).
pub fn not_in_path_but_here(program: &str) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    if program.contains('/') || !Path::new(program).is_file() {
        return None;
    }
    let executable = std::fs::metadata(program).is_ok_and(|m| m.permissions().mode() & 0o111 != 0);
    Some(if executable {
        format!("./{program} exists here: a name without '/' is looked up in PATH only; give its path, ./{program}")
    } else {
        format!("./{program} exists here but is not executable (chmod +x {program}), and a name without '/' is looked up in PATH only")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_flags_get_the_reference_launchers_equivalent_or_the_nearest_flag() {
        let known: Vec<String> = ["nproc-per-node", "nnodes", "num-processes", "num-machines"].map(String::from).to_vec();
        let err = |w: &str| check_not_a_flag("ladder-run", w, &known, TORCHRUN_HINTS).unwrap_err().to_string();
        assert!(
            err("--standalone").starts_with("unknown flag --standalone for ladder-run: ladder-run on one node (--nnodes 1"),
            "{}",
            err("--standalone")
        );
        assert!(err("--rdzv_backend=c10d").starts_with("unknown flag --rdzv_backend for ladder-run: ladder-run's rendezvous is static"));
        assert!(err("-m").contains("not a Python module"));
        assert_eq!(err("--num-procs"), "unknown flag --num-procs for ladder-run: did you mean --num-processes? (ladder-run's flags go before PROGRAM, PROGRAM's after it)");
        assert_eq!(err("--frobnicate"), "unknown flag --frobnicate for ladder-run: it is none of its flags, see its --help (ladder-run's flags go before PROGRAM, PROGRAM's after it)");
        assert!(check_not_a_flag("ladder-run", "prog", &known, TORCHRUN_HINTS).is_ok());
        assert!(check_not_a_flag("ladder-run", "./prog", &known, TORCHRUN_HINTS).is_ok());
    }
}
