//! End-to-end: the `scd generate` binary on the real model, and its errors on bad input.

use std::path::PathBuf;
use std::process::Command;

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

fn scd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_scd"))
}

#[test]
fn generate_streams_a_reply_and_exits_zero() {
    let out = scd()
        .args(["generate", "--model"])
        .arg(model_path())
        .args([
            "--prompt",
            "What is the capital of France?",
            "--max-tokens",
            "16",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stderr: {stderr}");
    assert!(stdout.contains("Paris"), "stdout: {stdout:?}");
    assert!(
        stderr.contains("prompt") && stderr.contains("generated"),
        "stderr: {stderr}"
    );
}

/// The shipped melville expert gives the same greedy reply whether its adapter is merged into
/// the weights or applied on the fly, and a different one from the base model.
#[test]
fn adapter_modes_agree_and_differ_from_the_base() {
    let adapter =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("experts/melville/adapter.safetensors");
    let reply = |extra: &[&str]| {
        let out = scd()
            .args(["generate", "--model"])
            .arg(model_path())
            .args([
                "--prompt",
                "Describe the sea.",
                "--max-tokens",
                "12",
                "--raw",
            ])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let a = adapter.to_str().unwrap();
    let merged = reply(&["--adapter", a]);
    let fly = reply(&["--adapter", a, "--adapter-mode", "on-the-fly"]);
    let base = reply(&[]);
    assert_eq!(merged, fly);
    assert_ne!(merged, base);
}

#[test]
fn generate_with_a_missing_model_fails_clearly() {
    let out = scd()
        .args([
            "generate",
            "--model",
            "/nonexistent/model.gguf",
            "--prompt",
            "hi",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("/nonexistent/model.gguf") && stderr.contains("not found"),
        "{stderr}"
    );
}

#[test]
fn generate_rejects_a_non_gguf_file_and_a_context_overflow() {
    let dir = tempfile::tempdir().unwrap();
    let bogus = dir.path().join("bogus.gguf");
    std::fs::write(&bogus, "not a model").unwrap();
    let out = scd()
        .args(["generate", "--model"])
        .arg(&bogus)
        .args(["--prompt", "hi"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a GGUF file"));

    let out = scd()
        .args(["generate", "--model"])
        .arg(model_path())
        .args(["--prompt", "hi", "--max-tokens", "100000"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("context window"), "{stderr}");
}
