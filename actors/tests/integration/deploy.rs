//! What the deployment kit (ops/k8s, ops/compose, ops/grafana; docs/deploy.md) relies on from a
//! running node: the probes on the metrics listener (`/livez`, and `/readyz` ready only while
//! the node's registration with its models is in the store), and every series the Grafana
//! dashboard queries present in real nodes' scrapes after a job, with the labels it groups and
//! filters by; and etcd as the shipped configs run it, over TLS with client certificates. The
//! manifests themselves are checked by `make test-deploy` (ops/validate-deploy.py).

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::{config_with, python, repo, Cluster};
use scd_scheduler::{Keys, Mode};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WITH_METRICS: &str = "metrics_listen = \"127.0.0.1:0\"\n";
/// The dashboard the kit ships (compose provisions it; ops/grafana's kustomization makes it a
/// ConfigMap).
const DASHBOARD: &str = "ops/grafana/dashboards/scd.json";
/// Labels Prometheus adds to every series of a target when it scrapes it, so that a node's
/// own samples never carry them (`pod`, `namespace`, `service`: the ServiceMonitor's
/// Kubernetes target labels).
const TARGET_LABELS: [&str; 5] = ["instance", "job", "pod", "namespace", "service"];

/// `GET path` over HTTP/1.1: the status and the body.
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    get_with(addr, path, "").await
}

/// `GET path` with `headers` (each line ending in CRLF).
async fn get_with(addr: SocketAddr, path: &str, headers: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}Connection: close\r\n\r\n");
    s.write_all(request.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    (status, body)
}

/// Polls `/readyz` until its status is `want`, for at most `bound`; the last answer.
async fn readyz_until(addr: SocketAddr, want: u16, bound: Duration) -> String {
    let start = Instant::now();
    loop {
        let (status, body) = get(addr, "/readyz").await;
        if status == want {
            return body;
        }
        assert!(
            start.elapsed() < bound,
            "/readyz still {status} ({body:?}) after {bound:?}; wanted {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_the_registration_and_livez_the_process() {
    let cluster = Cluster::new();
    let mail = repo().join("experts/mail/translator");
    let node = cluster
        .start(&config_with(
            "prefill-0",
            "\"producer\", \"scheduler\"",
            true,
            &mail,
            WITH_METRICS,
        ))
        .await;
    let addr = node.metrics_addr().expect("the metrics listener");

    // Registered with its models: ready, and it says what it serves.
    let body = readyz_until(addr, 200, Duration::from_secs(10)).await;
    assert!(body.contains("prefill-0: ready"), "{body}");
    let base = node_base(&cluster, "prefill-0").await;
    assert_eq!(base.len(), 1);
    assert!(body.contains(&format!("{base:?}")), "{body}");
    assert_eq!(get(addr, "/livez").await.0, 200);

    // The lease goes (as when etcd expires it): the node key goes with it, and the node is
    // not ready until its registration is back; alive all along.
    let key = Keys::default().node("prefill-0").unwrap();
    let lease = cluster.store.get(&key).await.unwrap().unwrap().lease;
    cluster.store.revoke_lease(lease).await.unwrap();
    let body = readyz_until(addr, 503, Duration::from_secs(5)).await;
    assert!(body.contains("not registered"), "{body}");
    assert_eq!(get(addr, "/livez").await.0, 200);
    // The registration's renewal notices the lost lease and registers again (within a third
    // of the 10 s TTL, plus its retry).
    let body = readyz_until(addr, 200, Duration::from_secs(15)).await;
    assert!(body.contains("ready"), "{body}");
    let again = cluster.store.get(&key).await.unwrap().unwrap().lease;
    assert_ne!(again, lease);

    // Still there as the store lists it serving nothing (a drain advertises that): not ready.
    let stop_serving = scd_scheduler::envelope::encode(&scd_scheduler::NodeInfo::new(
        scd_scheduler::NodeId::from_static("prefill-0"),
        "127.0.0.1:1",
        0,
    ))
    .unwrap();
    cluster
        .store
        .put(&key, stop_serving, Some(again))
        .await
        .unwrap();
    let body = readyz_until(addr, 503, Duration::from_secs(5)).await;
    assert!(body.contains("capacity 0"), "{body}");
    node.shutdown(Duration::ZERO).await;
}

/// etcd as every shipped config runs it: TLS only, each client with a certificate from etcd's
/// own CA (`--client-cert-auth`). A node's `[store] ca, cert, key` reach it; a client without
/// a certificate, with one from another CA, trusting another CA, or over plain HTTP does not.
#[tokio::test(flavor = "multi_thread")]
async fn etcd_over_tls_admits_only_clients_with_its_certificates() {
    use scd_actors::config::StoreConfig;
    use scd_scheduler::{EtcdServer, EtcdStore, MetaStore, ServingTls};
    use scd_transport::pki::{init_ca_dir, issue_in_dir, issue_in_dir_also_for};
    use scd_transport::Role;

    let dir = tempfile::tempdir().unwrap();
    let (pki, other) = (dir.path().join("etcd"), dir.path().join("other"));
    init_ca_dir(&pki, "etcd").unwrap();
    issue_in_dir_also_for(&pki, "etcd", Role::Node, &["127.0.0.1".into()]).unwrap();
    issue_in_dir(&pki, "node-a", Role::Node).unwrap();
    init_ca_dir(&other, "other").unwrap();
    issue_in_dir(&other, "node-a", Role::Node).unwrap();
    let etcd = EtcdServer::start_tls(ServingTls {
        ca: pki.join("ca.pem"),
        cert: pki.join("etcd.pem"),
        key: pki.join("etcd.key"),
    })
    .await
    .unwrap();
    let endpoint = etcd.endpoint();
    assert!(endpoint.starts_with("https://127.0.0.1:"), "{endpoint}");
    let section = |ca: &Path, client: Option<&Path>| StoreConfig::Etcd {
        endpoints: vec![endpoint.clone()],
        prefix: "/scd/v1".into(),
        ca: Some(ca.join("ca.pem")),
        cert: client.map(|d| d.join("node-a.pem")),
        key: client.map(|d| d.join("node-a.key")),
    };
    let open = |store: StoreConfig| {
        let endpoint = endpoint.clone();
        async move {
            let tls = store.etcd_tls().unwrap();
            assert!(tls.is_some());
            EtcdStore::connect_with(&[endpoint], tls.as_ref())
                .await
                .unwrap()
        }
    };

    let node = open(section(&pki, Some(&pki))).await;
    node.put("/scd/v1/tls-check", b"yes".to_vec(), None)
        .await
        .unwrap();
    let read = node.get("/scd/v1/tls-check").await.unwrap().unwrap();
    assert_eq!(read.value, b"yes");

    // Refused, with the hint that names the settings. A certificate this side does not
    // trust is named as the cause; one etcd refuses may show only as a closed connection
    // (under TLS 1.3 the client finishes its handshake before etcd's alert arrives).
    let refused = [
        ("no client certificate", section(&pki, None), None),
        (
            "a client certificate from another CA",
            section(&pki, Some(&other)),
            None,
        ),
        (
            "etcd's certificate not trusted",
            section(&other, Some(&pki)),
            Some("UnknownIssuer"),
        ),
    ];
    for (what, store, cause) in refused {
        let client = open(store).await;
        let err = client
            .put("/scd/v1/tls-check", b"no".to_vec(), None)
            .await
            .expect_err(what);
        let said = causes(&err);
        assert!(cause.is_none_or(|c| said.contains(c)), "{what}: {said}");
        assert!(said.contains("[store] ca, cert, key"), "{what}: {said}");
    }
    let plain = EtcdStore::connect(&[endpoint.replace("https://", "http://")])
        .await
        .unwrap();
    assert!(plain.get("/scd/v1/tls-check").await.is_err());
    // Nothing the refused clients tried landed.
    let read = node.get("/scd/v1/tls-check").await.unwrap().unwrap();
    assert_eq!(read.value, b"yes");
}

/// An error and its causes, one line.
fn causes(e: &dyn std::error::Error) -> String {
    let mut line = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        line += &format!(": {c}");
        cause = c.source();
    }
    line
}

/// `[node] metrics_token`: `/metrics` answers only a scrape with the token; the probes stay
/// open (the kubelet sends none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metrics_token_guards_the_scrape_and_not_the_probes() {
    const TOKEN: &str = "5f1c0e9a2b7d4c3e8a6f1b0d";
    let cluster = Cluster::new();
    let mail = repo().join("experts/mail/translator");
    let node = cluster
        .start(&config_with(
            "prefill-0",
            "\"producer\", \"scheduler\"",
            true,
            &mail,
            &format!("{WITH_METRICS}metrics_token = \"{TOKEN}\"\n"),
        ))
        .await;
    let addr = node.metrics_addr().expect("the metrics listener");
    let (status, body) = get(addr, "/metrics").await;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("metrics_token"), "{body}");
    let wrong = get_with(
        addr,
        "/metrics",
        "Authorization: Bearer 5f1c0e9a2b7d4c3e8a6f1b0e\r\n",
    );
    assert_eq!(wrong.await.0, 401);
    let right = format!("Authorization: Bearer {TOKEN}\r\n");
    let (status, body) = get_with(addr, "/metrics", &right).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("scd_"), "{body}");
    assert!(body.trim_end().ends_with("# EOF"), "{body}");
    assert_eq!(get(addr, "/livez").await.0, 200);
    readyz_until(addr, 200, Duration::from_secs(10)).await;
    node.shutdown(Duration::ZERO).await;
}

/// The base model id the store lists `node` as producer of.
async fn node_base(cluster: &Cluster, node: &str) -> Vec<String> {
    let key = Keys::default().node(node).unwrap();
    let kv = cluster.store.get(&key).await.unwrap().unwrap();
    let info: scd_scheduler::NodeInfo = scd_scheduler::envelope::decode(&key, &kv.value).unwrap();
    info.producer_models
}

/// A series the dashboard reads: the metric name, and the labels its matchers name.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Selector {
    metric: String,
    matchers: Vec<String>,
}

/// What one PromQL expression reads: its selectors, and the labels it groups or matches on
/// (`by`, `without`, `on`, `ignoring`, `group_left`, `group_right`).
#[derive(Debug, Default, PartialEq, Eq)]
struct Reads {
    selectors: Vec<Selector>,
    grouping: Vec<String>,
}

const GROUPING: [&str; 6] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];
const KEYWORDS: [&str; 8] = [
    "and", "or", "unless", "bool", "offset", "inf", "nan", "atan2",
];
/// Aggregation operators: followed by `by (...)` / `without (...)` before their `(`.
const AGGREGATIONS: [&str; 14] = [
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];

fn ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// The label names in a `{...}` matcher list (`chars` just past the `{`), up to its `}`.
fn matcher_labels(chars: &[char], mut i: usize) -> (Vec<String>, usize) {
    let mut labels = Vec::new();
    let mut expect_label = true;
    while i < chars.len() && chars[i] != '}' {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = skip_string(chars, i);
            continue;
        }
        if expect_label && ident_start(c) {
            let start = i;
            while i < chars.len() && ident_char(chars[i]) {
                i += 1;
            }
            labels.push(chars[start..i].iter().collect());
            expect_label = false;
            continue;
        }
        if c == ',' {
            expect_label = true;
        }
        i += 1;
    }
    (labels, i + 1)
}

/// The index just past the string literal starting at `i`.
fn skip_string(chars: &[char], i: usize) -> usize {
    let quote = chars[i];
    let mut j = i + 1;
    while j < chars.len() && chars[j] != quote {
        if chars[j] == '\\' && quote != '`' {
            j += 1;
        }
        j += 1;
    }
    j + 1
}

/// Reads a PromQL expression: enough of the grammar to find every metric name, the labels of
/// its matchers and the grouping labels (ranges, strings, numbers, durations and Grafana's
/// `$variables` are skipped; an identifier followed by `(` is a function).
fn promql_reads(expr: &str) -> Reads {
    let chars: Vec<char> = expr.chars().collect();
    let mut reads = Reads::default();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = skip_string(&chars, i);
        } else if c == '[' {
            while i < chars.len() && chars[i] != ']' {
                i += 1;
            }
            i += 1;
        } else if c == '$' {
            i += 1;
            while i < chars.len() && (ident_char(chars[i]) || "{}".contains(chars[i])) {
                i += 1;
            }
        } else if c.is_ascii_digit()
            || (c == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if c == '{' {
            // A selector without a metric name (`{__name__="..."}`): recorded nameless so the
            // check reports it.
            let (labels, next) = matcher_labels(&chars, i + 1);
            reads.selectors.push(Selector {
                metric: String::new(),
                matchers: labels,
            });
            i = next;
        } else if ident_start(c) {
            let start = i;
            while i < chars.len() && ident_char(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut j = i;
            while j < chars.len() && chars[j].is_whitespace() {
                j += 1;
            }
            let next = chars.get(j).copied();
            if GROUPING.contains(&word.as_str()) {
                if next == Some('(') {
                    let (labels, end) = paren_labels(&chars, j + 1);
                    reads.grouping.extend(labels);
                    i = end;
                }
            } else if next == Some('(')
                || KEYWORDS.contains(&word.as_str())
                || AGGREGATIONS.contains(&word.as_str())
            {
                // A function (its arguments follow) or an operator keyword.
            } else if next == Some('{') {
                let (labels, end) = matcher_labels(&chars, j + 1);
                reads.selectors.push(Selector {
                    metric: word,
                    matchers: labels,
                });
                i = end;
            } else {
                reads.selectors.push(Selector {
                    metric: word,
                    matchers: Vec::new(),
                });
            }
        } else {
            i += 1;
        }
    }
    reads
}

/// The label names in a `(a, b)` list (`i` just past the `(`), and the index past its `)`.
fn paren_labels(chars: &[char], mut i: usize) -> (Vec<String>, usize) {
    let mut labels = Vec::new();
    while i < chars.len() && chars[i] != ')' {
        if ident_start(chars[i]) {
            let start = i;
            while i < chars.len() && ident_char(chars[i]) {
                i += 1;
            }
            labels.push(chars[start..i].iter().collect());
        } else {
            i += 1;
        }
    }
    (labels, i + 1)
}

/// Every PromQL expression of a Grafana dashboard: each panel's targets (rows' nested panels
/// too) and each query variable, with where it is.
fn dashboard_exprs(dashboard: &Value) -> Vec<(String, String)> {
    fn panels(list: &Value, out: &mut Vec<(String, String)>) {
        for panel in list.as_array().into_iter().flatten() {
            let title = panel["title"].as_str().unwrap_or("?");
            for target in panel["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = target["expr"].as_str() {
                    out.push((format!("panel {title:?}"), expr.to_owned()));
                }
            }
            panels(&panel["panels"], out);
        }
    }
    let mut out = Vec::new();
    panels(&dashboard["panels"], &mut out);
    for var in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if var["type"] != "query" {
            continue;
        }
        let query = var["query"]["query"]
            .as_str()
            .or_else(|| var["query"].as_str())
            .unwrap_or("");
        // label_values(metric, label) / label_values(metric{...}, label)
        if let Some(args) = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
        {
            if let Some((metric, label)) = args.rsplit_once(',') {
                let name = var["name"].as_str().unwrap_or("?");
                out.push((
                    format!("variable {name:?}"),
                    format!("sum by ({}) ({})", label.trim(), metric.trim()),
                ));
            }
        }
    }
    out
}

/// Samples (name, labels, value) as ops/metrics-scrape.py prints them.
type Samples = Vec<(String, Value, f64)>;

/// The family a sample name belongs to, for the message: histograms' `_bucket`, `_sum`,
/// `_count`, counters' `_total`.
fn family(name: &str) -> &str {
    ["_bucket", "_sum", "_count", "_total", "_created"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name)
}

/// What is wrong with the dashboard against `samples` (empty: nothing), and the metric names
/// it reads.
fn check_dashboard(dashboard: &Value, samples: &Samples) -> (Vec<String>, BTreeSet<String>) {
    let mut labels: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (name, l, _) in samples {
        let set = labels.entry(name.as_str()).or_default();
        if let Some(l) = l.as_object() {
            set.extend(l.keys().map(String::as_str));
        }
    }
    let mut problems = Vec::new();
    let mut read = BTreeSet::new();
    let exprs = dashboard_exprs(dashboard);
    if exprs.is_empty() {
        problems.push("the dashboard has no PromQL expressions".to_owned());
    }
    for (place, expr) in exprs {
        let reads = promql_reads(&expr);
        if reads.selectors.is_empty() {
            problems.push(format!("{place}: {expr:?} reads no metric"));
        }
        let mut available: BTreeSet<&str> = TARGET_LABELS.into_iter().collect();
        for s in &reads.selectors {
            read.insert(s.metric.clone());
            let Some(have) = labels.get(s.metric.as_str()) else {
                let fam = family(&s.metric);
                let served: Vec<&str> = labels
                    .keys()
                    .copied()
                    .filter(|n| family(n) == fam)
                    .collect();
                problems.push(format!(
                    "{place}: {:?} is not in the scrape (family {fam}: {})",
                    s.metric,
                    if served.is_empty() {
                        "none".to_owned()
                    } else {
                        served.join(", ")
                    }
                ));
                continue;
            };
            available.extend(have.iter().copied());
            for m in &s.matchers {
                if !have.contains(m.as_str()) && !TARGET_LABELS.contains(&m.as_str()) {
                    problems.push(format!(
                        "{place}: {} has no label {m:?} (it has {have:?})",
                        s.metric
                    ));
                }
            }
        }
        for g in &reads.grouping {
            if !available.contains(g.as_str()) {
                problems.push(format!(
                    "{place}: groups by {g:?}, a label none of its series has"
                ));
            }
        }
    }
    (problems, read)
}

fn load_dashboard() -> Value {
    let path = repo().join(DASHBOARD);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A node's metrics as the official Prometheus client parses them.
fn scrape(python: &Path, addr: SocketAddr) -> Samples {
    let out = Command::new(python)
        .arg(repo().join("ops/metrics-scrape.py"))
        .arg(format!("http://{addr}/metrics"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_promql_reader_finds_metrics_matchers_and_grouping() {
    let r = promql_reads(
        "histogram_quantile(0.95, sum by (le, mode) (rate(scd_ttft_seconds_bucket{expert=~\"$expert\", mode!=\"a,b\"}[$__rate_interval])))",
    );
    assert_eq!(
        r.selectors,
        [Selector {
            metric: "scd_ttft_seconds_bucket".into(),
            matchers: vec!["expert".into(), "mode".into()],
        }]
    );
    assert_eq!(r.grouping, ["le", "mode"]);
    let r = promql_reads(
        "sum(rate(scd_prefix_cache_lookups_total{result=\"hit\"}[5m])) / sum(rate(scd_prefix_cache_lookups_total[5m])) > bool 0.5 offset 1h",
    );
    let names: Vec<&str> = r.selectors.iter().map(|s| s.metric.as_str()).collect();
    assert_eq!(
        names,
        [
            "scd_prefix_cache_lookups_total",
            "scd_prefix_cache_lookups_total"
        ]
    );
    let r = promql_reads(
        "max(scd_shadow_kl) without (version) * on (expert) group_left scd_translator",
    );
    assert_eq!(r.grouping, ["version", "expert"]);
    assert_eq!(r.selectors.len(), 2);
}

#[test]
fn the_dashboard_check_fails_on_a_wrong_name_or_label() {
    let samples: Samples = vec![
        (
            "scd_ttft_seconds_bucket".into(),
            serde_json::json!({"mode": "scd", "expert": "mail", "le": "0.1"}),
            1.0,
        ),
        (
            "scd_queue_depth".into(),
            serde_json::json!({"queue": "producer"}),
            0.0,
        ),
    ];
    let dashboard =
        |expr: &str| serde_json::json!({"panels": [{"title": "t", "targets": [{"expr": expr}]}]});
    let ok = "histogram_quantile(0.5, sum by (le, mode) (rate(scd_ttft_seconds_bucket[5m]))) + on (instance) max by (instance, queue) (scd_queue_depth)";
    let (problems, read) = check_dashboard(&dashboard(ok), &samples);
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(read.len(), 2);
    // A histogram read as a counter; a label the family lacks; a grouping label nothing has.
    for (bad, says) in [
        (
            "rate(scd_ttft_seconds_total[5m])",
            "family scd_ttft_seconds: scd_ttft_seconds_bucket",
        ),
        ("scd_queue_depth{side=\"producer\"}", "no label \"side\""),
        ("sum by (model) (scd_queue_depth)", "groups by \"model\""),
        ("scd_queue_depths", "not in the scrape"),
    ] {
        let (problems, _) = check_dashboard(&dashboard(bad), &samples);
        assert!(
            problems.len() == 1 && problems[0].contains(says),
            "{bad}: {problems:?}"
        );
    }
    let (problems, _) = check_dashboard(&serde_json::json!({"panels": []}), &samples);
    assert_eq!(problems.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_series_the_dashboard_queries_is_in_live_scrapes() {
    let python = python();
    let dashboard = load_dashboard();
    let cluster = Cluster::new();
    let mail = repo().join("experts/mail/translator");
    let producer = cluster
        .start(&config_with(
            "prefill-0",
            "\"producer\", \"scheduler\"",
            true,
            &mail,
            WITH_METRICS,
        ))
        .await;
    // Every translated job shadow-checked, so the drift guard's series exist after one.
    let consumer = cluster
        .start(&config_with(
            "mail-0",
            "\"consumer\"",
            true,
            &mail,
            &format!("{WITH_METRICS}\n[drift]\nshadow_share = 1\n"),
        ))
        .await;
    let m = common::models();
    let prompt = common::prompt(m);
    let job = cluster
        .run("mail", Mode::Scd, common::request(&prompt, 4))
        .await;
    assert_eq!(job.state, scd_scheduler::JobState::Done, "{:?}", job.error);
    // The shadow check runs after the job answered; the producer's counts land just after
    // the consumer finished the record.
    let start = Instant::now();
    while !(consumer.metrics_text().contains("scd_shadow_kl{")
        && producer
            .metrics_text()
            .contains("scd_prefix_cache_lookups_total{"))
    {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no shadow check or producer count after 120 s:\n{}\n{}",
            consumer.metrics_text(),
            producer.metrics_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let (pa, ca) = (
        producer.metrics_addr().unwrap(),
        consumer.metrics_addr().unwrap(),
    );
    let samples = tokio::task::spawn_blocking(move || {
        let mut s = scrape(&python, pa);
        s.extend(scrape(&python, ca));
        s
    })
    .await
    .unwrap();
    let (problems, read) = check_dashboard(&dashboard, &samples);
    assert!(
        problems.is_empty(),
        "the dashboard reads what the nodes do not serve:\n{}",
        problems.join("\n")
    );
    // What the issue asks the dashboard to show: TTFT per mode, wire bytes, queue depths, the
    // prefix cache's hit rate, shadow KL per translator version, job outcomes.
    for wanted in [
        "scd_ttft_seconds_bucket",
        "scd_code_bytes_sent_total",
        "scd_code_bytes_received_total",
        "scd_queue_depth",
        "scd_prefix_cache_lookups_total",
        "scd_shadow_kl",
        "scd_jobs_total",
    ] {
        assert!(
            read.contains(wanted),
            "the dashboard does not read {wanted}: {read:?}"
        );
    }
    eprintln!(
        "the dashboard reads {} series, all served: {read:?}",
        read.len()
    );
    consumer.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
}

/// A node config template of cluster-config/k8s filled in as ops/k8s's init container does
/// (lists: comma-separated in, TOML strings out).
fn fill_template(name: &str, vars: &[(&str, &str)]) -> String {
    let path = repo().join("cluster-config/k8s").join(name);
    let mut text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let list = |v: &str| {
        v.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| format!("\"{s}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (key, value) in vars {
        let value = match *key {
            "ETCD_ENDPOINTS" | "API_KEYS" => list(value),
            _ => (*value).to_owned(),
        };
        text = text.replace(&format!("@{key}@"), &value);
    }
    assert!(
        !text.lines().any(|l| !l.starts_with('#') && l.contains('@')),
        "{name}: a placeholder is left:\n{text}"
    );
    text
}

#[test]
fn the_k8s_node_config_templates_are_valid_configs_once_filled_in() {
    use scd_actors::config::{NodeRole, StoreConfig};
    use scd_actors::NodeConfig;
    let etcd = "etcd-0.etcd:2379,etcd-1.etcd:2379,etcd-2.etcd:2379";
    let parse = |name: &str, vars: &[(&str, &str)]| {
        NodeConfig::parse(&fill_template(name, vars), Path::new("/"))
            .unwrap_or_else(|e| panic!("{name} {vars:?}: {e}"))
    };
    let ports = |c: &NodeConfig| {
        (
            c.node.listen.port(),
            c.node.metrics_listen.map(|a| a.port()),
            c.node.http_listen.map(|a| a.port()),
        )
    };
    let endpoints = |c: &NodeConfig| match &c.store {
        StoreConfig::Etcd { endpoints, .. } => endpoints.clone(),
        other => panic!("{other:?}"),
    };
    let members: Vec<String> = etcd.split(',').map(String::from).collect();

    let p = parse(
        "producer.toml",
        &[
            ("NODE_ID", "producer-0"),
            ("ADVERTISE", "producer-0.producer.scd.svc:7101"),
            ("ETCD_ENDPOINTS", etcd),
        ],
    );
    assert_eq!(p.node.id, "producer-0");
    assert_eq!(
        p.node.advertise.as_deref(),
        Some("producer-0.producer.scd.svc:7101")
    );
    for role in [NodeRole::Producer, NodeRole::Scheduler, NodeRole::Admin] {
        assert!(p.has_role(role), "{role}");
    }
    assert!(!p.has_role(NodeRole::Gateway));
    // The ports the manifests name: QUIC 7101 (UDP), the probes and /metrics on 9100.
    assert_eq!(ports(&p), (7101, Some(9100), None));
    assert_eq!(endpoints(&p), members);
    assert!(p.tls.cert.ends_with("producer-0.pem"));
    // Traces go where $OTEL_EXPORTER_OTLP_ENDPOINT says (the ConfigMap scd-otel).
    assert_eq!(p.tracing.otlp_endpoint, None);

    // The HTTP API on pods of its own: the gateway role alone, the base model for
    // its tokenizer, no experts; the HTTP API on 8080. A Deployment's pods share the
    // certificate issued to `gateway`, each registered under its pod's name.
    let gateway = |keys: &str| {
        parse(
            "gateway.toml",
            &[
                ("NODE_ID", "gateway-7c9d8f6b5-x2x9z"),
                ("ADVERTISE", "10.1.2.3:7101"),
                ("ETCD_ENDPOINTS", etcd),
                ("API_KEYS", keys),
            ],
        )
    };
    let g = gateway("key-1, key-2");
    assert_eq!(g.node.id, "gateway-7c9d8f6b5-x2x9z");
    assert_eq!(
        g.node.roles.iter().copied().collect::<Vec<_>>(),
        [NodeRole::Gateway]
    );
    assert_eq!(ports(&g), (7101, Some(9100), Some(8080)));
    assert_eq!(g.models.base, p.models.base);
    assert!(g.experts.is_empty());
    assert_eq!(g.gateway.api_keys, ["key-1", "key-2"]);
    assert!(gateway("").gateway.api_keys.is_empty());
    assert_eq!(endpoints(&g), members);
    assert!(g.tls.cert.ends_with("gateway.pem"));
    assert_eq!(g.tls.name.as_deref(), Some("gateway"));
    assert_eq!(g.tracing.otlp_endpoint, None);

    for expert in ["mail", "sotu"] {
        let id = format!("consumer-{expert}-1");
        let c = parse(
            "consumer.toml",
            &[
                ("NODE_ID", &id),
                ("ADVERTISE", "x.consumer.scd.svc:7101"),
                ("EXPERT", expert),
                ("ETCD_ENDPOINTS", etcd),
            ],
        );
        assert_eq!(c.node.id, id);
        assert!(c.has_role(NodeRole::Consumer));
        assert_eq!(c.experts.len(), 1);
        assert_eq!(c.experts[0].name, expert);
        assert_eq!(ports(&c), (7101, Some(9100), None));
        // What the pods mount at /scd/experts ships in the repository.
        assert!(repo()
            .join("experts")
            .join(expert)
            .join("adapter.safetensors")
            .is_file());
        assert!(repo()
            .join("experts")
            .join(expert)
            .join("translator")
            .is_dir());
    }

    // A bad value is refused, so the checks above can fail.
    let bad = fill_template(
        "producer.toml",
        &[
            ("NODE_ID", "Producer_0"),
            ("ADVERTISE", "producer-0:7101"),
            ("ETCD_ENDPOINTS", etcd),
        ],
    );
    assert!(NodeConfig::parse(&bad, Path::new("/")).is_err());
}
