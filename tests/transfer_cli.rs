//! End-to-end: disaggregated generation through `scd generate --transfer` with the shipped
//! experts and their shipped translators (experts/<name>/translator), and the refusal of a
//! translator made for another expert.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The experts that ship a translator (experts/README.md).
const EXPERTS: [&str; 3] = ["mail", "sotu", "melville"];
const PROMPT: &str =
    "From: dana@lists.example.org\nSubject: Re: sorting folders by date\n\nNot directly, but";

fn model_path() -> PathBuf {
    let dir = std::env::var("SCD_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".cache/models"));
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run `make model`",
        path.display()
    );
    path
}

fn expert(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("experts")
        .join(name)
}

fn generate(name: &str, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_scd"))
        .args(["generate", "--model"])
        .arg(model_path())
        .arg("--adapter")
        .arg(expert(name).join("adapter.safetensors"))
        .args(["--prompt", PROMPT, "--raw", "--max-tokens", "8"])
        .args(extra)
        .output()
        .unwrap()
}

fn ok(out: &Output) -> (String, String) {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "stderr: {stderr}");
    (stdout, stderr)
}

/// The payload share the binary reports, in percent.
fn payload_share(stderr: &str) -> f64 {
    let at = stderr
        .find("% of raw bf16 KV")
        .unwrap_or_else(|| panic!("no payload line in {stderr}"));
    let start = stderr[..at].rfind('(').expect("a payload share") + 1;
    stderr[start..at].parse().expect("a number")
}

/// Every shipped translator loads, matches its expert (the hashes of base and adapter), and
/// carries the prompt at a third of raw KV's bytes; the oracle handover gives exactly the
/// expert's own greedy reply; raw KV costs 100%.
#[test]
fn shipped_translators_carry_prompts_to_their_experts() {
    for name in EXPERTS {
        let translator = expert(name).join("translator");
        let t = translator.to_str().unwrap();
        let (own, _) = ok(&generate(name, &[]));
        let (oracle, _) = ok(&generate(name, &["--transfer", "oracle"]));
        assert_eq!(
            oracle, own,
            "{name}: the oracle handover must not change the reply"
        );
        let (_, raw) = ok(&generate(name, &["--transfer", "raw"]));
        assert!((payload_share(&raw) - 100.0).abs() < 0.5, "{name}: {raw}");
        let (reply, scd) = ok(&generate(
            name,
            &[
                "--transfer",
                "scd",
                "--translator",
                t,
                "--code-dtype",
                "i8-rows",
            ],
        ));
        assert!(!reply.trim().is_empty(), "{name}: an empty reply");
        let share = payload_share(&scd);
        assert!(
            share > 1.0 && share < 40.0,
            "{name}: scd payload {share}% ({scd})"
        );
    }
}

/// A translator made for one expert is refused for another, naming the mismatch.
#[test]
fn a_translator_for_another_expert_is_refused() {
    let other = expert("mail").join("translator");
    let out = generate(
        "sotu",
        &["--transfer", "scd", "--translator", other.to_str().unwrap()],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "stderr: {stderr}");
    assert!(
        stderr.contains("calibrated for consumers [mail"),
        "stderr: {stderr}"
    );
}

/// `scd eval --text` cuts its continuation windows from an expert's own validation split
/// instead of WikiText-2, and says so in the record; an unknown text is refused by name.
#[test]
fn eval_measures_transfer_on_an_experts_own_text() {
    let eval = |text: &str| {
        Command::new(env!("CARGO_BIN_EXE_scd"))
            .args(["eval", "--producer"])
            .arg(model_path())
            .arg("--consumer-adapter")
            .arg(expert("sotu").join("adapter.safetensors"))
            .args(["--text", text, "--methods", "oracle,raw"])
            .args(["--wikitext-windows", "2", "--prefix-tokens", "24"])
            .args(["--continuation-tokens", "4", "--greedy-tokens", "2"])
            .args(["--squad-questions", "0"])
            .output()
            .unwrap()
    };
    let (own, _) = ok(&eval("sotu"));
    assert!(own.contains("sotu valid: 2 windows"), "{own}");
    assert!(own.contains("| sotu valid PPL |"), "{own}");
    let (wiki, _) = ok(&eval("wikitext2"));
    assert!(wiki.contains("WikiText-2: 2 windows"), "{wiki}");
    let raw_row = |md: &str| {
        md.lines()
            .find(|l| l.starts_with("| raw |"))
            .map(str::to_owned)
    };
    assert_ne!(raw_row(&own), raw_row(&wiki));
    let out = eval("no-such-corpus");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--text no-such-corpus"),
        "{stderr}"
    );
}
