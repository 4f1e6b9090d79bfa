//! `scd completions SHELL` prints a completion script that knows the commands.

use std::process::Command;

#[test]
fn completion_scripts_name_the_commands() {
    for shell in ["bash", "zsh", "fish"] {
        let out = Command::new(env!("CARGO_BIN_EXE_scd"))
            .args(["completions", shell])
            .output()
            .unwrap();
        assert!(out.status.success(), "{shell}");
        let script = String::from_utf8(out.stdout).unwrap();
        for command in ["submit", "node", "jobs", "calibrate"] {
            assert!(script.contains(command), "{shell}: no {command}");
        }
    }
    let out = Command::new(env!("CARGO_BIN_EXE_scd"))
        .args(["completions", "tcsh"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "an unknown shell is a usage error"
    );
}
