//! Progress for long commands: a bar on a terminal, plain lines otherwise (logs, CI), so the
//! same events read well in both places.

use std::io::IsTerminal;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A progress bar that prints plain lines when stderr is not a terminal.
pub struct Progress {
    bar: ProgressBar,
    tty: bool,
    /// Without a terminal: the tenth of the current phase last printed.
    printed: std::sync::atomic::AtomicU64,
}

impl Progress {
    /// A bar over `total` items counted as `unit`.
    pub fn new(total: u64, unit: &str) -> anyhow::Result<Self> {
        let tty = std::io::stderr().is_terminal();
        let bar = ProgressBar::new(total);
        if tty {
            bar.set_style(
                ProgressStyle::with_template(&format!(
                    "{{elapsed_precise}} [{{bar:30}}] {{pos}}/{{len}} {unit}, eta {{eta}} {{msg}}"
                ))
                .context("progress template")?
                .progress_chars("=> "),
            );
        } else {
            bar.set_draw_target(ProgressDrawTarget::hidden());
        }
        Ok(Self {
            bar,
            tty,
            printed: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Whether a bar is drawn.
    pub fn is_tty(&self) -> bool {
        self.tty
    }

    /// Starts over with `total` items.
    pub fn restart(&self, total: u64) {
        self.bar.set_length(total);
        self.bar.set_position(0);
        self.printed.store(0, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sets the length and the items done; without a terminal, prints a line at every tenth.
    pub fn set(&self, done: u64, total: u64) {
        self.bar.set_length(total);
        self.bar.set_position(done);
        if !self.tty && total > 0 {
            let tenth = done * 10 / total;
            let last = self
                .printed
                .swap(tenth, std::sync::atomic::Ordering::Relaxed);
            if tenth > last {
                eprintln!("  {done}/{total}");
            }
        }
    }

    /// A status message beside the bar (printed as a line without a terminal when `echo`).
    pub fn message(&self, msg: String, echo: bool) {
        if self.tty {
            self.bar.set_message(msg);
        } else if echo {
            eprintln!("{msg}");
        }
    }

    /// A line above the bar.
    pub fn line(&self, line: impl AsRef<str>) {
        if self.tty {
            self.bar.println(line.as_ref());
        } else {
            eprintln!("{}", line.as_ref());
        }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
