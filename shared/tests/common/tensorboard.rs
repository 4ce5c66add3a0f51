//! Reads TensorBoard event files back the way TensorBoard does: with the `tensorboard` Python
//! package's `EventAccumulator`, from the repository's `.venv` (scripts/bootstrap.sh installs
//! it).

use std::collections::BTreeMap;
use std::path::Path;

/// Every scalar of the run in `log_dir` (all its event files), by tag: `(step, value)` in the
/// order TensorBoard keeps them. Panics with Python's output when the reader fails.
pub fn read_scalars(log_dir: &Path) -> BTreeMap<String, Vec<(u64, f32)>> {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(python.exists(), "{} missing: run scripts/bootstrap.sh", python.display());
    let script = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
ea = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
ea.Reload()
print(json.dumps({t: [[e.step, e.value] for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}))
"#;
    let o = std::process::Command::new(&python).arg("-c").arg(script).arg(log_dir).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "the tensorboard reader failed:\n{text}");
    let line = String::from_utf8_lossy(&o.stdout).lines().last().unwrap_or_default().to_string();
    let v: BTreeMap<String, Vec<(u64, f64)>> = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {text}"));
    // The values were f32 in the file: the f64 Python printed converts back exactly.
    v.into_iter().map(|(tag, points)| (tag, points.into_iter().map(|(s, x)| (s, x as f32)).collect())).collect()
}
