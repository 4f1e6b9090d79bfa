//! One run of each command that `make demo` and the documents use and no other test runs, on
//! the real binary with the tiniest settings its flags allow: each must exit 0 and print or
//! write what it is for (a table with a figure in it, a translator or an adapter that loads).
//! Figures are not checked: the benchmarks' own tests and BENCHMARKS.md are where they are.
//!
//! Run elsewhere: `generate` (generate_cli.rs, transfer_cli.rs), `eval` (transfer_cli.rs),
//! `cert` (cert_cli.rs), `completions` (completions_cli.rs), and `node`, `submit`, `jobs`,
//! `nodes`, `pools`, `docs` and `translators list|publish|activate|rollback` against a cluster
//! on etcd (cluster.rs). Not run by any test: `sempic train` and `sempic boundary` (a single
//! step takes some 45 s on two cores; models/tests/sempic.rs tests the training itself),
//! `translators curve` (about a minute: the measurement that ends `scd calibrate`, which runs
//! here), and `bench model`'s llama.cpp columns (they need `make llama-cpp`; here it must say
//! that llama.cpp is not installed and go on).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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

/// `scd` run from the repository root (where the commands' default paths point: `experts/`,
/// `data/`, `.cache/data`, `ops/`).
fn scd(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_scd"));
    c.current_dir(repo()).args(args).env("RUST_BACKTRACE", "0");
    c
}

/// `scd args --model <the model>` (or `--producer`, for the pair commands).
fn scd_on_model(flag: &str, args: &[&str]) -> Command {
    let mut c = scd(args);
    c.arg(flag).arg(model_path());
    c
}

/// Stdout and stderr of a run that must have exited 0.
fn ok(what: &str, out: Output) -> (String, String) {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "{what} exited with {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    (stdout, stderr)
}

fn run(what: &str, c: &mut Command) -> (String, String) {
    ok(what, c.output().unwrap())
}

/// The line of `text` that starts with `prefix`, split into its table cells.
fn row(text: &str, prefix: &str) -> Vec<String> {
    let line = text
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting {prefix:?} in:\n{text}"));
    line.trim_matches('|')
        .split('|')
        .map(|c| c.trim().to_owned())
        .collect()
}

/// The number at the start of `cell` ("512 MB/s", "0.75", "1.46x").
fn number(cell: &str) -> f64 {
    let end = cell
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == '+'))
        .unwrap_or(cell.len());
    cell[..end]
        .parse()
        .unwrap_or_else(|_| panic!("{cell:?} does not start with a number"))
}

fn positive(cell: &str) {
    let x = number(cell);
    assert!(x.is_finite() && x > 0.0, "{cell:?}");
}

/// A small text corpus: lines of words drawn deterministically, enough tokens for a held-out
/// prompt of the calibration (289 tokens from the last tenth of the train split).
fn corpus(dir: &Path) -> PathBuf {
    const WORDS: &[&str] = &[
        "the", "ship", "sailed", "over", "grey", "sea", "while", "crew", "sang", "of", "home",
        "and", "harbour", "lights", "in", "evening", "wind", "a", "letter", "came", "from",
        "north", "with", "news", "about", "winter", "stores",
    ];
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let mut text = String::new();
    for _ in 0..400 {
        let line: Vec<&str> = (0..20)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                WORDS[(s % WORDS.len() as u64) as usize]
            })
            .collect();
        text.push_str(&line.join(" "));
        text.push_str(".\n");
    }
    let path = dir.join("corpus.txt");
    std::fs::write(&path, text).unwrap();
    path
}

/// `make demo`'s cluster run (the mail-rope expert, every mode, the documents job), at two new
/// tokens per job.
#[test]
fn demo_runs_every_mode_and_the_documents_job() {
    let (out, _) = run(
        "scd demo",
        scd_on_model("--model", &["demo"]).args([
            "--expert",
            "mail-rope",
            "--prompt-file",
            "ops/demo-mail.txt",
            "--max-tokens",
            "2",
            "--document-files",
            "ops/demo-documents/maintenance.txt,ops/demo-documents/contacts.txt",
            "--question-file",
            "ops/demo-documents/question.txt",
            "--paced-tokens",
            "64",
        ]),
    );
    assert!(out.contains("2 new tokens per job"), "{out}");
    // Every mode's row, the oracle's first, and each mode's reply under it.
    for mode in ["raw", "q4", "droidspeak", "reuse", "scd"] {
        let cells: Vec<String> = out
            .lines()
            .find(|l| l.split_whitespace().next() == Some(mode))
            .unwrap_or_else(|| panic!("no row of {mode} in:\n{out}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        positive(&cells[1]); // wire bytes
        assert!(out.contains(&format!("-- {mode} --")), "{out}");
    }
    assert!(out.contains("oracle"), "{out}");
    assert!(out.contains("== a job naming 2 documents"), "{out}");
    assert!(
        out.contains("-- the expert, after the documents --"),
        "{out}"
    );
    // The paced part: every mode's row against the oracle, and auto's choice, which for
    // mail-rope (raw's KL 1.39 in its drift report) is never raw nor q4, there or on loopback.
    assert!(
        out.contains("== where the codes win: 64 tokens the producer already holds"),
        "{out}"
    );
    let paced = &out[out.find("== where the codes win").unwrap()..];
    // scd's codes as configured, then transform-coded at a rate (64 tokens never measure the
    // link, so the default one), beside kvtc.
    for mode in [
        "oracle",
        "raw",
        "scd i8-rows",
        "scd tc@0.3",
        "kvtc tc@0.3",
        "auto (",
    ] {
        assert!(
            paced.lines().any(|l| l.starts_with(mode)),
            "no {mode} row in:\n{paced}"
        );
    }
    assert_eq!(out.matches("auto chose ").count(), 2, "{out}");
    for bad in [
        "auto (raw)",
        "auto (q4)",
        "auto:raw",
        "auto:q4",
        "auto chose raw",
        "auto chose q4",
        // kvtc codes raw KV, whose broken RoPE it inherits (its rate table's KL is over 0.8).
        "auto (kvtc)",
        "auto chose kvtc",
    ] {
        assert!(!out.contains(bad), "{bad} in:\n{out}");
    }
}

#[test]
fn bench_transport_prints_goodput_codec_and_pacing() {
    let (out, _) = run(
        "scd bench transport",
        scd(&["bench", "transport"]).args([
            "--sizes-mb",
            "1",
            "--runs",
            "1",
            "--pacing-mbps",
            "100",
            "--pacing-secs",
            "0.2",
        ]),
    );
    assert!(out.contains("## goodput on loopback"), "{out}");
    positive(&row(&out, "| 1 MB |")[1]);
    assert!(out.contains("## frame codec"), "{out}");
    assert!(out.contains("## pacing accuracy"), "{out}");
    positive(&row(&out, "| 100 Mbit/s |")[1]);
}

/// `make bench-model` without llama.cpp installed: it says so and measures the rest.
#[test]
fn bench_model_measures_prefill_and_decode_and_says_llama_cpp_is_missing() {
    let (out, _) = run(
        "scd bench model",
        scd_on_model("--model", &["bench", "model"]).args([
            "--lengths",
            "8",
            "--baseline-lengths",
            "--warmup",
            "0",
            "--reps",
            "1",
            "--decode-warmup",
            "0",
            "--decode-tokens",
            "1",
            "--decode-after",
            "8",
            "--matmul-size",
            "32",
            "--llama-python",
            "/nonexistent/scd-smoke/python",
        ]),
    );
    assert!(out.contains("llama.cpp: NOT INSTALLED"), "{out}");
    assert!(out.contains("| implementation | T | best s |"), "{out}");
    // The prefill row (T = 8), then the decode rows.
    let prefill = row(&out, "| scd (prefill");
    assert_eq!(prefill[1], "8", "{out}");
    positive(&prefill[2]);
    assert!(
        out.contains("| implementation | decode after | ms/token |"),
        "{out}"
    );
    positive(&row(&out, "| scd (decode f32) |")[2]);
}

#[test]
fn bench_decode_prints_a_row_per_job_count() {
    let (out, _) = run(
        "scd bench decode",
        scd_on_model("--model", &["bench", "decode"]).args([
            "--expert",
            "experts/mail",
            "--jobs",
            "1,2",
            "--experts",
            "1",
            "--prompt-tokens",
            "8",
            "--tokens",
            "2",
            "--warmup",
            "0",
            "--reps",
            "1",
        ]),
    );
    assert!(out.contains("| jobs | aggregate tok/s |"), "{out}");
    positive(&row(&out, "| 1 |")[1]);
    positive(&row(&out, "| 2 |")[1]);
}

#[test]
fn bench_docs_compares_compiled_documents_with_full_recompute() {
    let (out, _) = run(
        "scd bench docs",
        scd_on_model("--model", &["bench", "docs"]).args([
            "--docs",
            "2",
            "--doc-tokens",
            "16",
            "--question-tokens",
            "8",
            "--warmup",
            "0",
            "--reps",
            "1",
        ]),
    );
    assert!(out.contains("| documents | prompt tokens |"), "{out}");
    let cells = row(&out, "| 2 |");
    positive(&cells[2]); // full recompute TTFT
    positive(&cells[3]); // compiled TTFT
}

#[test]
fn bench_codes_times_each_coded_mode_and_the_entropy_coder() {
    let (out, _) = run(
        "scd bench codes",
        scd_on_model("--model", &["bench", "codes"]).args([
            "--expert",
            "experts/sotu",
            "--tokens",
            "64",
            "--warmup",
            "0",
            "--reps",
            "1",
        ]),
    );
    assert!(out.contains("| mode | payload, % of raw |"), "{out}");
    // Each coded mode near the share it was sized for, with its coder's speed; raw whole.
    for mode in ["| kvtc tc step", "| reuse tc step", "| scd tc step"] {
        let cells = row(&out, mode);
        let share = number(&cells[1]);
        assert!(share > 2.0 && share < 25.0, "{mode}: {share}% of raw");
        for cell in &cells[2..] {
            positive(cell);
        }
    }
    assert_eq!(number(&row(&out, "| raw |")[1]), 100.0);
}

#[test]
fn bench_memory_measures_merged_and_on_the_fly_experts() {
    let (out, _) = run(
        "scd bench memory",
        scd_on_model("--model", &["bench", "memory"]).args(["--expert", "experts/mail"]),
    );
    assert!(out.contains("| adapters | experts | RSS MiB |"), "{out}");
    positive(&row(&out, "| merge | 1 |")[2]);
    positive(&row(&out, "| on-the-fly | 1 |")[2]);
}

#[test]
fn bench_links_compares_raw_default_and_adaptive_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("links.json");
    let (out, _) = run(
        "scd bench links",
        scd_on_model("--model", &["bench", "links"])
            .args([
                "--links",
                "500",
                "--prompts",
                "1",
                "--prompt-tokens",
                "32",
                "--continuation",
                "2",
                "--out",
            ])
            .arg(&json),
    );
    assert!(out.contains("| link | codes |"), "{out}");
    for codes in ["raw", "default ranks", "adaptive ranks"] {
        let cells = row(&out, &format!("| 500 Mbit/s | {codes} |"));
        positive(&cells[4]); // payload MB
    }
    let record: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert!(!record.is_null(), "{record}");
}

#[test]
fn bench_fanout_compares_one_fan_out_with_a_job_per_expert() {
    let (out, _) = run(
        "scd bench fanout",
        scd_on_model("--model", &["bench", "fanout"]).args([
            "--experts",
            "mail,sotu",
            "--prompts",
            "1",
            "--prompt-tokens",
            "32",
            "--max-tokens",
            "2",
        ]),
    );
    assert!(out.contains("| way | jobs | prefills |"), "{out}");
    let fan = row(&out, "| fan-out |");
    assert_eq!(fan[1..3], ["1", "1"], "{out}");
    positive(&fan[3]);
    let separate = row(&out, "| separate |");
    assert_eq!(separate[1..3], ["2", "2"], "{out}");
}

/// One step of fine-tuning on a small corpus in a folder of its own; the adapter it writes
/// loads and generates.
#[test]
fn finetune_writes_an_adapter_that_generates() {
    let dir = tempfile::tempdir().unwrap();
    let text = corpus(dir.path());
    let out_dir = dir.path().join("expert");
    let (_, err) = run(
        "scd finetune",
        scd_on_model("--model", &["finetune"])
            .arg("--corpus")
            .arg(&text)
            .arg("--out")
            .arg(&out_dir)
            .args([
                "--rank",
                "2",
                "--alpha",
                "4",
                "--warmup",
                "0",
                "--steps",
                "1",
                "--seq-len",
                "16",
                "--batch",
                "1",
                "--valid-windows",
                "1",
                "--targets",
                "q,v",
                "--layers",
                "0-1",
            ]),
    );
    assert!(err.contains("done: 1 steps"), "{err}");
    let adapter = out_dir.join("adapter.safetensors");
    assert!(adapter.is_file() && out_dir.join("manifest.json").is_file());
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out_dir.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["hyperparameters"]["steps"], 1, "{manifest}");
    let (reply, _) = run(
        "scd generate with the new adapter",
        scd_on_model("--model", &["generate"])
            .arg("--adapter")
            .arg(&adapter)
            .args(["--prompt", "The sea", "--raw", "--max-tokens", "2"]),
    );
    assert!(!reply.trim().is_empty(), "an empty reply");
}

/// A calibration with the fewest prompts, ranks and epochs the flags allow, on a small corpus;
/// the translator it writes carries a prompt to its expert (`scd generate --transfer scd`).
/// The longest test here (about a minute on two idle cores): the held-out prompts are 289
/// tokens whatever the flags, and the rank curve at the end measures 36 points per mode.
#[test]
fn calibrate_writes_a_translator_that_serves_a_transfer() {
    let dir = tempfile::tempdir().unwrap();
    let text = corpus(dir.path());
    let translator = dir.path().join("translator");
    let (_, err) = run(
        "scd calibrate",
        scd_on_model("--producer", &["calibrate"])
            .args(["--consumer-adapter", "experts/mail"])
            .arg("--out")
            .arg(&translator)
            .arg("--corpus")
            .arg(&text)
            .args([
                "--prefixes",
                "2",
                "--prefix-tokens",
                "16",
                "--heldout",
                "1",
                // K and V at full width: the rank curve at the end measures the grid of the
                // full width whatever --r-max says (src/cmd/calibrate.rs keeps the default
                // grid), so a smaller K or V fails there, asking for ranks above it.
                "--r-max",
                "0,0,8",
                "--ranks",
                "0,0,4",
                "--patch-layers",
                "0",
                "--shortlist",
                "1",
                "--aligner-hidden",
                "8",
                "--aligner-epochs",
                "1",
                "--aligner-rows",
                "16",
                "--droidspeak",
                "1,0",
                "--chat-share",
                "0",
                "--version",
                "smoke",
            ]),
    );
    assert!(err.contains("translator smoke ("), "{err}");
    assert!(translator.join("translator.json").is_file(), "{err}");
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(translator.join("translator.json")).unwrap())
            .unwrap();
    assert_eq!(manifest["version"], "smoke", "{manifest}");
    let (reply, err) = run(
        "scd generate --transfer scd with the new translator",
        scd_on_model("--model", &["generate"])
            .args(["--adapter", "experts/mail/adapter.safetensors"])
            .args(["--transfer", "scd", "--translator"])
            .arg(&translator)
            .args([
                "--prompt",
                "Subject: hello\n\n",
                "--raw",
                "--max-tokens",
                "2",
            ]),
    );
    assert!(!reply.trim().is_empty(), "an empty reply");
    assert!(err.contains("% of raw bf16 KV"), "{err}");
}

#[test]
fn eval_drift_measures_an_expert_against_its_base() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("drift.json");
    let (out, _) = run(
        "scd eval drift",
        scd_on_model("--model", &["eval", "drift"])
            .args(["--expert", "experts/melville"])
            .args(["--windows", "1", "--window-tokens", "17"])
            .args(["--wikitext-windows", "1", "--prefix-tokens", "8"])
            .args(["--continuation-tokens", "2", "--greedy-tokens", "1"])
            .args(["--squad-questions", "0", "--json"])
            .arg(&json),
    );
    positive(&row(&out, "| raw |")[1]);
    let record: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(record[0]["expert"], "melville", "{record}");
    assert!(
        record[0]["domain"]["expert_perplexity"]["value"].as_f64() > Some(0.0),
        "{record}"
    );
}

#[test]
fn eval_multidoc_compares_stitching_and_the_sempic_writer() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("multidoc.json");
    let (out, _) = run(
        "scd eval multidoc",
        scd_on_model("--model", &["eval", "multidoc"])
            .args(["--writer", "experts/sempic-writer/adapter.safetensors"])
            .args(["--questions", "1", "--answer-tokens", "2"])
            .args(["--min-distractors", "1", "--max-distractors", "1", "--json"])
            .arg(&json),
    );
    assert!(out.contains("Multi-document QA: 1 questions"), "{out}");
    row(&out, "| full recompute |");
    positive(&row(&out, "| no recompute |")[5]); // KL to full recompute
    positive(&row(&out, "| SemPIC |")[5]);
    let record: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(record["questions"], 1, "{record}");
}

/// `bench ttft` at its tiniest: the grid runs through an in-process
/// cluster, the JSON has every cell with sane values, and `--project` fits the cost model to it
/// and writes the projection and the plots.
#[test]
fn bench_ttft_writes_every_cell_and_the_cost_model_reads_them() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("ttft.json");
    let (stdout, _) = run(
        "bench ttft",
        &mut scd_on_model(
            "--model",
            &[
                "bench",
                "ttft",
                "--modes",
                "oracle,raw,scd,auto",
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
            ],
        ),
    );
    assert!(stdout.contains("| 200m | warm | 24 | scd |"), "{stdout}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let cells = v["cells"].as_array().unwrap();
    // 2 links x cold, warm x 4 modes.
    assert_eq!(cells.len(), 16, "{cells:#?}");
    let jobs = v["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 32);
    // Every auto job says what it ran as and why; no fixed job does.
    for j in jobs {
        let auto = j["mode"] == "auto";
        assert_eq!(j["chosen"].is_string(), auto, "{j}");
        assert_eq!(j["reason"].is_string(), auto, "{j}");
    }
    // Each auto cell is checked against the fastest fixed mode of its cell.
    let checks = v["auto"].as_array().unwrap();
    assert_eq!(checks.len(), 4, "{checks:#?}");
    for a in checks {
        let ran: u64 = a["chosen"]
            .as_object()
            .unwrap()
            .values()
            .map(|n| n.as_u64().unwrap())
            .sum();
        assert_eq!(ran, 2, "{a}");
        let best = a["best_fixed_median_ms"].as_f64().unwrap();
        let ratio = a["ratio"].as_f64().unwrap();
        assert!(
            (ratio * best - a["auto_median_ms"].as_f64().unwrap()).abs() < 1e-6,
            "{a}"
        );
        assert!(
            ["oracle", "raw", "scd"].contains(&a["best_fixed"].as_str().unwrap()),
            "{a}"
        );
    }
    assert!(
        stdout.contains("auto within 10% of the best fixed mode in"),
        "{stdout}"
    );
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
        // Auto's quality is known where every mode it ran in was measured.
        if c["mode"] != "auto" || !c["kl"].is_null() {
            let kl = c["kl"].as_f64().unwrap();
            assert!(kl.is_finite() && kl >= 0.0, "{c}");
        }
        if c["mode"] == "oracle" {
            assert!((c["speedup_vs_oracle"].as_f64().unwrap() - 1.0).abs() < 1e-9);
        }
    }

    let plots = dir.path().join("plots");
    let (stdout, _) = run(
        "bench ttft --project",
        &mut scd(&[
            "bench",
            "ttft",
            "--project",
            json.to_str().unwrap(),
            "--plots",
            plots.to_str().unwrap(),
        ]),
    );
    assert!(stdout.contains("median |predicted - measured|"), "{stdout}");
    assert!(stdout.contains("7B (Mistral-7B shape)"), "{stdout}");
    let fitted: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(plots.join("cost-model.json")).unwrap())
            .unwrap();
    // The model is fitted to the fixed modes' cells only.
    assert_eq!(fitted["cells"].as_array().unwrap().len(), 12);
    assert!(fitted["median_relative_error"]
        .as_f64()
        .unwrap()
        .is_finite());
    assert!(!fitted["projection"].as_array().unwrap().is_empty());
    assert!(plots.join("cost-model.md").exists());
}
