//! Multi-node for real: `scripts/cluster.sh` makes hosts out of network + UTS namespaces (own
//! hostname, own address on a private bridge), and `ladder-run --nnodes N --hostfile` runs jobs
//! across them over Open MPI's TCP transport — no shared memory between the hosts.
//!
//! Every test brings its own cluster up under a unique name and takes it down in a `Drop` guard,
//! so nothing is left behind even when an assertion fails midway. The tests need root (network
//! namespaces); CI runs as root. Elsewhere they print why they skip. They run one at a time
//! (2-core machine), so their time bounds stay meaningful.

use ladder_core::dist::{init_process_group, Backend, ReduceOp};
use ladder_core::metrics::Report;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

const LEVEL1: &str = env!("CARGO_BIN_EXE_level1-raw-ddp");
const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/cluster.sh");
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// `target/release/ladder-run`, built next to level 1 by `cargo test --workspace`.
fn ladder_run() -> PathBuf {
    let p = Path::new(LEVEL1).with_file_name("ladder-run");
    assert!(p.is_file(), "{} is not built: run `cargo build --release -p ladder-core --bins` first", p.display());
    p
}

/// Why these tests cannot run here, if they cannot: not root, or no namespaces allowed.
fn unavailable() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let uid = status.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|l| l.split_whitespace().nth(1)).unwrap_or("?");
    if uid != "0" {
        return Some(format!("not root (effective uid {uid}); network namespaces need root, as in CI"));
    }
    match Command::new("unshare").args(["--net", "--uts", "true"]).output() {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!("this machine refuses new namespaces: {}", String::from_utf8_lossy(&o.stderr).trim())),
        Err(e) => Some(format!("unshare (util-linux) cannot run: {e}")),
    }
}

macro_rules! need_cluster {
    () => {
        if let Some(why) = unavailable() {
            eprintln!("skipped: {why}");
            return;
        }
    };
}

/// A cluster of namespace hosts, taken down on drop (also when the test panics).
struct Cluster {
    name: String,
    nodes: usize,
}

impl Cluster {
    /// `cluster.sh --name <unique> up nodes`.
    fn up(tag: &str, nodes: usize) -> Cluster {
        static N: AtomicUsize = AtomicUsize::new(0);
        let name = format!("t{}-{}{}", std::process::id() % 100_000, tag, N.fetch_add(1, Ordering::SeqCst));
        let cluster = Cluster { name, nodes };
        let out = cluster.script(&["up", &nodes.to_string()]).output().expect("run scripts/cluster.sh");
        assert!(
            out.status.success(),
            "cluster.sh up {nodes} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        cluster
    }

    fn script(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("bash");
        cmd.arg(SCRIPT).args(["--name", &self.name]).args(args);
        cmd
    }

    fn host(&self, node: usize) -> String {
        format!("{}-node{node}", self.name)
    }

    fn hostfile(&self) -> String {
        format!("/run/ddp-ladder-cluster/{}/hostfile", self.name)
    }

    /// `ladder-run ARGS...` started on host 0.
    fn ladder_run(&self, args: &[&str]) -> Command {
        let mut cmd = self.script(&["exec", "0"]);
        cmd.arg(ladder_run()).args(args);
        cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        cmd
    }

    /// `ip -n HOST link set eth0 down`: the host drops off the network.
    fn link_down(&self, node: usize) {
        let st = Command::new("ip").args(["-n", &self.host(node), "link", "set", "eth0", "down"]).status().unwrap();
        assert!(st.success(), "ip link set down on {}", self.host(node));
    }

    /// The inode of each host's network namespace.
    fn netns_inodes(&self) -> Vec<u64> {
        use std::os::unix::fs::MetadataExt;
        (0..self.nodes).filter_map(|i| std::fs::metadata(format!("/run/netns/{}", self.host(i))).ok().map(|m| m.ino())).collect()
    }

    /// Live processes inside any of the hosts: `(pid, host index, command line)`.
    fn processes(&self) -> Vec<(u32, usize, String)> {
        use std::os::unix::fs::MetadataExt;
        let inodes = self.netns_inodes();
        let mut found = Vec::new();
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
            let Ok(ns) = std::fs::metadata(entry.path().join("ns/net")) else { continue };
            let Some(node) = inodes.iter().position(|i| *i == ns.ino()) else { continue };
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            if stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z')) {
                continue;
            }
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            found.push((pid, node, String::from_utf8_lossy(&cmdline).replace('\0', " ").trim().to_string()));
        }
        found
    }

    /// Asserts that no process is left on any host (they get a moment to be reaped).
    fn assert_no_processes(&self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let left = self.processes();
            if left.is_empty() {
                return;
            }
            assert!(Instant::now() < deadline, "processes left on the cluster's hosts: {left:#?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let out = self.script(&["down"]).output();
        let ok = out.as_ref().is_ok_and(|o| o.status.success());
        let gone = !Path::new(&format!("/run/ddp-ladder-cluster/{}", self.name)).exists()
            && (0..self.nodes).all(|i| !Path::new(&format!("/run/netns/{}", self.host(i))).exists())
            && !Path::new(&format!("/run/netns/{}-hub", self.name)).exists();
        if !(std::thread::panicking() || ok && gone) {
            panic!("cluster.sh down left cluster {} behind: {out:?}", self.name);
        }
    }
}

/// `cluster.sh` itself: `up` twice is one cluster, `down` after a run that left processes behind
/// removes them with the namespaces, the network and the files, and `down` twice is fine; not
/// being root is a clear error.
#[test]
fn cluster_sh_is_idempotent_and_down_removes_everything() {
    need_cluster!();
    let _s = serial();
    let c = Cluster::up("idem", 2);
    let again = c.script(&["up", "2"]).output().unwrap();
    assert!(again.status.success() && String::from_utf8_lossy(&again.stdout).contains("2 hosts already up"), "{again:?}");
    // A "failed run": a process left on each host.
    let mut left = Vec::new();
    for node in 0..2 {
        let mut cmd = c.script(&["exec", &node.to_string(), "sleep", "1000"]);
        left.push(cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap());
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.processes().iter().filter(|(_, _, cmd)| cmd == "sleep 1000").count() < 2 {
        assert!(Instant::now() < deadline, "the sleeps never started: {:#?}", c.processes());
        std::thread::sleep(Duration::from_millis(50));
    }
    let inodes = c.netns_inodes();
    for _ in 0..2 {
        let down = c.script(&["down"]).output().unwrap();
        assert!(down.status.success(), "{down:?}");
    }
    for mut child in left {
        assert!(!child.wait().unwrap().success(), "the process left on a host was killed");
    }
    let mut in_cluster = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        use std::os::unix::fs::MetadataExt;
        if let Ok(ns) = std::fs::metadata(entry.path().join("ns/net")) {
            if inodes.contains(&ns.ino()) {
                in_cluster.push(entry.file_name());
            }
        }
    }
    assert!(in_cluster.is_empty(), "processes still in the cluster's namespaces: {in_cluster:?}");
    let netns =
        std::fs::read_dir("/run/netns").map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect::<Vec<_>>());
    assert!(netns.unwrap_or_default().iter().all(|n| !n.starts_with(&c.name)), "a namespace of {} is left", c.name);
    let links = Command::new("ip").args(["-o", "link"]).output().unwrap();
    assert!(!String::from_utf8_lossy(&links.stdout).contains(&c.name), "a link of {} in the machine's namespace", c.name);
    assert!(!Path::new(&format!("/run/ddp-ladder-cluster/{}", c.name)).exists());
    assert!(!Path::new(&format!("/etc/netns/{}-node0", c.name)).exists());

    // Not root: refused before anything is touched.
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "bash", SCRIPT, "--name", &c.name, "up", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("cluster.sh: error: must run as root"), "{out:?}");
}

#[derive(Debug)]
struct Output {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

/// Runs `cmd`, calling `during(elapsed, stdout so far)` every 50 ms; fails past `limit`.
fn run(mut cmd: Command, limit: Duration, mut during: impl FnMut(Duration, &str)) -> Output {
    let start = Instant::now();
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start");
    let so_far = std::sync::Arc::new(Mutex::new(String::new()));
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let sink = so_far.clone();
    let t_out = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = out.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} still running after {limit:?}; output so far:\n{}", so_far.lock().unwrap());
        }
        let text = so_far.lock().unwrap().clone();
        during(start.elapsed(), &text);
        std::thread::sleep(Duration::from_millis(50));
    };
    let elapsed = start.elapsed();
    t_out.join().unwrap();
    let stdout = so_far.lock().unwrap().clone();
    Output { code: status.code(), stdout, stderr: t_err.join().unwrap(), elapsed }
}

fn sorted_lines(s: &str) -> Vec<String> {
    let mut v: Vec<String> = s.lines().map(str::to_string).collect();
    v.sort();
    v
}

/// What each rank sees: its host name and the torchrun variables.
const WHO: &str = r#"echo "host=$(hostname) GROUP_RANK=$GROUP_RANK RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE""#;

#[test]
fn two_hosts_one_rank_each_train_level1_in_sync() {
    need_cluster!();
    let _s = serial();
    let c = Cluster::up("sync", 2);
    let hf = c.hostfile();
    let base = ["--nnodes", "2", "--nproc-per-node", "1", "--hostfile", hf.as_str()];

    // Each rank on its own host, knowing its node rank.
    let mut args = base.to_vec();
    args.extend(["sh", "-c", WHO]);
    let out = run(c.ladder_run(&args), Duration::from_secs(60), |_, _| {});
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        sorted_lines(&out.stdout),
        (0..2).map(|r| format!("[rank{r}]: host={} GROUP_RANK={r} RANK={r} LOCAL_RANK=0 WORLD_SIZE=2", c.host(r))).collect::<Vec<_>>()
    );

    // Level 1 across the two hosts: a few steps, then bit-identical parameters.
    let json = tempfile::tempdir().unwrap();
    let json = json.path().join("m.json");
    let mut args = base.to_vec();
    args.extend([LEVEL1, "--device", "cpu", "--max-steps", "10", "--log-interval", "0", "--check-sync", "--metrics-json"]);
    args.push(json.to_str().unwrap());
    let out = run(c.ladder_run(&args), Duration::from_secs(240), |_, _| {});
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("[rank0]: check-sync: parameters are bit-identical on all 2 ranks"), "{out:?}");
    let report: Report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!((report.world_size, report.steps, report.eval_samples, report.ranks.len()), (2, 10, 10_000, 2));
    c.assert_no_processes();
}

/// HSDP across hosts: 2 hosts x 2 ranks, `--strategy fsdp-hybrid-shard` with the default mesh
/// (shard groups = the ranks of one host, LOCAL_WORLD_SIZE = 2; replicas across the hosts),
/// against the same job on one host with the mesh given (`--dp-shard-size 2`): the same
/// training and test figures — the shard groups' reductions are of two values, exact in any
/// order, so only the evaluation's sums over 4 ranks may round differently.
#[test]
fn hybrid_shard_across_two_hosts_equals_the_one_host_run() {
    need_cluster!();
    let _s = serial();
    let dir = tempfile::tempdir().unwrap();
    let level1 = |json: &Path| -> Vec<String> {
        let args = [LEVEL1, "--device", "cpu", "--strategy", "fsdp-hybrid-shard", "--max-steps", "4", "--log-interval", "0", "--explain"];
        let mut v: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        v.extend(["--metrics-json".to_string(), json.to_str().unwrap().to_string()]);
        v
    };
    let one_host = dir.path().join("one.json");
    let mut args = vec!["--nproc-per-node".to_string(), "4".to_string()];
    args.extend(level1(&one_host));
    args.extend(["--dp-shard-size".to_string(), "2".to_string()]);
    let mut cmd = Command::new(ladder_run());
    cmd.args(&args).env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1").env("OMP_NUM_THREADS", "1");
    let out = run(cmd, Duration::from_secs(240), |_, _| {});
    assert_eq!(out.code, Some(0), "{out:?}");

    let c = Cluster::up("hsdp", 2);
    let hf = c.hostfile();
    let two_hosts = dir.path().join("two.json");
    let mut args: Vec<String> =
        ["--nnodes", "2", "--nproc-per-node", "2", "--hostfile", hf.as_str()].iter().map(|a| a.to_string()).collect();
    args.extend(level1(&two_hosts));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut cmd = c.ladder_run(&args);
    cmd.env("OMP_NUM_THREADS", "1");
    let out = run(cmd, Duration::from_secs(240), |_, _| {});
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("sharding_strategy HYBRID_SHARD"), "{out:?}");
    assert!(out.stdout.contains("shard group size 2"), "the default mesh: one host's 2 ranks per shard group: {out:?}");
    let read = |p: &Path| -> Report { serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap() };
    let (a, b) = (read(&one_host), read(&two_hosts));
    assert_eq!((a.world_size, a.steps, a.strategy.as_str()), (4, 4, "fsdp-hybrid-shard"));
    assert_eq!((b.world_size, b.steps, b.strategy.as_str()), (4, 4, "fsdp-hybrid-shard"));
    assert_eq!((a.train_loss, a.accuracy, a.eval_samples), (b.train_loss, b.accuracy, b.eval_samples), "one host vs two");
    assert!((a.test_loss - b.test_loss).abs() <= 1e-9 * a.test_loss.abs(), "test loss {} vs {}", a.test_loss, b.test_loss);
    c.assert_no_processes();
}

/// The rank body of the all-reduce tests (run by `all_reduce_across_hosts`, not by itself): each
/// rank fills tensors of several sizes with (rank + 1)·(i mod 7 + 1) and checks Sum, Avg, Max and
/// Min against their closed forms.
#[test]
#[ignore = "a rank body: run by all_reduce_across_hosts_* under ladder-run"]
fn rank_all_reduce_closed_form() {
    let pg = init_process_group(Backend::Mpi).unwrap();
    let (r, w) = (pg.rank() as f64, pg.world_size() as f64);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    println!("host={} GROUP_RANK={} RANK={}", host.trim(), std::env::var("GROUP_RANK").unwrap(), pg.rank());
    // 1 element, 4 KiB, and 4 MiB (past every eager limit: TCP's rendezvous protocol).
    for numel in [1i64, 1024, 1 << 20] {
        for kind in [Kind::Float, Kind::Double] {
            let pattern = Tensor::arange(numel, (Kind::Int64, Device::Cpu)).remainder(7) + 1;
            let pattern = pattern.to_kind(kind);
            for (op, factor) in
                [(ReduceOp::Sum, w * (w + 1.0) / 2.0), (ReduceOp::Avg, (w + 1.0) / 2.0), (ReduceOp::Max, w), (ReduceOp::Min, 1.0)]
            {
                let mut t = &pattern * (r + 1.0);
                pg.all_reduce(&mut t, op).unwrap();
                let expected = &pattern * factor;
                let diff = (&t - &expected).abs().max().double_value(&[]);
                assert!(diff <= 1e-6 * factor, "{op:?} {kind:?} numel {numel}: max |diff| {diff} at W={w}");
            }
        }
    }
    println!("all_reduce closed forms hold at W={w}");
    pg.shutdown();
}

fn all_reduce_across_hosts(nproc_per_node: usize) {
    let c = Cluster::up("ar", 2);
    let hf = c.hostfile();
    let npn = nproc_per_node.to_string();
    let exe = std::env::current_exe().unwrap();
    let args = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        &npn,
        "--hostfile",
        &hf,
        exe.to_str().unwrap(),
        "--ignored",
        "--exact",
        "rank_all_reduce_closed_form",
        "--test-threads",
        "1",
        "--nocapture",
    ];
    let mut cmd = c.ladder_run(&args);
    cmd.env("OMP_NUM_THREADS", "1");
    let out = run(cmd, Duration::from_secs(120), |_, _| {});
    assert_eq!(out.code, Some(0), "{out:?}");
    let w = 2 * nproc_per_node;
    for rank in 0..w {
        let node = rank / nproc_per_node;
        // (libtest's "test … " may precede it on the line)
        let who = format!("host={} GROUP_RANK={node} RANK={rank}", c.host(node));
        assert!(out.stdout.lines().any(|l| l.starts_with(&format!("[rank{rank}]: ")) && l.ends_with(&who)), "missing {who:?}:\n{out:?}");
        assert!(out.stdout.contains(&format!("[rank{rank}]: all_reduce closed forms hold at W={w}")), "{out:?}");
    }
    c.assert_no_processes();
}

#[test]
fn all_reduce_across_hosts_w2() {
    need_cluster!();
    let _s = serial();
    all_reduce_across_hosts(1);
}

/// The hosts share no memory path: with Open MPI's TCP transport taken away (only `self` and
/// shared memory, `vader`), ranks on two hosts cannot reach each other, so the runs above went
/// over TCP.
#[test]
fn without_tcp_the_hosts_cannot_talk() {
    need_cluster!();
    let _s = serial();
    let c = Cluster::up("shm", 2);
    let hf = c.hostfile();
    let exe = std::env::current_exe().unwrap();
    let mut cmd = c.ladder_run(&[
        "--nnodes",
        "2",
        "--hostfile",
        &hf,
        exe.to_str().unwrap(),
        "--ignored",
        "--exact",
        "rank_all_reduce_closed_form",
        "--nocapture",
    ]);
    cmd.env("OMPI_MCA_btl", "self,vader");
    let out = run(cmd, Duration::from_secs(60), |_, _| {});
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(!out.stdout.contains("closed forms hold"), "{out:?}");
    c.assert_no_processes();
}

#[test]
fn all_reduce_across_hosts_w4() {
    need_cluster!();
    let _s = serial();
    all_reduce_across_hosts(2);
}

/// Level 1 across two hosts for long enough to be interrupted (`--max-steps 100000`).
fn long_level1(c: &Cluster) -> Command {
    let hf = c.hostfile();
    let mut cmd = c.ladder_run(&[
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--hostfile",
        &hf,
        LEVEL1,
        "--device",
        "cpu",
        "--log-interval",
        "1",
        "--max-steps",
        "100000",
    ]);
    cmd.env("OMP_NUM_THREADS", "1");
    cmd
}

#[test]
fn a_rank_killed_on_the_second_host_ends_the_job_naming_host_and_rank() {
    need_cluster!();
    let _s = serial();
    let c = Cluster::up("kill", 2);
    let mut killed_at = None;
    let out = run(long_level1(&c), Duration::from_secs(120), |t, stdout| {
        if killed_at.is_none() && stdout.contains("Train Epoch: 1 [64") {
            // Training is under way: SIGKILL the level-1 process on host 1.
            let victim = c.processes().into_iter().find(|(_, node, cmd)| *node == 1 && cmd.starts_with(LEVEL1));
            let (pid, _, _) = victim.unwrap_or_else(|| panic!("no level-1 process on host 1: {:#?}", c.processes()));
            unsafe_free_kill(pid);
            killed_at = Some(t);
        }
    });
    let killed_at = killed_at.unwrap_or_else(|| panic!("training never started: {out:?}"));
    let took = out.elapsed - killed_at;
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(took < Duration::from_secs(10), "the job took {took:?} to end after the kill: {out:?}");
    let head = format!("rank 1 (local_rank 0, host {}) failed with exitcode -9 (SIGKILL)", c.host(1));
    assert!(out.stderr.contains(&head), "expected {head:?} in:\n{}", out.stderr);
    eprintln!("remote kill drill: the job ended {took:?} after the kill");
    c.assert_no_processes();
}

/// `kill -KILL pid` through the `kill` program (this crate has no libc binding).
fn unsafe_free_kill(pid: u32) {
    let st = Command::new("kill").args(["-KILL", &pid.to_string()]).status().unwrap();
    assert!(st.success(), "kill -KILL {pid}");
}

/// A host drops off while a rank elsewhere fails: the launcher cannot reach host 1's daemon to
/// stop its rank, gives up within its grace periods, and names the host it heard nothing from.
#[test]
fn a_host_that_drops_off_is_named_and_its_processes_do_not_outlive_the_job() {
    need_cluster!();
    let _s = serial();
    let c = Cluster::up("drop", 2);
    let hf = c.hostfile();
    let script =
        r#"echo "up on $(hostname)"; if [ "$RANK" = 0 ]; then sleep 4; echo "rank 0 gives up" >&2; exit 7; else exec sleep 300; fi"#;
    let mut down_at = None;
    let cmd = c.ladder_run(&["--nnodes", "2", "--nproc-per-node", "1", "--hostfile", &hf, "sh", "-c", script]);
    let out = run(cmd, Duration::from_secs(60), |t, stdout| {
        if down_at.is_none() && stdout.matches("up on").count() == 2 {
            c.link_down(1);
            down_at = Some(t);
        }
    });
    let down_at = down_at.unwrap_or_else(|| panic!("the ranks never started: {out:?}"));
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.elapsed - down_at < Duration::from_secs(15), "took {:?} after the link went down: {out:?}", out.elapsed - down_at);
    assert!(out.stderr.contains(&format!("rank 0 (local_rank 0, host {}) failed with exitcode 7", c.host(0))), "{}", out.stderr);
    let silent = format!("No word from host {} (rank 1): unreachable", c.host(1));
    assert!(out.stderr.contains(&silent), "expected {silent:?} in:\n{}", out.stderr);
    c.assert_no_processes();
}

/// The link of host 1 goes down mid-epoch: the ranks' collective timeout (issue #12) ends the job
/// within that timeout + 10 s, naming host 1 and its rank, with nothing left on either host.
#[test]
fn link_down_mid_epoch_ends_the_job_within_the_collective_timeout() {
    need_cluster!();
    let _s = serial();
    const TIMEOUT_S: u64 = 10;
    let c = Cluster::up("link", 2);
    let mut cmd = long_level1(&c);
    cmd.env("LADDER_COLLECTIVE_TIMEOUT_S", TIMEOUT_S.to_string());
    let mut down_at = None;
    let out = run(cmd, Duration::from_secs(180), |t, stdout| {
        if down_at.is_none() && stdout.contains("Train Epoch: 1 [640") {
            c.link_down(1);
            down_at = Some(t);
        }
    });
    let down_at = down_at.unwrap_or_else(|| panic!("training never got going: {out:?}"));
    let took = out.elapsed - down_at;
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(took < Duration::from_secs(TIMEOUT_S + 10), "took {took:?} after the link went down: {out:?}");
    assert!(out.stderr.contains(&format!("host {}", c.host(1))) && out.stderr.contains("rank 1"), "{}", out.stderr);
    eprintln!("link-down drill: the job ended {took:?} after the link went down");
    c.assert_no_processes();
}

/// `--nnodes > 1` misuse: each error names the flag, file, line or host and what was expected.
#[test]
fn multi_node_misuse_gets_clear_errors() {
    need_cluster!();
    let _s = serial();
    let c = Cluster::up("mis", 2);
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: String| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let (h0, h1) = (c.host(0), c.host(1));
    let few_slots = file("few-slots", format!("{h0} slots=2\n{h1} slots=1\n"));
    let one_host = file("one-host", format!("# just one\n{h0} slots=2\n"));
    let unknown = file("unknown", format!("{h0} slots=2\nno-such-host.invalid slots=2\n"));
    let hf = c.hostfile();
    let cases: Vec<(&str, Vec<&str>)> = vec![
        ("no hostfile", vec!["--nnodes", "2", "true"]),
        ("fewer slots than ranks", vec!["--nnodes", "2", "--nproc-per-node", "2", "--hostfile", &few_slots, "true"]),
        ("fewer hosts than nodes", vec!["--nnodes", "2", "--hostfile", &one_host, "true"]),
        ("a host that does not resolve", vec!["--nnodes", "2", "--hostfile", &unknown, "true"]),
    ];
    let mut report = String::new();
    for (what, args) in cases {
        let out = run(c.ladder_run(&args), Duration::from_secs(30), |_, _| {});
        assert_eq!(out.code, Some(1), "{what}: {out:?}");
        report.push_str(&format!("{what}\n  {}\n", out.stderr.trim().replace('\n', "\n  ")));
    }
    // A host that resolves but cannot be reached: its link is down before the job starts.
    c.link_down(1);
    let out = run(c.ladder_run(&["--nnodes", "2", "--hostfile", &hf, "true"]), Duration::from_secs(60), |_, _| {});
    assert_eq!(out.code, Some(1), "{out:?}");
    // The launch agent's own line (as ssh's would be), then ladder-run's verdict.
    let agent = out.stderr.lines().find(|l| l.contains(&format!("cannot reach host {h1}")));
    let agent = agent.unwrap_or_else(|| panic!("the agent says why:\n{}", out.stderr));
    let last = out.stderr.lines().last().unwrap_or("");
    report.push_str(&format!("an unreachable host\n  {agent}\n  (mpirun's own message)\n  {last}\n"));
    let report = report.replace(dir.path().to_str().unwrap(), "<dir>").replace(&c.name, "<cluster>");
    insta::assert_snapshot!(report);
    c.assert_no_processes();
}
