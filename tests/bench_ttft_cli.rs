//! `scd bench ttft` (issue M8 §1, §2, §4) at the tiniest settings, on the real binary: the grid
//! runs through an in-process cluster, the JSON has every cell with sane values, and
//! `--project` fits the cost model to it and writes the projection and the plots. No figure is
//! checked against a threshold: BENCHMARKS.md holds the measured ones.

use std::path::PathBuf;
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn model_path() -> PathBuf {
    let dir = std::env::var("SCD_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo().join(".cache/models"));
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run `make model`",
        path.display()
    );
    path
}

fn run(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_scd"))
        .current_dir(repo())
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("running scd");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "scd {args:?} failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn bench_ttft_writes_every_cell_and_the_cost_model_reads_them() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("ttft.json");
    let model = model_path();
    let stdout = run(&[
        "bench",
        "ttft",
        "--model",
        model.to_str().unwrap(),
        "--modes",
        "oracle,raw,scd",
        "--lengths",
        "24",
        "--links",
        "200,loopback",
        "--repeats",
        "2",
        "--quality-windows",
        "1",
        "--quality-tokens",
        "24",
        "--quality-continuation",
        "4",
        "--out",
        json.to_str().unwrap(),
    ]);
    assert!(stdout.contains("| 200m | warm | 24 | scd |"), "{stdout}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let cells = v["cells"].as_array().unwrap();
    // 2 links x cold, warm x 3 modes.
    assert_eq!(cells.len(), 12, "{cells:#?}");
    assert_eq!(v["jobs"].as_array().unwrap().len(), 24);
    let payload = |link: &str, mode: &str| {
        cells
            .iter()
            .find(|c| c["link"] == link && c["mode"] == mode && c["cache"] == "warm")
            .unwrap()["payload_mb"]
            .as_f64()
            .unwrap()
    };
    assert!(payload("200m", "raw") > payload("200m", "scd"));
    assert!(payload("200m", "scd") > 0.0);
    for c in cells {
        let median = &c["ttft_median_ms"];
        let (lo, mid, hi) = (
            median["low"].as_f64().unwrap(),
            median["value"].as_f64().unwrap(),
            median["high"].as_f64().unwrap(),
        );
        assert!(mid > 0.0 && lo <= mid && mid <= hi, "{c}");
        assert!(
            c["ttft_p95_ms"]["value"].as_f64().unwrap() >= mid - 1e-9,
            "{c}"
        );
        assert!(c["speedup_vs_oracle"].as_f64().unwrap() > 0.0, "{c}");
        let kl = c["kl"].as_f64().unwrap();
        assert!(kl.is_finite() && kl >= 0.0, "{c}");
        if c["mode"] == "oracle" {
            assert!((c["speedup_vs_oracle"].as_f64().unwrap() - 1.0).abs() < 1e-9);
        }
    }

    let plots = dir.path().join("plots");
    let stdout = run(&[
        "bench",
        "ttft",
        "--project",
        json.to_str().unwrap(),
        "--plots",
        plots.to_str().unwrap(),
    ]);
    assert!(stdout.contains("median |predicted - measured|"), "{stdout}");
    assert!(stdout.contains("7B (Mistral-7B shape)"), "{stdout}");
    let fitted: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(plots.join("cost-model.json")).unwrap())
            .unwrap();
    assert_eq!(fitted["cells"].as_array().unwrap().len(), 12);
    assert!(fitted["median_relative_error"]
        .as_f64()
        .unwrap()
        .is_finite());
    assert!(!fitted["projection"].as_array().unwrap().is_empty());
    assert!(plots.join("cost-model.md").exists());
}
