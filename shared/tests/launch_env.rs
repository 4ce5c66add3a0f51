//! The torchrun / mpirun environment contract (`DistEnv::from_lookup`).

use ladder_core::dist::env::{DistEnv, Launcher};
use ladder_core::Error;
use std::collections::HashMap;

fn parse(vars: &[(&str, &str)]) -> ladder_core::Result<DistEnv> {
    let m: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    DistEnv::from_lookup(|k| m.get(k).cloned())
}

#[test]
fn nothing_set_is_world_one() {
    let env = parse(&[]).unwrap();
    assert_eq!(env, DistEnv::single());
    assert_eq!((env.rank, env.world_size, env.local_world_size), (0, 1, 1));
    assert_eq!(env.master_addr, "127.0.0.1");
    assert_eq!(env.master_port, None);
    assert_eq!(env.launcher, Launcher::None);
    // Only the rendezvous address set: still a plain single process.
    let env = parse(&[("MASTER_ADDR", "10.1.2.3"), ("MASTER_PORT", "29500")]).unwrap();
    assert_eq!((env.world_size, env.launcher), (1, Launcher::None));
    assert_eq!((env.master_addr.as_str(), env.master_port), ("10.1.2.3", Some(29500)));
}

#[test]
fn torchrun_variables() {
    let env = parse(&[
        ("RANK", "5"),
        ("LOCAL_RANK", "1"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ])
    .unwrap();
    assert_eq!(
        env,
        DistEnv {
            rank: 5,
            local_rank: 1,
            world_size: 8,
            local_world_size: 4,
            master_addr: "node0".into(),
            master_port: Some(29500),
            launcher: Launcher::Torchrun,
        }
    );
    assert!(!env.under_mpirun());
    // Without the local variables: one node, local = global.
    let env = parse(&[("RANK", "2"), ("WORLD_SIZE", "3")]).unwrap();
    assert_eq!((env.local_rank, env.local_world_size, env.launcher), (2, 3, Launcher::Torchrun));
    // WORLD_SIZE=1 alone is rank 0.
    let env = parse(&[("WORLD_SIZE", "1")]).unwrap();
    assert_eq!((env.rank, env.world_size), (0, 1));
}

#[test]
fn mpirun_variables() {
    let env = parse(&[
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_SIZE", "3"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "3"),
    ])
    .unwrap();
    assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size), (2, 3, 2, 3));
    assert_eq!(env.launcher, Launcher::Mpirun);
    assert!(env.under_mpirun());
    // Agreeing torchrun variables alongside (as ladder-run's worker sets them) are fine.
    let env =
        parse(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2"), ("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")])
            .unwrap();
    assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size), (1, 2, 1, 2));
    // mpirun -n 1 is still "under mpirun": MPI must be initialised.
    let env = parse(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "1")]).unwrap();
    assert!(env.under_mpirun());
    assert_eq!(env.world_size, 1);
}

/// Every contradiction is an `Error::Env` whose message names the variables and values.
#[test]
fn contradictions_are_typed_errors() {
    let cases: &[(&str, &[(&str, &str)])] = &[
        ("rank not below world size", &[("RANK", "2"), ("WORLD_SIZE", "2")]),
        ("rank without world size", &[("RANK", "0")]),
        ("world size without rank", &[("WORLD_SIZE", "2")]),
        ("world size zero", &[("RANK", "0"), ("WORLD_SIZE", "0")]),
        ("unparsable rank", &[("RANK", "one"), ("WORLD_SIZE", "2")]),
        ("negative world size", &[("RANK", "0"), ("WORLD_SIZE", "-1")]),
        ("empty local rank", &[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "")]),
        ("local rank not below local world size", &[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "2"), ("LOCAL_WORLD_SIZE", "2")]),
        ("local world size above world size", &[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "4")]),
        ("local world size zero", &[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "0")]),
        ("local rank alone", &[("LOCAL_RANK", "1")]),
        (
            "world size disagrees with mpirun",
            &[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2"), ("RANK", "0"), ("WORLD_SIZE", "3")],
        ),
        ("rank disagrees with mpirun", &[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2"), ("RANK", "0"), ("WORLD_SIZE", "2")]),
        (
            "local rank disagrees with mpirun",
            &[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_LOCAL_RANK", "1"), ("LOCAL_RANK", "0")],
        ),
        ("mpirun rank without size", &[("OMPI_COMM_WORLD_RANK", "0")]),
        ("mpirun size without rank", &[("OMPI_COMM_WORLD_SIZE", "2")]),
        ("mpirun rank not below size", &[("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "2")]),
        ("unparsable mpirun size", &[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2x")]),
        ("master port zero", &[("MASTER_PORT", "0")]),
        ("master port too large", &[("MASTER_PORT", "70000")]),
        ("master port not a number", &[("MASTER_PORT", "http")]),
        ("empty master addr", &[("MASTER_ADDR", "")]),
    ];
    let start = std::time::Instant::now();
    let mut report = String::new();
    for (what, vars) in cases {
        match parse(vars) {
            Err(Error::Env(msg)) => report.push_str(&format!("{what}: {msg}\n")),
            other => panic!("{what}: expected Error::Env, got {other:?}"),
        }
    }
    // "Bad env -> typed error in well under a second": a generous bound for all cases.
    assert!(start.elapsed() < std::time::Duration::from_secs(1), "parsing took {:?}", start.elapsed());
    insta::assert_snapshot!(report);
}

/// Task 1 of `srun -N 2 -n 2` on the namespace cluster, as its environment read (trimmed to what
/// matters; `PMIX_RANK` is added by `--mpi=pmix`).
const SRUN_TASK1: &[(&str, &str)] = &[
    ("SLURM_JOB_ID", "123456"),
    ("SLURM_JOB_NODELIST", "sl-node[0-1]"),
    ("SLURM_LOCALID", "0"),
    ("SLURM_NNODES", "2"),
    ("SLURM_NODEID", "1"),
    ("SLURM_NODELIST", "sl-node[0-1]"),
    ("SLURM_NTASKS", "2"),
    ("SLURM_PROCID", "1"),
    ("SLURM_STEPID", "0"),
    ("SLURM_STEP_ID", "0"),
    ("SLURM_STEP_NODELIST", "sl-node[0-1]"),
    ("SLURM_STEP_NUM_TASKS", "2"),
    ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"),
    ("SLURM_TASKS_PER_NODE", "1(x2)"),
];

fn with(base: &[(&'static str, &'static str)], set: &[(&'static str, &'static str)], unset: &[&str]) -> Vec<(&'static str, &'static str)> {
    let mut v: Vec<_> = base.iter().filter(|(k, _)| !unset.contains(k) && !set.iter().any(|(s, _)| s == k)).copied().collect();
    v.extend_from_slice(set);
    v
}

#[test]
fn srun_variables() {
    let env = parse(SRUN_TASK1).unwrap();
    assert_eq!(
        env,
        DistEnv {
            rank: 1,
            local_rank: 0,
            world_size: 2,
            local_world_size: 1,
            master_addr: "sl-node0".into(),
            master_port: Some(18456), // Lightning's rule: last four digits of the job id + 15000
            launcher: Launcher::Srun { pmix: false },
        }
    );
    assert!(!env.under_mpirun(), "srun without --mpi=pmix cannot form an MPI world");
    let env = parse(&with(SRUN_TASK1, &[("PMIX_RANK", "1")], &[])).unwrap();
    assert_eq!(env.launcher, Launcher::Srun { pmix: true });
    assert!(env.under_mpirun());
    // `srun -N 4 -n 7` with 2+2+2+1 tasks: the fourth node's only task.
    let env = parse(&with(
        SRUN_TASK1,
        &[
            ("SLURM_PROCID", "6"),
            ("SLURM_STEP_NUM_TASKS", "7"),
            ("SLURM_NODEID", "3"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x3),1"),
            ("SLURM_STEP_NODELIST", "gpu[07-10],login1"),
        ],
        &[],
    ))
    .unwrap();
    assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size), (6, 7, 0, 1));
    assert_eq!(env.master_addr, "gpu07");
    // The job-wide variables serve when the step ones are absent (older Slurm).
    let env = parse(&with(
        SRUN_TASK1,
        &[("SLURM_NTASKS", "4"), ("SLURM_TASKS_PER_NODE", "2(x2)"), ("SLURM_LOCALID", "1"), ("SLURM_PROCID", "3")],
        &["SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NODELIST", "SLURM_STEP_ID", "SLURM_JOB_ID"],
    ))
    .unwrap();
    assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size), (3, 4, 1, 2));
    assert_eq!((env.master_addr.as_str(), env.master_port), ("sl-node0", Some(12910)));
    // MASTER_ADDR and MASTER_PORT win over Slurm's.
    let env = parse(&with(SRUN_TASK1, &[("MASTER_ADDR", "10.213.0.9"), ("MASTER_PORT", "29500")], &[])).unwrap();
    assert_eq!((env.master_addr.as_str(), env.master_port, env.rank), ("10.213.0.9", Some(29500), 1));
}

#[test]
fn slurm_precedence() {
    // A batch script (no step): Slurm's job variables describe the allocation, not this
    // process, which runs plainly.
    let batch = with(SRUN_TASK1, &[("SLURM_PROCID", "0"), ("SLURM_NODEID", "0")], &["SLURM_STEP_ID", "SLURM_STEPID"]);
    assert_eq!(parse(&batch).unwrap(), DistEnv::single());
    // torchrun's variables win (ladder-run --backend nccl, or a script exporting them).
    let env = parse(&with(SRUN_TASK1, &[("RANK", "3"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "29400")], &[])).unwrap();
    assert_eq!((env.rank, env.world_size, env.launcher, env.master_port), (3, 4, Launcher::Torchrun, Some(29400)));
    // mpirun inside the allocation: its ranks inherit the step variables of the daemon that
    // started them (srun launches Open MPI's daemons), and OMPI_COMM_WORLD_* win.
    let env = parse(&with(
        SRUN_TASK1,
        &[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ],
        &[],
    ))
    .unwrap();
    assert_eq!((env.rank, env.world_size, env.local_world_size, env.launcher), (2, 4, 2, Launcher::Mpirun));
}

/// Every malformed Slurm environment is an `Error::Env` naming the variable, its value and what
/// was expected.
#[test]
fn slurm_errors() {
    let cases: Vec<(&str, Vec<(&str, &str)>)> = vec![
        ("no procid", with(SRUN_TASK1, &[], &["SLURM_PROCID"])),
        ("no task count", with(SRUN_TASK1, &[], &["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"])),
        ("no localid", with(SRUN_TASK1, &[], &["SLURM_LOCALID"])),
        ("no nodeid", with(SRUN_TASK1, &[], &["SLURM_NODEID"])),
        ("no tasks per node", with(SRUN_TASK1, &[], &["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"])),
        ("no node list", with(SRUN_TASK1, &[], &["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"])),
        ("procid not a number", with(SRUN_TASK1, &[("SLURM_PROCID", "one")], &[])),
        ("procid not below ntasks", with(SRUN_TASK1, &[("SLURM_PROCID", "2")], &[])),
        ("nodeid beyond the nodes", with(SRUN_TASK1, &[("SLURM_NODEID", "2")], &[])),
        ("localid not below the node's tasks", with(SRUN_TASK1, &[("SLURM_LOCALID", "1")], &[])),
        ("tasks per node do not add up", with(SRUN_TASK1, &[("SLURM_STEP_TASKS_PER_NODE", "2(x2)")], &[])),
        ("malformed tasks per node", with(SRUN_TASK1, &[("SLURM_STEP_TASKS_PER_NODE", "1(x2")], &[])),
        ("malformed node list", with(SRUN_TASK1, &[("SLURM_STEP_NODELIST", "sl-node[0-1")], &[])),
        ("descending range", with(SRUN_TASK1, &[("SLURM_STEP_NODELIST", "sl-node[1-0]")], &[])),
        ("pmix rank disagrees", with(SRUN_TASK1, &[("PMIX_RANK", "0")], &[])),
    ];
    let mut report = String::new();
    for (what, vars) in &cases {
        match parse(vars) {
            Err(Error::Env(msg)) => report.push_str(&format!("{what}: {msg}\n")),
            other => panic!("{what}: expected Error::Env, got {other:?}"),
        }
    }
    insta::assert_snapshot!(report);
}

/// The mpi backend in an srun task without PMIx: refused before `MPI_Init` (which would abort
/// with Open MPI's "OMPI was not built with SLURM's PMI support"), saying what to do instead.
#[test]
fn srun_without_pmix_refuses_the_mpi_backend() {
    let env = parse(SRUN_TASK1).unwrap();
    let err = ladder_core::dist::init_with_env(ladder_core::dist::Backend::Mpi, &env).unwrap_err().to_string();
    insta::assert_snapshot!(err);
}
