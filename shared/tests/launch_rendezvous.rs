//! The TCP rendezvous store on loopback, with threads as ranks.

use ladder_core::dist::env::{DistEnv, Launcher};
use ladder_core::dist::rendezvous::TcpStore;
use ladder_core::Error;
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap().local_addr().unwrap().port()
}

fn env(rank: usize, world_size: usize, port: u16) -> DistEnv {
    DistEnv {
        rank,
        local_rank: rank,
        world_size,
        local_world_size: world_size,
        master_addr: "127.0.0.1".into(),
        master_port: Some(port),
        launcher: Launcher::Torchrun,
    }
}

/// Runs `ranks` (rank numbers, possibly repeated) as threads against one store.
fn run_ranks<T: Send + 'static>(
    ranks: &[usize],
    world_size: usize,
    port: u16,
    timeout: Duration,
    f: impl Fn(usize, &TcpStore) -> T + Send + Sync + Copy + 'static,
) -> Vec<ladder_core::Result<T>> {
    let handles: Vec<_> = ranks
        .iter()
        .map(|&r| {
            std::thread::spawn(move || {
                let store = TcpStore::connect(&env(r, world_size, port), timeout)?;
                Ok(f(r, &store))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn problem(e: &Error) -> String {
    match e {
        Error::Rendezvous { problem, .. } => problem.clone(),
        other => panic!("expected Error::Rendezvous, got {other:?}"),
    }
}

#[test]
fn three_ranks_exchange_values() {
    let port = free_port();
    let results = run_ranks(&[0, 1, 2], 3, port, Duration::from_secs(10), |r, store| {
        // Rank 0 publishes the "unique id"; everybody publishes its own key, reads everybody's.
        if r == 0 {
            store.set("unique_id", &[7u8; 128]).unwrap();
        }
        store.set(&format!("rank{r}"), format!("hello from {r}").as_bytes()).unwrap();
        let id = store.get("unique_id").unwrap();
        let all: Vec<String> = (0..3).map(|k| String::from_utf8(store.get(&format!("rank{k}")).unwrap()).unwrap()).collect();
        (id, all)
    });
    for (r, res) in results.into_iter().enumerate() {
        let (id, all) = res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(id, vec![7u8; 128], "rank {r}");
        assert_eq!(all, vec!["hello from 0", "hello from 1", "hello from 2"], "rank {r}");
    }
}

#[test]
fn missing_rank_times_out_naming_it() {
    let port = free_port();
    let start = Instant::now();
    let results = run_ranks(&[0, 1], 3, port, Duration::from_secs(1), |_, _| ());
    assert!(start.elapsed() < Duration::from_secs(8), "took {:?}", start.elapsed());
    for res in results {
        let e = res.expect_err("rank 2 never came; the rendezvous cannot complete");
        let p = problem(&e);
        assert!(p.contains("waiting for ranks [2] of world size 3"), "{p}");
        assert!(p.contains("never checked in"), "{p}");
        assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
    }
}

#[test]
fn duplicate_rank_is_named() {
    let port = free_port();
    let start = Instant::now();
    // Two processes claim rank 1; rank 2 never comes. The duplicate is reported, not a timeout.
    let results = run_ranks(&[0, 1, 1], 3, port, Duration::from_secs(20), |_, _| ());
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    for res in results {
        let p = problem(&res.expect_err("a duplicate rank fails the rendezvous"));
        assert!(p.contains("duplicate rank 1"), "{p}");
    }
}

#[test]
fn port_in_use_is_reported_as_such() {
    let taken = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = taken.local_addr().unwrap().port();
    let e = TcpStore::connect(&env(0, 2, port), Duration::from_secs(1)).unwrap_err();
    match &e {
        Error::Rendezvous { addr, problem } => {
            assert_eq!(addr, &format!("127.0.0.1:{port}"));
            assert!(problem.starts_with("port in use"), "{problem}");
        }
        other => panic!("expected Error::Rendezvous, got {other:?}"),
    }
}

#[test]
fn no_master_port_is_an_env_error() {
    let mut e = env(0, 2, 1);
    e.master_port = None;
    match TcpStore::connect(&e, Duration::from_secs(1)) {
        Err(Error::Env(msg)) => assert!(msg.contains("MASTER_PORT is not set"), "{msg}"),
        other => panic!("expected Error::Env, got {other:?}"),
    }
}

#[test]
fn get_of_a_key_never_set_times_out_naming_it() {
    let port = free_port();
    let store = TcpStore::connect(&env(0, 1, port), Duration::from_millis(500)).unwrap();
    store.set("present", b"x").unwrap();
    assert_eq!(store.get("present").unwrap(), b"x");
    let start = Instant::now();
    let p = problem(&store.get("nccl_unique_id").unwrap_err());
    assert!(p.contains("key \"nccl_unique_id\" was not set within 500ms"), "{p}");
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn rank_zero_never_coming_up_times_out() {
    let port = free_port();
    let p = problem(&TcpStore::connect(&env(1, 2, port), Duration::from_millis(500)).unwrap_err());
    assert!(p.contains("rank 1 could not reach the store within 500ms"), "{p}");
    assert!(p.contains("rank 0, which serves it, never came up"), "{p}");
}

#[test]
fn world_size_disagreement_is_named() {
    let port = free_port();
    let p0 = std::thread::spawn(move || TcpStore::connect(&env(0, 2, port), Duration::from_secs(2)).map(|_| ()));
    std::thread::sleep(Duration::from_millis(100));
    let p = problem(&TcpStore::connect(&env(1, 3, port), Duration::from_secs(2)).unwrap_err());
    assert!(p.contains("rank 1 has world size 3 but rank 0 has 2"), "{p}");
    assert!(p0.join().unwrap().is_err(), "rank 0 cannot complete a world of 2 without rank 1");
}
