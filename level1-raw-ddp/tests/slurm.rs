//! Level 1 launched by a real Slurm (`scripts/slurm.sh`: munged, slurmctld and one slurmd per
//! namespace host): `srun -N 2 -n 2 --mpi=pmix` places one rank on each host, Open MPI's
//! `MPI_Init` forms their world through PMIx (no mpirun), and the run is the same run as under
//! mpirun on the same hosts, bit for bit; `srun` without `--mpi=pmix` is refused with what to do
//! instead. Needs root (CI runs as root); elsewhere it prints why it skips.

#[path = "../../shared/tests/common/slurm.rs"]
mod slurm_cluster;

use ladder_core::metrics::Report;
use slurm_cluster::{serial, text, Slurm};
use std::path::{Path, PathBuf};
use tch::Tensor;

const LEVEL1: &str = env!("CARGO_BIN_EXE_level1-raw-ddp");

fn ladder_run() -> PathBuf {
    let p = Path::new(LEVEL1).with_file_name("ladder-run");
    assert!(p.is_file(), "{} is not built: run `cargo build --release -p ladder-core --bins` first", p.display());
    p
}

/// The tensors of a safetensors file, sorted by name.
fn weights(path: &Path) -> Vec<(String, Tensor)> {
    let mut v = Tensor::read_safetensors(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn srun_two_hosts_train_level1_in_sync_as_under_mpirun() {
    if let Some(why) = slurm_cluster::unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let _s = serial();
    let slurm = Slurm::up("l1", 2);
    let dir = tempfile::tempdir().unwrap();
    let file = |n: &str| dir.path().join(n).display().to_string();

    // One task on each host, each knowing its place from Slurm's variables.
    let out = slurm.on_host0("srun", &["-N", "2", "-n", "2", "sh", "-c", "echo $SLURM_PROCID $(hostname)"]).output().unwrap();
    let mut who: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect();
    who.sort();
    assert_eq!(who, [format!("0 {}", slurm.host(0)), format!("1 {}", slurm.host(1))], "{}", text(&out));

    // Without PMIx Open MPI cannot join the tasks: refused before MPI_Init, by every task.
    let out = slurm.on_host0("srun", &["-N", "2", "-n", "2", LEVEL1, "--device", "cpu", "--max-steps", "1"]).output().unwrap();
    assert!(!out.status.success(), "{}", text(&out));
    for r in 0..2 {
        let said = format!("error on rank {r} of 2: bad distributed environment: srun without --mpi=pmix cannot start Open MPI ranks");
        assert!(text(&out).contains(&said), "{}", text(&out));
    }

    let args = |json: &str, model: &str| -> Vec<String> {
        [
            LEVEL1,
            "--device",
            "cpu",
            "--max-steps",
            "10",
            "--log-interval",
            "0",
            "--check-sync",
            "--metrics-json",
            json,
            "--save-model",
            model,
        ]
        .map(str::to_string)
        .to_vec()
    };
    let mut srun = vec!["-N", "2", "-n", "2", "--mpi=pmix"].into_iter().map(str::to_string).collect::<Vec<_>>();
    srun.extend(args(&file("srun.json"), &file("srun.st")));
    let out = slurm.on_host0("srun", &srun.iter().map(String::as_str).collect::<Vec<_>>()).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("check-sync: parameters are bit-identical on all 2 ranks"), "{}", text(&out));

    // The same run under mpirun (ladder-run over the hostfile), one rank per host.
    let hostfile = slurm.hostfile();
    let mut mpirun = vec!["exec", "0", ladder_run().to_str().unwrap(), "--nnodes", "2", "--nproc-per-node", "1", "--hostfile", &hostfile]
        .into_iter()
        .map(str::to_string)
        .collect::<Vec<_>>();
    mpirun.extend(args(&file("mpirun.json"), &file("mpirun.st")));
    let mut cmd = slurm.script(&mpirun.iter().map(String::as_str).collect::<Vec<_>>());
    let out = cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1").output().unwrap();
    assert!(out.status.success(), "{}", text(&out));

    let report = |f: &str| -> Report { serde_json::from_str(&std::fs::read_to_string(file(f)).unwrap()).unwrap() };
    let (s, m) = (report("srun.json"), report("mpirun.json"));
    assert_eq!((s.world_size, s.steps, s.eval_samples, s.ranks.len()), (2, 10, 10_000, 2));
    assert_eq!((s.train_loss, s.test_loss, s.accuracy), (m.train_loss, m.test_loss, m.accuracy), "srun vs mpirun");
    let (ws, wm) = (weights(Path::new(&file("srun.st"))), weights(Path::new(&file("mpirun.st"))));
    assert_eq!(ws.len(), wm.len());
    for ((k, a), (l, b)) in ws.iter().zip(&wm) {
        assert!(k == l && a.equal(b), "{k}: the srun and mpirun runs differ");
    }
    eprintln!(
        "srun --mpi=pmix -N 2 -n 2: train loss {}, test loss {}, accuracy {} over {} images, as under mpirun ({:.1} s vs {:.1} s)",
        s.train_loss, s.test_loss, s.accuracy, s.eval_samples, s.wall_s, m.wall_s
    );
}
