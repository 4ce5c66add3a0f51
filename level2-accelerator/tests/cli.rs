//! `ladder-accelerate` as a real process: `launch` really starts N ranks (under mpirun) with
//! the torchrun and Accelerate variables; `config` writes the files `launch` reads; `env`;
//! every `--help` and the error messages (insta snapshots, reviewed).
//!
//! Every command runs with `HOME` and `XDG_CONFIG_HOME` in a temp dir, so the user's own
//! default config is never read or written.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;

const BIN: &str = env!("CARGO_BIN_EXE_ladder-accelerate");
/// Jobs run one at a time (2-core machine).
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Writes an executable script through a child `sh`: a file this process held open for writing
/// can be inherited by another test thread's fork, and running it then fails with ETXTBSY
/// ("Text file busy").
fn write_executable(path: &std::path::Path, body: &str) {
    let st = Command::new("sh").args(["-c", "printf '%s' \"$1\" > \"$2\" && chmod 755 \"$2\"", "sh", body]).arg(path).status().unwrap();
    assert!(st.success(), "writing {}", path.display());
}

/// A sandbox: a temp dir as HOME and XDG_CONFIG_HOME, and a script that prints one rank's view.
struct Sandbox {
    dir: tempfile::TempDir,
}

impl Sandbox {
    fn new() -> Sandbox {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("show.sh");
        write_executable(
            &script,
            "#!/bin/sh\necho \"view RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE \
             ACCELERATE_MIXED_PRECISION=${ACCELERATE_MIXED_PRECISION-unset} \
             ACCELERATE_GRADIENT_ACCUMULATION_STEPS=${ACCELERATE_GRADIENT_ACCUMULATION_STEPS-unset} \
             ACCELERATE_USE_CPU=${ACCELERATE_USE_CPU-unset} ACCELERATE_USE_FSDP=${ACCELERATE_USE_FSDP-unset} \
             FSDP_SHARDING_STRATEGY=${FSDP_SHARDING_STRATEGY-unset} FSDP_MIN_NUM_PARAMS=${FSDP_MIN_NUM_PARAMS-unset} \
             FSDP_BACKWARD_PREFETCH=${FSDP_BACKWARD_PREFETCH-unset} FSDP_FORWARD_PREFETCH=${FSDP_FORWARD_PREFETCH-unset} \
             ACCELERATE_SEED=${ACCELERATE_SEED-unset} ACCELERATE_CONFIG_FILE=${ACCELERATE_CONFIG_FILE-unset} ARGS=$*\"\n",
        );
        Sandbox { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn script(&self) -> String {
        self.path("show.sh").display().to_string()
    }

    /// `ladder-accelerate args` in the sandbox, stdin closed, no ACCELERATE_* inherited
    /// except `envs`.
    fn run(&self, args: &[&str], envs: &[(&str, &str)]) -> Output {
        let mut cmd = Command::new(BIN);
        cmd.args(args)
            .env("HOME", self.dir.path())
            .env("XDG_CONFIG_HOME", self.dir.path().join("config"))
            .env("OMP_NUM_THREADS", "1")
            .stdin(Stdio::null());
        for (k, _) in std::env::vars() {
            if k.starts_with("ACCELERATE_") || k.starts_with("FSDP_") {
                cmd.env_remove(k);
            }
        }
        for (k, v) in envs {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    }

    /// Replaces the sandbox path with `[DIR]` and this machine's PATH with `[PATH]`.
    fn mask(&self, text: &str) -> String {
        let mut t = text.replace(&self.dir.path().display().to_string(), "[DIR]");
        if let Ok(path) = std::env::var("PATH") {
            t = t.replace(&path, "[PATH]");
        }
        t
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Each rank's view line, parsed: rank → (variable → value).
fn views(stdout: &str) -> BTreeMap<usize, BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for line in stdout.lines() {
        let Some((prefix, rest)) = line.split_once("view ") else { continue };
        let vars: BTreeMap<String, String> =
            rest.split(' ').filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let rank: usize = vars["RANK"].parse().unwrap();
        assert_eq!(prefix, format!("[rank{rank}]: "), "prefix of {line:?}");
        assert!(out.insert(rank, vars).is_none(), "rank {rank} printed twice:\n{stdout}");
    }
    out
}

#[test]
fn launch_starts_two_ranks_with_the_torchrun_and_accelerate_variables() {
    let _g = serial();
    let sb = Sandbox::new();
    let out = sb.run(
        &[
            "launch",
            "--num-processes",
            "2",
            "--mixed-precision",
            "bf16",
            "--gradient-accumulation-steps",
            "4",
            "--use-fsdp",
            "--fsdp-sharding-strategy",
            "full-shard",
            "--fsdp-backward-prefetch",
            "BACKWARD_POST",
            "--fsdp-forward-prefetch",
            "--cpu",
            &sb.script(),
            "--flag-for-program",
            "x",
        ],
        &[],
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let v = views(&stdout);
    assert_eq!(v.keys().copied().collect::<Vec<_>>(), vec![0, 1], "{stdout}");
    for (rank, vars) in &v {
        let get = |k: &str| vars[k].as_str();
        assert_eq!((get("LOCAL_RANK"), get("WORLD_SIZE")), (rank.to_string().as_str(), "2"));
        assert_eq!(get("ACCELERATE_MIXED_PRECISION"), "bf16");
        assert_eq!(get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"), "4");
        assert_eq!(get("ACCELERATE_USE_CPU"), "true");
        assert_eq!(get("ACCELERATE_USE_FSDP"), "true");
        assert_eq!(get("FSDP_SHARDING_STRATEGY"), "FULL_SHARD");
        // Accelerate's spellings, as its launcher exports them.
        assert_eq!(get("FSDP_BACKWARD_PREFETCH"), "BACKWARD_POST");
        assert_eq!(get("FSDP_FORWARD_PREFETCH"), "true");
        // Not given: not exported.
        assert_eq!(get("FSDP_MIN_NUM_PARAMS"), "unset");
        assert_eq!(get("ACCELERATE_SEED"), "unset");
        assert_eq!(get("ACCELERATE_CONFIG_FILE"), "unset");
        assert_eq!(get("ARGS"), "--flag-for-program");
    }
    insta::assert_snapshot!("launch_banner_flags", sb.mask(&stderr));
}

#[test]
fn launch_three_ranks_oversubscribed() {
    let _g = serial();
    let sb = Sandbox::new();
    let out = sb.run(&["launch", "--num-processes", "3", &sb.script()], &[]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let v = views(&stdout);
    assert_eq!(v.len(), 3, "{stdout}");
    assert!(v.values().all(|vars| vars["WORLD_SIZE"] == "3" && vars["ACCELERATE_MIXED_PRECISION"] == "unset"));
    assert!(text(&out.stderr).starts_with("ladder-accelerate launch: 3 ranks (3 per machine × 1 machine"));
}

#[test]
fn launch_reads_the_config_file_and_flags_override_it_even_with_the_default_value() {
    let _g = serial();
    let sb = Sandbox::new();
    let file = sb.path("job.toml");
    std::fs::write(
        &file,
        "num_processes = 2\nmixed_precision = \"bf16\"\ngradient_accumulation_steps = 4\nseed = 11\nfsdp_min_num_params = 0\n\
         fsdp_backward_prefetch = \"backward-pre\"\nfsdp_forward_prefetch = false\n",
    )
    .unwrap();
    let file = file.display().to_string();
    // --mixed-precision no is the default value, given: it beats the file's bf16.
    let out = sb.run(&["launch", "--config-file", &file, "--mixed-precision", "no", &sb.script()], &[("ACCELERATE_SEED", "99")]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let v = views(&stdout);
    assert_eq!(v.len(), 2, "{stdout}");
    for vars in v.values() {
        assert_eq!(vars["ACCELERATE_MIXED_PRECISION"], "no");
        assert_eq!(vars["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"], "4");
        assert_eq!(vars["FSDP_MIN_NUM_PARAMS"], "0");
        // The file beats a variable inherited from the shell (launch exports the file's value).
        assert_eq!(vars["ACCELERATE_SEED"], "11");
        assert_eq!(vars["ACCELERATE_USE_FSDP"], "unset");
        // The file's prefetch settings, in Accelerate's spelling.
        assert_eq!(vars["FSDP_BACKWARD_PREFETCH"], "BACKWARD_PRE");
        assert_eq!(vars["FSDP_FORWARD_PREFETCH"], "false");
    }
    insta::assert_snapshot!("launch_banner_file", sb.mask(&stderr));
}

#[test]
fn config_default_then_launch_uses_the_default_config() {
    let _g = serial();
    let sb = Sandbox::new();
    let out = sb.run(&["config", "--default", "--cpu", "--num-processes", "2", "--mixed-precision", "bf16"], &[]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let default = sb.path("config/ddp-ladder/accelerate/default_config.yaml");
    let written = std::fs::read_to_string(&default).unwrap();
    insta::assert_snapshot!("config_default_cpu_2", written);
    assert_eq!(
        sb.mask(&stdout),
        format!("ladder-accelerate config: wrote [DIR]/config/ddp-ladder/accelerate/default_config.yaml\n{written}")
    );

    let out = sb.run(&["launch", &sb.script()], &[]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let v = views(&stdout);
    assert_eq!(v.len(), 2, "the default config's num_processes 2:\n{stdout}");
    assert!(v.values().all(|vars| vars["ACCELERATE_MIXED_PRECISION"] == "bf16" && vars["ACCELERATE_USE_CPU"] == "true"));
    assert!(
        sb.mask(&stderr).contains("  mixed_precision: bf16 (config file [DIR]/config/ddp-ladder/accelerate/default_config.yaml)\n"),
        "{stderr}"
    );
}

#[test]
fn config_writes_exactly_the_flags_given_in_yaml_or_toml() {
    let sb = Sandbox::new();
    let yaml = sb.path("out/c.yaml");
    let out = sb.run(
        &[
            "config",
            "--config-file",
            yaml.to_str().unwrap(),
            "--num-processes",
            "4",
            "--use-fsdp=false",
            "--fsdp-sharding-strategy",
            "NO_SHARD",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(std::fs::read_to_string(&yaml).unwrap(), "num_processes: 4\nuse_fsdp: false\nfsdp_sharding_strategy: NO_SHARD\n");
    let toml = sb.path("c.toml");
    let out = sb.run(&["config", "--config-file", toml.to_str().unwrap(), "--default", "--cpu", "--seed", "3"], &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    insta::assert_snapshot!("config_default_toml", std::fs::read_to_string(&toml).unwrap());
}

#[test]
fn launch_reports_a_failing_rank_and_exits_non_zero() {
    let _g = serial();
    let sb = Sandbox::new();
    let fail = sb.path("fail.sh");
    write_executable(&fail, "#!/bin/sh\nif [ \"$RANK\" = 1 ]; then echo boom >&2; exit 3; fi\nsleep 30\n");
    let start = std::time::Instant::now();
    let out = sb.run(&["launch", "--num-processes", "2", fail.to_str().unwrap()], &[]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(start.elapsed() < std::time::Duration::from_secs(20), "took {:?}", start.elapsed());
    assert!(stderr.contains("error: rank 1 (local_rank 1, host "), "{stderr}");
    assert!(stderr.contains("failed with exitcode 3"), "{stderr}");
    assert!(stderr.contains("boom"), "{stderr}");
}

#[test]
fn env_report() {
    let sb = Sandbox::new();
    let cfg = sb.path("c.yaml");
    std::fs::write(&cfg, "num_processes: 2\nmixed_precision: bf16\n").unwrap();
    let out = sb.run(&["env", "--config-file", cfg.to_str().unwrap()], &[("ACCELERATE_SEED", "5")]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    // Versions and hardware differ between machines: their values are masked, their lines kept.
    let masked: Vec<String> = sb
        .mask(&stdout)
        .lines()
        .map(|l| {
            let machine_specific = ["version:", "- Platform:", "- CPU:", "- Cores:", "- CPU bf16 support:", "- GPUs:"];
            match l.split_once(": ") {
                Some((k, v)) if machine_specific.iter().any(|m| format!("{k}:").ends_with(m)) => {
                    assert!(!v.trim().is_empty(), "{l}");
                    format!("{k}: [masked]")
                }
                _ => l.to_string(),
            }
        })
        .collect();
    insta::assert_snapshot!(masked.join("\n"));
    // The real values are there.
    assert!(stdout.contains(&format!("- `ladder-accelerate` version: {}\n", env!("CARGO_PKG_VERSION"))));
    assert!(stdout.contains(&format!("- Cores: {}\n", std::thread::available_parallelism().unwrap().get())));
    let mpirun = Command::new("mpirun").arg("--version").output().unwrap();
    let v = text(&mpirun.stdout).lines().next().unwrap().rsplit(' ').next().unwrap().to_string();
    assert!(stdout.contains(&format!("- Open MPI version: {v}\n")), "{stdout}");
}

#[test]
fn help_snapshots() {
    let sb = Sandbox::new();
    for (name, args) in [
        ("help", vec!["--help"]),
        ("help_config", vec!["config", "--help"]),
        ("help_launch", vec!["launch", "--help"]),
        ("help_env", vec!["env", "--help"]),
    ] {
        let out = sb.run(&args, &[]);
        assert!(out.status.success(), "{args:?}");
        insta::assert_snapshot!(name, text(&out.stdout));
    }
}

#[test]
fn error_messages() {
    let _g = serial();
    let sb = Sandbox::new();
    let script = sb.script();
    let bad_yaml = sb.path("bad.yaml");
    std::fs::write(&bad_yaml, "mixed_precision: fp8\n").unwrap();
    let bad_yaml = bad_yaml.display().to_string();
    type Case<'a> = (&'a str, Vec<&'a str>, Vec<(&'a str, &'a str)>);
    let cases: Vec<Case> = vec![
        ("fp8 flag", vec!["launch", "--mixed-precision", "fp8", &script], vec![]),
        ("zero accumulation steps flag", vec!["launch", "--gradient-accumulation-steps", "0", &script], vec![]),
        ("fp16 with cpu", vec!["launch", "--mixed-precision", "fp16", "--cpu", &script], vec![]),
        ("fp16 flag with cpu from the file", vec!["launch", "--config-file", "CPU_FILE", "--mixed-precision", "fp16", &script], vec![]),
        ("fp8 inherited", vec!["launch", &script], vec![("ACCELERATE_MIXED_PRECISION", "fp8")]),
        ("processes not a multiple of machines", vec!["launch", "--num-processes", "3", "--num-machines", "2", &script], vec![]),
        ("machines without hostfile", vec!["launch", "--num-processes", "4", "--num-machines", "2", &script], vec![]),
        (
            "machine rank with mpi",
            vec!["launch", "--num-processes", "4", "--num-machines", "2", "--machine-rank", "1", "--hostfile", "/etc/hostname", &script],
            vec![],
        ),
        (
            "nccl machines without address",
            vec!["launch", "--backend", "nccl", "--num-processes", "4", "--num-machines", "2", &script],
            vec![],
        ),
        ("missing config file", vec!["launch", "--config-file", "/nonexistent/c.yaml", &script], vec![]),
        ("bad config file", vec!["launch", "--config-file", &bad_yaml, &script], vec![]),
        ("program not found", vec!["launch", "/nonexistent/program"], vec![]),
        ("program not in PATH", vec!["launch", "no-such-program-ddp-ladder"], vec![]),
        ("program not executable", vec!["launch", "NOT_EXEC"], vec![]),
        ("no program", vec!["launch", "--num-processes", "2"], vec![]),
        ("accelerate's --multi_gpu", vec!["launch", "--multi_gpu", "--num-processes", "2", &script], vec![]),
        ("a near miss: --num-procs", vec!["launch", "--num-procs", "2", &script], vec![]),
        ("bad bool", vec!["launch", "--cpu=maybe", &script], vec![]),
        ("config without a terminal", vec!["config"], vec![]),
        ("config unsupported extension", vec!["config", "--config-file", "c.ini", "--default"], vec![]),
        ("config bad strategy", vec!["config", "--fsdp-sharding-strategy", "hybrid"], vec![]),
        ("config bad backward prefetch", vec!["config", "--fsdp-backward-prefetch", "BACKWARD"], vec![]),
        ("bad backward prefetch inherited", vec!["launch", &script], vec![("FSDP_BACKWARD_PREFETCH", "3")]),
        ("bad forward prefetch inherited", vec!["launch", &script], vec![("FSDP_FORWARD_PREFETCH", "sometimes")]),
    ];
    let cpu_file = sb.path("cpu.yaml");
    std::fs::write(&cpu_file, "cpu: true\n").unwrap();
    let cpu_file = cpu_file.display().to_string();
    let mut report = Vec::new();
    for (title, args, envs) in cases {
        let args: Vec<&str> = args
            .iter()
            .map(|a| match *a {
                "CPU_FILE" => cpu_file.as_str(),
                "NOT_EXEC" => bad_yaml.as_str(),
                _ => a,
            })
            .collect();
        let out = sb.run(&args, &envs);
        assert!(!out.status.success(), "{title}: {args:?} must fail");
        assert!(text(&out.stdout).is_empty(), "{title}: no rank may start:\n{}", text(&out.stdout));
        let code = out.status.code().unwrap();
        report.push(format!("## {title} (exit {code})\n{}", sb.mask(&text(&out.stderr)).trim_end()));
    }
    insta::assert_snapshot!(report.join("\n\n"));
}

#[test]
fn config_prompts_on_a_terminal() {
    // `script` (util-linux / bsdutils) gives the command a pseudo-terminal; the keys are queued
    // on it before the first question: ↓ Enter (multi-CPU), 1 machine, FSDP yes, ↓ Enter
    // (SHARD_GRAD_OP), CPU offload yes, min_num_params 0, ↓ Enter (BACKWARD_POST: BACKWARD_PRE
    // is preselected, as by `accelerate config`), forward prefetch yes, activation
    // checkpointing no, 2 processes, Enter (mixed precision: no).
    let sb = Sandbox::new();
    let keys = "\x1b[B\r1\ry\x1b[B\ry0\r\x1b[B\ryn2\r\r";
    let mut child = Command::new("script")
        .args(["-qfc", &format!("{BIN} config"), "/dev/null"])
        .env("HOME", sb.dir.path())
        .env("XDG_CONFIG_HOME", sb.path("config"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("script (bsdutils) is installed");
    use std::io::Write;
    child.stdin.take().unwrap().write_all(keys.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let screen = text(&out.stdout);
    assert!(out.status.success(), "{screen}\n{}", text(&out.stderr));
    for question in [
        "Which type of machine are you using?: multi-CPU (mpi)",
        "How many machines will you use (more than 1 for multi-node training)?",
        "Do you want to use FullyShardedDataParallel? yes",
        "What should be your sharding strategy?: SHARD_GRAD_OP",
        "Do you want to offload parameters and gradients to CPU? yes",
        "What should be your FSDP's backward prefetch policy?: BACKWARD_POST",
        "Do you want to enable FSDP's forward prefetch policy? yes",
        "Do you want to enable FSDP activation checkpointing? no",
        "How many processes in total will you use? (all machines together)",
        "Do you wish to use mixed precision? (fp16 needs a GPU",
    ] {
        assert!(screen.contains(question), "{question:?} not on the screen:\n{screen}");
    }
    let written = std::fs::read_to_string(sb.path("config/ddp-ladder/accelerate/default_config.yaml")).unwrap();
    assert_eq!(
        written,
        "distributed_type: FSDP\nnum_processes: 2\nnum_machines: 1\nmachine_rank: 0\nmixed_precision: no\ncpu: true\n\
         use_fsdp: true\nfsdp_sharding_strategy: SHARD_GRAD_OP\nfsdp_min_num_params: 0\n\
         fsdp_backward_prefetch: BACKWARD_POST\nfsdp_forward_prefetch: true\nfsdp_offload_params: true\n\
         fsdp_activation_checkpointing: false\n"
    );
}

#[test]
fn launch_with_a_hostfile_passes_the_settings_to_every_rank() {
    // mpirun with a hostfile (here one machine, localhost): the settings travel as
    // `env K=V PROGRAM`, since mpirun does not forward the environment to other machines.
    let _g = serial();
    let sb = Sandbox::new();
    let hosts = sb.path("hosts.txt");
    std::fs::write(&hosts, "localhost slots=2\n").unwrap();
    let out = sb.run(&["launch", "--num-processes", "2", "--hostfile", hosts.to_str().unwrap(), "--seed", "5", &sb.script(), "a"], &[]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let v = views(&stdout);
    assert_eq!(v.len(), 2, "{stdout}");
    assert!(v.values().all(|vars| vars["ACCELERATE_SEED"] == "5" && vars["ARGS"] == "a" && vars["WORLD_SIZE"] == "2"), "{stdout}");
}
