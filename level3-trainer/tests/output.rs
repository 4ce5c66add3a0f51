//! The user-visible texts of a Trainer run with fixed values: the banner, the epoch table, the
//! report_to files, the loss plot.

use level3_trainer::args::{ReportTo, TrainingArguments};
use level3_trainer::output::{epoch_table, plot_loss_curve, training_banner, ReportWriter};
use level3_trainer::schedule::TrainingPlan;
use level3_trainer::state::LogEntry;

#[test]
fn banner_three_epochs_accumulation_four() {
    let args = TrainingArguments { per_device_train_batch_size: 64, gradient_accumulation_steps: 4, ..Default::default() };
    let plan = TrainingPlan::new(&args, 60_000, 1);
    insta::assert_snapshot!(training_banner(&args, &plan, 1_199_882));
}

#[test]
fn banner_one_epoch_two_ranks() {
    let args = TrainingArguments { per_device_train_batch_size: 64, num_train_epochs: 1.0, ..Default::default() };
    let plan = TrainingPlan::new(&args, 60_000, 2);
    insta::assert_snapshot!(training_banner(&args, &plan, 1_199_882));
}

fn history() -> Vec<LogEntry> {
    vec![
        LogEntry::new(1, 0.0011, [("loss", 2.31), ("learning_rate", 1e-3)]),
        LogEntry::new(500, 0.533, [("loss", 0.254321), ("learning_rate", 1e-3)]),
        LogEntry::new(
            938,
            1.0,
            [("eval_loss", 0.045678), ("eval_accuracy", 0.9851), ("eval_runtime", 1.5), ("eval_samples_per_second", 6666.7)],
        ),
        LogEntry::new(1876, 2.0, [("eval_loss", 0.039), ("eval_accuracy", 0.9874), ("eval_runtime", 1.4)]),
        LogEntry::new(1876, 2.0, [("train_loss", 0.12), ("train_runtime", 60.0)]),
    ]
}

#[test]
fn epoch_table_fixed_values() {
    // Epoch 2 had no training log since the first evaluation: "No log", as Transformers.
    insta::assert_snapshot!(epoch_table(&history(), true).to_string());
}

#[test]
fn step_table_fixed_values() {
    insta::assert_snapshot!(epoch_table(&history()[..3], false).to_string());
}

#[test]
fn report_to_jsonl_and_csv() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = TrainingArguments { output_dir: dir.path().join("out"), report_to: ReportTo::Jsonl, ..Default::default() };
    let mut w = ReportWriter::new(&args, false).unwrap();
    for e in &history()[..2] {
        w.write(e).unwrap();
    }
    let text = std::fs::read_to_string(w.path().unwrap()).unwrap();
    let back: Vec<LogEntry> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(back, history()[..2]);
    // Resuming appends; starting afresh truncates.
    let mut w = ReportWriter::new(&args, true).unwrap();
    w.write(&history()[2]).unwrap();
    assert_eq!(std::fs::read_to_string(w.path().unwrap()).unwrap().lines().count(), 3);
    ReportWriter::new(&args, false).unwrap();
    assert_eq!(std::fs::read_to_string(w.path().unwrap()).unwrap(), "");

    args.report_to = ReportTo::Csv;
    let mut w = ReportWriter::new(&args, false).unwrap();
    w.write(&history()[0]).unwrap();
    assert_eq!(
        std::fs::read_to_string(w.path().unwrap()).unwrap(),
        "step,epoch,key,value\n1,0.0011,learning_rate,0.001\n1,0.0011,loss,2.31\n"
    );
    args.report_to = ReportTo::None;
    assert!(ReportWriter::new(&args, false).unwrap().path().is_none());
}

#[test]
fn loss_plot_is_an_svg_with_both_curves() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("loss.svg");
    plot_loss_curve(&path, &[(1, 2.3), (100, 0.5), (200, 0.3)], &[(200, 0.1)]).unwrap();
    let svg = std::fs::read_to_string(&path).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..100.min(svg.len())]);
    assert!(svg.contains("training loss") && svg.contains("validation loss"));
    assert!(svg.contains("<polyline"), "no curve drawn");
}
