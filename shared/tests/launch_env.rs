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
