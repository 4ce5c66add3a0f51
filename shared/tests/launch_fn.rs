//! `launch(n, f)`, the notebook_launcher analogue.
//!
//! `launch` re-executes this test binary (same arguments) as each rank, so this file holds
//! exactly one test, and everything the test does before a `launch` call runs in the ranks too:
//! the shared directory and the case to run travel in environment variables, which the ranks
//! inherit through mpirun.

use ladder_core::dist::env::DistEnv;
use ladder_core::launch::launch;
use ladder_core::Error;

const DIR_VAR: &str = "LADDER_TEST_LAUNCH_DIR";
const CASE_VAR: &str = "LADDER_TEST_LAUNCH_CASE";

/// Set in the child process that runs the test's body (see below).
const INNER_VAR: &str = "LADDER_TEST_LAUNCH_INNER";

#[test]
fn launch_runs_f_in_every_rank_and_names_a_failed_rank() {
    if std::env::var_os(INNER_VAR).is_none() && std::env::var_os("LADDER_LAUNCH_ROLE").is_none() {
        // The body runs in a child process: `launch` relays the ranks' output (rank 1's panic
        // message among it) straight to file descriptors 1 and 2, past the test harness's
        // capture, and it belongs to this test's output, not to `cargo test`'s.
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "launch_runs_f_in_every_rank_and_names_a_failed_rank", "--nocapture", "--test-threads", "1"])
            .env(INNER_VAR, "1")
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "the test body failed:\n{text}");
        assert!(text.contains("[rank1]: panicked: rank 1 gives up"), "rank 1's panic is relayed:\n{text}");
        return;
    }
    // Parent: make the shared directory; ranks: find it in the environment.
    let keep;
    let dir = match std::env::var(DIR_VAR) {
        Ok(d) => std::path::PathBuf::from(d),
        Err(_) => {
            keep = tempfile::tempdir().unwrap();
            std::env::set_var(DIR_VAR, keep.path());
            keep.path().to_path_buf()
        }
    };

    if std::env::var(CASE_VAR).as_deref() != Ok("fail") {
        // Case 1: two ranks each write their rank into a file.
        let write_dir = dir.clone();
        // ANCHOR: launch_two_ranks
        launch(2, move || {
            let env = DistEnv::from_env()?;
            assert!(env.under_mpirun(), "ranks run under mpirun");
            let file = write_dir.join(format!("rank{}", env.rank));
            std::fs::write(&file, format!("{} of {}", env.rank, env.world_size)).map_err(|e| Error::io(&file, e))
        })
        .expect("both ranks succeed");
        // ANCHOR_END: launch_two_ranks
        let mut names: Vec<String> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        assert_eq!(names, ["rank0", "rank1"]);
        assert_eq!(std::fs::read_to_string(dir.join("rank0")).unwrap(), "0 of 2");
        assert_eq!(std::fs::read_to_string(dir.join("rank1")).unwrap(), "1 of 2");
        std::env::set_var(CASE_VAR, "fail");
    }

    // Case 2: rank 1 panics mid-run; rank 0 would wait forever for it.
    let err = launch(2, || {
        let env = DistEnv::from_env()?;
        if env.rank == 1 {
            panic!("rank 1 gives up");
        }
        std::thread::sleep(std::time::Duration::from_secs(60));
        Ok(())
    })
    .expect_err("rank 1 fails");
    match &err {
        Error::RankFailed { rank, exitcode, summary } => {
            assert_eq!(*rank, 1, "{summary}");
            assert_eq!(*exitcode, 101, "a Rust panic exits 101: {summary}");
            assert!(summary.contains("rank 1 gives up"), "{summary}");
        }
        other => panic!("expected Error::RankFailed, got {other:?}"),
    }
    // n == 0 is refused before starting anything.
    assert!(matches!(launch(0, || Ok(())), Err(Error::InvalidValue { .. })));
}
