//! The documents a user reads, checked against the code they describe:
//!
//! - `docs/reference-config.toml` parses with the node's own config loader, and sets every key
//!   the loader knows: each section's key list comes from the loader itself (a key it does not
//!   know is refused with the list of the keys it expects), so a field added to
//!   `actors/src/config.rs` fails this test until the reference documents it. Every key has a
//!   comment above it that gives its default or says it is required.
//! - README.md's "Environment" table lists exactly the `SCD_*` variables the code reads: the
//!   names found in the repository's Rust sources, the Makefile and the scripts under `ops/`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use scd_actors::config::{ConfigError, NodeConfig, NodeRole, StoreConfig};

/// A key no config section has, inserted to make the loader list the keys it expects.
const PROBE: &str = "zz_undocumented_key";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

fn reference() -> (PathBuf, String) {
    let path = root().join("docs/reference-config.toml");
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (path, text)
}

fn parse(text: &str) -> Result<NodeConfig, ConfigError> {
    NodeConfig::parse(text, &root().join("docs"))
}

#[test]
fn the_reference_config_parses_with_the_node_loader() {
    let (path, text) = reference();
    let config = parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    for role in [
        NodeRole::Producer,
        NodeRole::Consumer,
        NodeRole::Scheduler,
        NodeRole::Admin,
        NodeRole::Gateway,
    ] {
        assert!(
            config.has_role(role),
            "the reference holds every role: {role}"
        );
    }
    assert!(matches!(config.store, StoreConfig::Etcd { .. }));
    assert!(config.documents.is_some() && config.drift.is_some());
    assert_eq!(config.experts.len(), 1);
    // Paths resolve against the file's folder, as the reference says.
    assert_eq!(
        config.models.base.as_deref(),
        Some(
            root()
                .join("docs/../.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
                .as_path()
        )
    );
}

/// The keys the loader expects in the table at `at` of `doc` (a path of keys; an array of
/// tables by its first element), or `None` when that table takes keys of any name (a map).
fn expected_keys(doc: &toml::Table, at: &[String]) -> Option<BTreeSet<String>> {
    let mut probed = doc.clone();
    let mut table = &mut probed;
    for step in at {
        table = match table.get_mut(step).expect("a path the walk found") {
            toml::Value::Table(t) => t,
            toml::Value::Array(items) => match items.first_mut() {
                Some(toml::Value::Table(t)) => t,
                other => panic!("{step}: not an array of tables: {other:?}"),
            },
            other => panic!("{step}: not a table: {other:?}"),
        };
    }
    table.insert(PROBE.to_owned(), toml::Value::Integer(1));
    let text = toml::to_string(&probed).expect("a TOML table serialises");
    let message = match parse(&text) {
        Err(ConfigError::Parse(e)) => e.to_string(),
        _ => return None,
    };
    let marker = format!("unknown field `{PROBE}`");
    let line = message.lines().find(|l| l.contains(&marker))?;
    let list = line.split_once(&marker).map(|(_, rest)| rest)?;
    // serde writes "expected `a`", "expected `a` or `b`" or "expected one of `a`, `b`, ...".
    let keys: BTreeSet<String> = list
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect();
    assert!(!keys.is_empty(), "no expected keys in {message:?}");
    Some(keys)
}

/// Every table of `doc` (arrays of tables by their first element), with its keys, root first.
fn tables(doc: &toml::Table) -> Vec<(Vec<String>, BTreeSet<String>)> {
    fn walk(table: &toml::Table, at: Vec<String>, out: &mut Vec<(Vec<String>, BTreeSet<String>)>) {
        out.push((at.clone(), table.keys().cloned().collect()));
        for (key, value) in table {
            let inner = match value {
                toml::Value::Table(t) => Some(t),
                toml::Value::Array(items) => match items.first() {
                    Some(toml::Value::Table(t)) => Some(t),
                    _ => None,
                },
                _ => None,
            };
            if let Some(t) = inner {
                let mut path = at.clone();
                path.push(key.clone());
                walk(t, path, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(doc, Vec::new(), &mut out);
    out
}

#[test]
fn the_reference_config_sets_every_key_the_loader_knows() {
    let (path, text) = reference();
    let doc: toml::Table = text.parse().expect("the reference is TOML");
    let mut undocumented = Vec::new();
    let mut strict = BTreeSet::new();
    for (at, keys) in tables(&doc) {
        let name = if at.is_empty() {
            "the top level".to_owned()
        } else {
            format!("[{}]", at.join("."))
        };
        let Some(expected) = expected_keys(&doc, &at) else {
            continue;
        };
        strict.insert(name.clone());
        // An internally tagged table (`[store]`) lists its variant's keys, not the tag.
        let missing: Vec<_> = expected.difference(&keys).cloned().collect();
        if !missing.is_empty() {
            undocumented.push(format!("{name}: {}", missing.join(", ")));
        }
    }
    assert!(
        undocumented.is_empty(),
        "{} does not set keys the node config has (document each, with its default): {}",
        path.display(),
        undocumented.join("; ")
    );
    // Every section refuses unknown keys; had one stopped, its keys would go unchecked here.
    for section in [
        "the top level",
        "[node]",
        "[models]",
        "[experts]",
        "[store]",
        "[tls]",
        "[tracing]",
        "[limits]",
        "[codec]",
        "[gateway]",
        "[links]",
        "[drift]",
        "[documents]",
    ] {
        assert!(
            strict.contains(section),
            "{section}: the loader no longer lists its keys (or the reference lacks it): {strict:?}"
        );
    }
    // The other store kind: its keys must be among those the reference documents for [store].
    let mut embedded = doc.clone();
    let store = embedded
        .get_mut("store")
        .and_then(toml::Value::as_table_mut)
        .expect("[store]");
    store.insert("kind".into(), toml::Value::String("embedded".into()));
    // etcd's own keys: its addresses and its TLS files.
    for key in ["endpoints", "ca", "cert", "key"] {
        store.remove(key);
    }
    let documented: BTreeSet<String> = doc["store"].as_table().unwrap().keys().cloned().collect();
    let expected = expected_keys(&embedded, &["store".to_owned()])
        .expect("an embedded [store] refuses unknown keys");
    assert!(
        expected.is_subset(&documented),
        "kind = \"embedded\" has keys the reference does not document: {:?}",
        expected.difference(&documented).collect::<Vec<_>>()
    );
}

#[test]
fn every_key_of_the_reference_config_has_its_default_above_it() {
    let (path, text) = reference();
    let lines: Vec<&str> = text.lines().collect();
    let mut bare = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with('[') {
            continue;
        }
        let key = line.split('=').next().unwrap_or(line).trim();
        let comment: Vec<&str> = lines[..i]
            .iter()
            .rev()
            .map(|l| l.trim())
            .take_while(|l| l.starts_with('#'))
            .collect();
        let said = comment.join(" ");
        if !(said.contains("Default") || said.contains("Required")) {
            bare.push(format!("line {}: {key}", i + 1));
        }
    }
    assert!(
        bare.is_empty(),
        "{}: keys without a comment giving their default (or saying they are required): {}",
        path.display(),
        bare.join(", ")
    );
}

/// The `SCD_*` names in `text` (a name is the prefix and what follows in A-Z, 0-9 and '_',
/// trailing underscores dropped).
fn variables_in(text: &str) -> BTreeSet<String> {
    let prefix = "SCD_";
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find(prefix) {
        let before = rest[..at].chars().next_back();
        let tail = &rest[at + prefix.len()..];
        let len = tail
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        let name = tail[..len].trim_end_matches('_');
        // `XSCD_...` is another name; `SCD_` alone (as in this file) is none.
        let word_start = before.is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
        if word_start && !name.is_empty() {
            names.insert(format!("{prefix}{name}"));
        }
        rest = &tail[len..];
    }
    names
}

/// Where the code reads its environment: Rust sources, the Makefile, and the scripts under ops/.
fn code_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if !(name.starts_with('.') || name == "target" || name == "node_modules") {
                code_files(&path, out);
            }
            continue;
        }
        let in_ops = path.strip_prefix(root().join("ops")).is_ok();
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let own =
            path.ends_with(file!()) || path.ends_with("actors/tests/integration/user_docs.rs");
        if !own && (ext == "rs" || (in_ops && (ext == "sh" || ext == "py"))) {
            out.push(path);
        }
    }
}

/// The variables the README's "Environment" table lists, each with its default and meaning.
fn readme_variables() -> BTreeSet<String> {
    let path = root().join("README.md");
    let text = fs::read_to_string(&path).unwrap();
    let section = text
        .split("\n## ")
        .find(|s| s.starts_with("Environment"))
        .expect("README.md has an \"Environment\" section");
    let mut names = BTreeSet::new();
    for row in section.lines().filter(|l| l.starts_with("| `SCD_")) {
        let cells: Vec<&str> = row
            .trim_matches('|')
            .splitn(3, " | ")
            .map(str::trim)
            .collect();
        assert!(
            cells.len() == 3 && cells.iter().all(|c| !c.is_empty()),
            "README.md, Environment: a row is `| name | default | meaning |`: {row}"
        );
        let name = cells[0].trim_matches('`').to_owned();
        assert!(names.insert(name.clone()), "README.md lists {name} twice");
    }
    names
}

#[test]
fn the_readme_lists_every_environment_variable_the_code_reads() {
    let root = root();
    let mut files = vec![root.join("Makefile")];
    code_files(&root, &mut files);
    let mut used: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for file in &files {
        let text = fs::read_to_string(file).unwrap_or_default();
        for name in variables_in(&text) {
            let shown = file
                .strip_prefix(&root)
                .unwrap_or(file)
                .display()
                .to_string();
            used.entry(name).or_default().push(shown);
        }
    }
    assert!(
        used.len() >= 10,
        "too few variables found: the scan is broken ({used:?})"
    );
    let listed = readme_variables();
    let missing: Vec<String> = used
        .iter()
        .filter(|(name, _)| !listed.contains(*name))
        .map(|(name, files)| format!("{name} (read in {})", files.join(", ")))
        .collect();
    let stale: Vec<&String> = listed.iter().filter(|n| !used.contains_key(*n)).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "README.md's Environment table and the code disagree.\n\
         Read by the code, not in the table: {missing:?}\n\
         In the table, read nowhere: {stale:?}"
    );
}

#[test]
fn variable_names_are_found_whole() {
    let found = variables_in("a SCD_MODEL_DIR=x ${SCD_LOG:-warn} \"SCD_\" XSCD_NOT SCD_NETNS_ b");
    let want: BTreeSet<String> = ["SCD_MODEL_DIR", "SCD_LOG", "SCD_NETNS"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(found, want);
}

/// A JSON record the repository keeps (`scd eval --json`, `scd eval multidoc --json`).
fn record(path: &str) -> serde_json::Value {
    let path = root().join(path);
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// An estimate's value (`{"value": .., "low": .., "high": ..}`).
fn value(v: &serde_json::Value) -> f64 {
    v["value"]
        .as_f64()
        .unwrap_or_else(|| panic!("no value: {v}"))
}

/// The numbers written in `cell`, in order, as text (to know how many decimals were shown).
fn numbers(cell: &str) -> Vec<&str> {
    cell.split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .map(|s| s.trim_matches('.'))
        .filter(|s| s.chars().any(|c| c.is_ascii_digit()))
        .collect()
}

/// Whether `shown` is `actual` rounded to the decimals `shown` has.
fn rounds_to(shown: &str, actual: f64) -> bool {
    let decimals = shown.split_once('.').map_or(0, |(_, d)| d.len()) as i32;
    let shown: f64 = shown.parse().unwrap();
    (shown - actual).abs() <= 0.5 * 10f64.powi(-decimals) + 1e-9
}

/// The cells of BENCHMARKS.md's table row whose first cell starts with `first`.
fn benchmarks_row(text: &str, first: &str) -> Vec<String> {
    let row = text
        .lines()
        .find(|l| l.starts_with(&format!("| {first}")))
        .unwrap_or_else(|| panic!("BENCHMARKS.md has no row \"{first}\""));
    row.trim_matches('|')
        .split(" | ")
        .map(|c| c.trim().to_owned())
        .collect()
}

#[test]
fn benchmarks_rows_agree_with_the_json_records_they_name() {
    let text = fs::read_to_string(root().join("BENCHMARKS.md")).unwrap();
    // The translators' table: one column per expert, each from docs/m3/<expert>-main.json.
    let experts = ["mail-rope", "mail", "sotu", "melville"];
    let header = format!("| target | {} | status |", experts.join(" | "));
    assert!(text.contains(&header), "BENCHMARKS.md: {header}");
    let vs_raw = benchmarks_row(&text, "SCD KL <= 0.5x raw's");
    let vs_reuse = benchmarks_row(&text, "SCD KL <= 0.5x Reuse-only's");
    let greedy = benchmarks_row(&text, "SCD greedy agreement above raw's");
    let mut wrong = Vec::new();
    for (i, expert) in experts.iter().enumerate() {
        let json = record(&format!("docs/m3/{expert}-main.json"));
        let by_method = |m: &str| {
            json["results"]
                .as_array()
                .unwrap()
                .iter()
                .find(|r| r["method"] == m)
                .unwrap_or_else(|| panic!("{expert}: no {m} result"))
                .clone()
        };
        let (raw, reuse, scd) = (by_method("raw"), by_method("reuse"), by_method("scd"));
        let kl = |r: &serde_json::Value| value(&r["kl"]);
        let share = scd["payload_share_of_raw"].as_f64().unwrap() * 100.0;
        let checks = [
            (&vs_raw, 0, kl(&scd) / kl(&raw)),
            (&vs_raw, 1, share),
            (&vs_reuse, 0, kl(&scd) / kl(&reuse)),
            (&greedy, 0, value(&scd["greedy_agreement"])),
            (&greedy, 1, value(&raw["greedy_agreement"])),
        ];
        for (row, at, actual) in checks {
            let cell = &row[i + 1];
            let shown = numbers(cell);
            if !shown.get(at).is_some_and(|s| rounds_to(s, actual)) {
                wrong.push(format!(
                    "{} / {expert}: {cell:?}, the record has {actual:.4}",
                    row[0]
                ));
            }
        }
    }
    // Multi-document QA and needles, from docs/m9.
    let mode = |json: &serde_json::Value, name: &str| {
        json["modes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["mode"] == name)
            .unwrap_or_else(|| panic!("no mode {name}"))
            .clone()
    };
    let stage2 = record("docs/m9/multidoc-sempic-stage2.json");
    let packet = record("docs/m9/multidoc-packet.json");
    let (full, none, sempic) = (
        mode(&stage2, "full recompute"),
        mode(&stage2, "no recompute"),
        mode(&stage2, "SemPIC"),
    );
    let gap = &sempic["f1_gap_recovered"];
    let row = benchmarks_row(&text, "SemPIC recovers").join(" | ");
    for want in [
        format!(
            "{:.1} / {:.1} / {:.1} / {:.1}",
            value(&full["f1"]),
            value(&none["f1"]),
            value(&mode(&packet, "packet")["f1"]),
            value(&sempic["f1"])
        ),
        format!(
            "{:.0}% of the gap (paired interval [{:.0}, {:.0}])",
            value(gap) * 100.0,
            gap["low"].as_f64().unwrap() * 100.0,
            gap["high"].as_f64().unwrap() * 100.0
        ),
        format!(
            "{:.3} against packet's {:.3}",
            value(&sempic["kl"]),
            value(&mode(&packet, "packet")["kl"])
        ),
    ] {
        if !row.contains(&want) {
            wrong.push(format!("SemPIC row: wants {want:?}"));
        }
    }
    let needle = record("docs/m9/needle.json");
    let names = [
        ("full", "full recompute"),
        ("none", "no recompute"),
        ("packet", "packet"),
        ("SemPIC", "SemPIC"),
        ("joint", "joint (SemPIC + packet)"),
    ];
    let replies: Vec<String> = names
        .iter()
        .map(|(label, m)| format!("{label} {:.0}%", value(&mode(&needle, m)["contains"])))
        .collect();
    let kls: Vec<String> = names[1..]
        .iter()
        .map(|(label, m)| format!("{label} {:.3}", value(&mode(&needle, m)["kl"])))
        .collect();
    let row = benchmarks_row(&text, "needle in a haystack").join(" | ");
    for want in [replies.join(", "), kls.join(", ")] {
        if !row.contains(&want) {
            wrong.push(format!("needle row: wants {want:?}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "BENCHMARKS.md disagrees with the records it names:\n{}",
        wrong.join("\n")
    );
}
