//! How the binary prints an error that ends a command.
//!
//! anyhow's own report (what `main` returning `Err` prints) lists every cause of the chain, and
//! its `{:#}` joins them on one line. Our library errors name their source in their message
//! ("cannot access adapter file P: No such file or directory") and also return it as their
//! `source()`, so that a log line read alone says everything; anyhow's forms then print the
//! innermost cause twice. [`report`] and [`one_line`] leave out a cause whose text the one
//! before it already holds, and otherwise read as anyhow's (the backtrace too, when
//! `RUST_BACKTRACE` or `RUST_LIB_BACKTRACE` asks for one).

use std::backtrace::BacktraceStatus;
use std::fmt::Write;

/// The causes of `e` after its message, less each one whose text the one before it holds.
fn causes(e: &anyhow::Error) -> Vec<String> {
    let mut said = e.to_string();
    e.chain()
        .skip(1)
        .map(|c| c.to_string())
        .filter(|c| {
            let new = !said.contains(c.as_str());
            said = c.clone();
            new
        })
        .collect()
}

/// `e` and the causes not already said on one line, joined by `: ` (as anyhow's `{:#}`).
pub fn one_line(e: &anyhow::Error) -> String {
    std::iter::once(e.to_string())
        .chain(causes(e))
        .collect::<Vec<_>>()
        .join(": ")
}

/// The report of `e`: `Error: <message>`, then the causes not already said.
pub fn report(e: &anyhow::Error) -> String {
    let mut out = format!("Error: {e}");
    match causes(e).as_slice() {
        [] => {}
        [one] => {
            let _ = write!(out, "\n\nCaused by:\n    {one}");
        }
        many => {
            out.push_str("\n\nCaused by:");
            for (i, c) in many.iter().enumerate() {
                let _ = write!(out, "\n    {i}: {c}");
            }
        }
    }
    if e.backtrace().status() == BacktraceStatus::Captured {
        let _ = write!(out, "\n\nStack backtrace:\n{}", e.backtrace());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::report;
    use anyhow::Context;

    /// A library error that names its source and also returns it, as ours do (with
    /// `#[error("... {source}")]`).
    #[derive(Debug)]
    struct Access {
        path: String,
        source: std::io::Error,
    }

    impl std::fmt::Display for Access {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(
                f,
                "cannot access adapter file {}: {}",
                self.path, self.source
            )
        }
    }

    impl std::error::Error for Access {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.source)
        }
    }

    fn missing() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory")
    }

    #[test]
    fn a_cause_the_message_above_already_holds_is_said_once() {
        let e = Err::<(), _>(Access {
            path: "experts/mail/adapter.safetensors".into(),
            source: missing(),
        })
        .context("loading experts/mail/adapter.safetensors")
        .unwrap_err();
        let r = report(&e);
        assert!(
            r.starts_with("Error: loading experts/mail/adapter.safetensors\n"),
            "{r}"
        );
        assert!(
            r.contains(
                "\n    cannot access adapter file experts/mail/adapter.safetensors: No such file"
            ),
            "{r}"
        );
        assert_eq!(r.matches("No such file or directory").count(), 1, "{r}");
        assert_eq!(
            super::one_line(&e),
            "loading experts/mail/adapter.safetensors: cannot access adapter file \
             experts/mail/adapter.safetensors: No such file or directory"
        );
    }

    #[test]
    fn causes_that_add_something_are_all_listed_in_order() {
        let e = Err::<(), _>(missing())
            .context("reading the node config")
            .context("starting the node")
            .unwrap_err();
        let r = report(&e);
        assert!(
            r.starts_with("Error: starting the node\n\nCaused by:\n"),
            "{r}"
        );
        let (a, b) = (
            r.find("0: reading the node config").unwrap(),
            r.find("1: No such file or directory").unwrap(),
        );
        assert!(a < b, "{r}");
        let plain = anyhow::anyhow!("no cause");
        assert_eq!(report(&plain).lines().next(), Some("Error: no cause"));
        assert!(!report(&plain).contains("Caused by"));
    }
}
