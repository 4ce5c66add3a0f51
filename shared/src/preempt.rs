//! A checkpoint on preemption, as Transformers' save-on-SIGTERM: Slurm (and a spot instance's
//! notice, and `ladder-run` when it is stopped) sends SIGTERM some seconds before the kill.
//!
//! A program that [`watch`]es SIGTERM is not ended by it: the signal is noted. The training
//! loop asks [`agree`] once per optimizer step — one all-reduce of one number — so that every
//! rank learns at the same step that some rank was signalled; every rank then finishes that
//! step, one checkpoint is written (atomically: a second signal or a SIGKILL during the save
//! leaves the previous one in place), and the program exits with [`PREEMPTED_EXIT_CODE`].
//! Resuming from that checkpoint continues bit-identically.
//!
//! Call [`watch`] before the process group is initialised (the progress record's SIGTERM
//! handler is installed only where SIGTERM still has its default action) and on every rank,
//! or on none: [`agree`] is collective.

use crate::dist::{ProcessGroup, ReduceOp};
use crate::{Error, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

/// The exit code of a run that stopped after writing its checkpoint on SIGTERM: 128 + 15, the
/// code a process ended by SIGTERM reports, so schedulers and launchers read it as
/// "terminated on request" (not a failure of the program).
pub const PREEMPTED_EXIT_CODE: i32 = 128 + libc::SIGTERM;

/// The flag the SIGTERM handler sets, once [`watch`] installed it.
static FLAG: OnceLock<Arc<AtomicBool>> = OnceLock::new();

/// Set once the checkpoint of a preempted run is written: [`crate::metrics::finish`] then
/// exits with [`PREEMPTED_EXIT_CODE`].
static SAVED: AtomicBool = AtomicBool::new(false);

/// Records that the preemption checkpoint is written (the program then returns an error to
/// unwind, and exits with [`PREEMPTED_EXIT_CODE`] through [`crate::metrics::finish`]).
pub fn mark_saved() {
    SAVED.store(true, Ordering::SeqCst);
}

/// Whether [`mark_saved`] was called.
pub fn saved() -> bool {
    SAVED.load(Ordering::SeqCst)
}

/// Notes SIGTERM instead of dying of it, from now on in this process (idempotent).
///
/// # Errors
/// [`Error::Launch`] when the handler cannot be installed.
pub fn watch() -> Result<()> {
    if FLAG.get().is_some() {
        return Ok(());
    }
    let flag = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(libc::SIGTERM, flag.clone()).map_err(|e| Error::Launch(format!("cannot watch SIGTERM: {e}")))?;
    let _ = FLAG.set(flag);
    Ok(())
}

/// Whether [`watch`] was called in this process.
pub fn is_watching() -> bool {
    FLAG.get().is_some()
}

/// Whether this process received SIGTERM since [`watch`].
pub fn requested() -> bool {
    FLAG.get().is_some_and(|f| f.load(Ordering::SeqCst))
}

/// Whether any rank of `pg` received SIGTERM: every rank gets the same answer at the same
/// call (an all-reduce of one number, `MAX`). Collective when watching; `false` without a call
/// to [`watch`] (no collective).
///
/// # Errors
/// Collective errors.
pub fn agree(pg: &dyn ProcessGroup) -> Result<bool> {
    if !is_watching() {
        return Ok(false);
    }
    if pg.world_size() == 1 {
        return Ok(requested());
    }
    let mut t = tch::Tensor::from_slice(&[f32::from(u8::from(requested()))]).to_device(pg.device());
    pg.all_reduce(&mut t, ReduceOp::Max)?;
    Ok(t.double_value(&[0]) > 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run in a child process (this test binary again): the signal dispositions are the
    /// process's, and other tests of this binary install and restore SIGTERM handlers
    /// (`sys::install_termination_handlers`), after which a SIGTERM raised here would end them all.
    #[test]
    fn sigterm_is_noted_not_obeyed() {
        const NAME: &str = "preempt::tests::sigterm_is_noted_not_obeyed";
        if std::env::var_os("LADDER_PREEMPT_CHILD").is_none() {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", NAME, "--nocapture", "--test-threads", "1"])
                .env("LADDER_PREEMPT_CHILD", "1")
                .output()
                .unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(out.status.success() && text.contains("SIGTERM noted"), "the child ({}): {text}", out.status);
            return;
        }
        assert!(!requested());
        watch().unwrap();
        watch().unwrap();
        assert!(is_watching() && !requested());
        nix::sys::signal::raise(nix::sys::signal::Signal::SIGTERM).unwrap();
        assert!(requested(), "SIGTERM was not noted");
        assert_eq!(PREEMPTED_EXIT_CODE, 143);
        println!("SIGTERM noted");
    }
}
