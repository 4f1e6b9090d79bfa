//! End-to-end tests of `scd cert`: the files it writes, their modes, and its refusals.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

fn scd(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_scd"))
        .args(args)
        .output()
        .expect("run scd")
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[test]
fn init_then_issue_writes_certificates_with_private_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("pki");
    let dir_s = dir.to_str().unwrap();

    let out = scd(&["cert", "init", "--dir", dir_s]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(mode(&dir.join("ca.key")), 0o600);
    assert!(std::fs::read_to_string(dir.join("ca.pem"))
        .unwrap()
        .contains("BEGIN CERTIFICATE"));

    for (name, role) in [("node-1", "node"), ("ops", "admin")] {
        let out = scd(&[
            "cert", "issue", "--dir", dir_s, "--name", name, "--role", role,
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(mode(&dir.join(format!("{name}.key"))), 0o600);
        assert!(dir.join(format!("{name}.pem")).exists());
    }
}

#[test]
fn refuses_to_overwrite_and_reports_a_missing_ca() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_str().unwrap();

    let out = scd(&[
        "cert", "issue", "--dir", dir, "--name", "n1", "--role", "node",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("ca"),
        "error should name the missing CA: {err}"
    );

    assert!(scd(&["cert", "init", "--dir", dir]).status.success());
    let before = std::fs::read(tmp.path().join("ca.key")).unwrap();
    let again = scd(&["cert", "init", "--dir", dir]);
    assert!(
        !again.status.success(),
        "a second init must not replace the CA"
    );
    assert_eq!(std::fs::read(tmp.path().join("ca.key")).unwrap(), before);

    assert!(
        scd(&["cert", "issue", "--dir", dir, "--name", "n1", "--role", "node"])
            .status
            .success()
    );
    let dup = scd(&[
        "cert", "issue", "--dir", dir, "--name", "n1", "--role", "node",
    ]);
    assert!(
        !dup.status.success(),
        "issuing the same name twice must fail"
    );

    let bad = scd(&[
        "cert",
        "issue",
        "--dir",
        dir,
        "--name",
        "Bad Name!",
        "--role",
        "node",
    ]);
    assert!(!bad.status.success());
}
