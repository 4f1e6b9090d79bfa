//! End-to-end: three `scd node` processes (a producer that is also a scheduler replica, a
//! consumer of the mail expert, a consumer of the sotu expert that is a second scheduler
//! replica) on a real etcd reached over TLS with client certificates from its own CA, as the
//! shipped configs run it, with certificates from `scd cert`. Jobs submitted as records in etcd
//! run across the processes in every mode, and each result is what `scd generate --transfer`
//! produces in one process for the same prompt; a bad job fails with its reason; SIGTERM drains a
//! node, which leaves the cluster at once (its lease revoked, not left to expire).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use scd_actors::ClusterClient;
use scd_models::tokenizer::Tokenizer;
use scd_models::GgufFile;
use scd_scheduler::{EtcdServer, JobId, JobRequest, JobState, Keys, MetaStore, Mode, ServingTls};
use scd_transport::pki::{init_ca_dir, issue_in_dir, issue_in_dir_also_for};
use scd_transport::Role;

const PROMPT: &str =
    "From: dana@lists.example.org\nSubject: Re: sorting folders by date\n\nNot directly, but";
const MAX_TOKENS: u32 = 8;
/// Starting a node loads the model (seconds in a test build); generous for a loaded machine.
const START_WITHIN: Duration = Duration::from_secs(240);
const JOB_WITHIN: Duration = Duration::from_secs(240);

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

/// A node process, killed if the test ends without stopping it; its output goes to files in
/// the test's folder, shown when something fails.
struct NodeProc {
    id: String,
    child: Child,
    log: PathBuf,
}

impl NodeProc {
    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Panics with the node's log if it has exited.
    fn check_alive(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("node {} exited ({status}):\n{}", self.id, self.log());
        }
    }
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn write_config(
    dir: &Path,
    id: &str,
    roles: &str,
    experts: &[(&str, bool)],
    etcd: &str,
    prefix: &str,
) -> PathBuf {
    // Each node's etcd client certificate, from etcd's CA (see `etcd_over_tls`).
    let etcd_pki = dir.join("etcd");
    issue_in_dir(&etcd_pki, id, Role::Node).unwrap();
    let mut text = format!(
        "[node]\nid = \"{id}\"\nlisten = \"127.0.0.1:0\"\nroles = [{roles}]\n\n\
         [models]\nbase = \"{}\"\ntranslator_roots = [\"{}\", \"{}\"]\n\n",
        model_path().display(),
        repo().join("experts").display(),
        dir.join("translators").display(),
    );
    for (name, adapter) in experts {
        let e = repo().join("experts").join(name);
        text.push_str(&format!("[[experts]]\nname = \"{name}\"\n"));
        if *adapter {
            text.push_str(&format!("adapter = \"{}\"\n", e.display()));
        }
        text.push_str(&format!(
            "translator = \"{}\"\n\n",
            e.join("translator").display()
        ));
    }
    text.push_str(&format!(
        "[store]\nkind = \"etcd\"\nendpoints = [\"{etcd}\"]\nprefix = \"{prefix}\"\n\
         ca = \"etcd/ca.pem\"\ncert = \"etcd/{id}.pem\"\nkey = \"etcd/{id}.key\"\n\n\
         [tls]\nca = \"ca.pem\"\ncert = \"{id}.pem\"\nkey = \"{id}.key\"\n\n\
         [codec]\n# The translator's own ranks: results compare with `scd generate`.\n\
         ranks = \"default\"\n"
    ));
    if roles.contains("producer") {
        // Documents compiled by the base itself (no writer to load): what the CLI test needs.
        text.push_str(&format!(
            "\n[documents]\ndir = \"{}\"\n",
            dir.join(format!("documents-{id}")).display()
        ));
    }
    let path = dir.join(format!("{id}.toml"));
    fs::write(&path, text).unwrap();
    path
}

/// Starts `scd node` with `config`; `failpoints` is its `SCD_FAILPOINTS` (empty: none).
fn spawn_node(dir: &Path, id: &str, config: &Path, failpoints: &str) -> NodeProc {
    let log = dir.join(format!("{id}.log"));
    let out = fs::File::create(&log).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_scd"))
        .args(["node", "--drain-timeout", "60", "--config"])
        .arg(config)
        .env("SCD_LOG", "info")
        .env(scd_actors::node::failpoints::ENV, failpoints)
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    NodeProc {
        id: id.to_owned(),
        child,
        log,
    }
}

/// `NAME@HOST:PORT` of a node, from the line it prints when it is up.
fn admin_address(node: &NodeProc) -> String {
    let log = node.log();
    let line = log
        .lines()
        .find(|l| l.contains("admin clients: --node "))
        .unwrap_or_else(|| panic!("no address line in:\n{log}"));
    let start = line.find("--node ").unwrap() + "--node ".len();
    let rest = &line[start..];
    rest[..rest.find(')').unwrap()].to_owned()
}

/// A node's id, roles and experts (name, whether it loads the adapter).
type NodeSpec<'a> = (&'a str, &'a str, Vec<(&'a str, bool)>);

/// An etcd as the shipped configs run it: clients over TLS only, each with a certificate from
/// etcd's own CA, made in `dir/etcd` (the nodes' client certificates are issued there by
/// [`write_config`]).
async fn etcd_over_tls(dir: &Path) -> EtcdServer {
    let pki = dir.join("etcd");
    init_ca_dir(&pki, "test-etcd").unwrap();
    issue_in_dir_also_for(&pki, "etcd", Role::Node, &["127.0.0.1".into()]).unwrap();
    EtcdServer::start_tls(ServingTls {
        ca: pki.join("ca.pem"),
        cert: pki.join("etcd.pem"),
        key: pki.join("etcd.key"),
    })
    .await
    .expect("etcd is needed: `make setup` installs it")
}

/// Starts a node process per spec on `etcd` and waits until all have registered; returns them
/// with a client of the cluster. The nodes named in `holding` hold every job they decode
/// instead of reporting it (the `hold-before-report` failpoint).
async fn start_cluster(
    pki: &Path,
    etcd: &EtcdServer,
    prefix: &str,
    specs: &[NodeSpec<'_>],
    holding: &[&str],
) -> (Vec<NodeProc>, ClusterClient) {
    let endpoint = etcd.endpoint();
    let mut nodes: Vec<NodeProc> = specs
        .iter()
        .map(|(id, roles, experts)| {
            let cfg = write_config(pki, id, roles, experts, &endpoint, prefix);
            let failpoints = if holding.contains(id) {
                "hold-before-report"
            } else {
                ""
            };
            spawn_node(pki, id, &cfg, failpoints)
        })
        .collect();
    let store: Arc<dyn MetaStore> = Arc::new(etcd.store().await.unwrap());
    let client = ClusterClient::new(store, Keys::new(prefix));
    let started = Instant::now();
    loop {
        for n in &mut nodes {
            n.check_alive();
        }
        let live = client.nodes().await.unwrap();
        if live.len() == specs.len() {
            return (nodes, client);
        }
        assert!(
            started.elapsed() < START_WITHIN,
            "only {:?} registered after {START_WITHIN:?}",
            live.keys()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What `scd generate --transfer MODE` gives in one process for the same prompt.
fn in_process(expert: &str, mode: Mode) -> String {
    in_process_for(expert, mode, PROMPT)
}

/// [`in_process`] for another prompt.
fn in_process_for(expert: &str, mode: Mode, prompt: &str) -> String {
    let e = repo().join("experts").join(expert);
    let out = Command::new(env!("CARGO_BIN_EXE_scd"))
        .args(["generate", "--model"])
        .arg(model_path())
        .arg("--adapter")
        .arg(e.join("adapter.safetensors"))
        .args(["--prompt", prompt, "--raw", "--max-tokens"])
        .arg(MAX_TOKENS.to_string())
        .args(["--transfer", &mode.to_string(), "--code-dtype", "f16"])
        .arg("--translator")
        .arg(e.join("translator"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_node_processes_on_etcd_run_jobs_like_one_process_and_drain_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path();
    let etcd = etcd_over_tls(pki).await;
    init_ca_dir(pki, "test").unwrap();
    for id in ["producer", "consumer-a", "consumer-b"] {
        issue_in_dir(pki, id, Role::Node).unwrap();
    }
    issue_in_dir(pki, "ops", Role::Admin).unwrap();
    let prefix = "/scd-e2e";
    let configs = [
        (
            "producer",
            "\"producer\", \"scheduler\", \"admin\"",
            vec![("mail", false), ("sotu", false)],
        ),
        ("consumer-a", "\"consumer\"", vec![("mail", true)]),
        (
            "consumer-b",
            "\"consumer\", \"scheduler\"",
            vec![("sotu", true)],
        ),
    ];
    let (mut nodes, client) = start_cluster(pki, &etcd, prefix, &configs, &[]).await;

    let file = GgufFile::open(model_path()).unwrap();
    let tok = Tokenizer::from_gguf(file.content()).unwrap();
    let prompt = tok.encode(PROMPT, false).unwrap();
    let request = |prompt: Vec<u32>| JobRequest {
        prompt,
        max_tokens: MAX_TOKENS,
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
        stop_tokens: tok.stop_ids().to_vec(),
        documents: Vec::new(),
    };

    let mut want_mail_scd = String::new();
    for (expert, consumer, mode) in [
        ("mail", "consumer-a", Mode::Scd),
        ("mail", "consumer-a", Mode::Raw),
        ("mail", "consumer-a", Mode::Q4),
        ("mail", "consumer-a", Mode::DroidSpeak),
        ("mail", "consumer-a", Mode::Reuse),
        ("mail", "consumer-a", Mode::Oracle),
        ("sotu", "consumer-b", Mode::Scd),
    ] {
        let id = client
            .submit(expert, mode, request(prompt.clone()))
            .await
            .unwrap();
        let job = match client.wait(id, JOB_WITHIN).await {
            Ok(job) => job,
            Err(e) => {
                let logs: Vec<String> = nodes.iter().map(NodeProc::log).collect();
                panic!("{expert} {mode}: {e}\n{}", logs.join("\n----\n"));
            }
        };
        assert_eq!(
            job.state,
            JobState::Done,
            "{expert} {mode}: {:?}",
            job.error
        );
        assert_eq!(job.producer.as_deref(), Some("producer"));
        assert_eq!(job.consumer.as_deref(), Some(consumer));
        let tokens = job.output.expect("output").tokens;
        let text = tok.decode(&tokens, true).unwrap();
        let want = in_process(expert, mode);
        assert_eq!(text.trim_end(), want.trim_end(), "{expert} {mode}");
        if (expert, mode) == ("mail", Mode::Scd) {
            want_mail_scd = want;
        }
        eprintln!("{expert} {mode}: {text:?}; timings {:?}", job.timings_ms);
    }

    // A token the base model does not have: the producer refuses the job, the record says why.
    let mut bad = prompt.clone();
    bad[1] = u32::MAX;
    let id = client
        .submit("mail", Mode::Raw, request(bad))
        .await
        .unwrap();
    let job = client.wait(id, JOB_WITHIN).await.unwrap();
    assert_eq!(job.state, JobState::Failed);
    let reason = job.error.unwrap_or_default();
    assert!(
        reason.contains("producer") && reason.contains("vocabulary"),
        "{reason}"
    );

    // The admin endpoint: `scd submit` with an admin certificate streams the same reply.
    let admin = admin_address(&nodes[0]);
    let submit = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_scd"))
            .args(["submit", "--node", &admin, "--name", "ops", "--pki-dir"])
            .arg(pki)
            .args(["--raw", "--prompt", PROMPT, "--max-tokens"])
            .arg(MAX_TOKENS.to_string())
            .args(extra)
            .output()
            .unwrap()
    };
    let out = submit(&["--expert", "mail", "--mode", "scd"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.trim_end(), want_mail_scd.trim_end(), "{stderr}");
    assert!(
        stderr.contains("[done: ") && stderr.contains("producer -> consumer-a"),
        "{stderr}"
    );

    // Documents through the CLI: recorded from a file, named by a job, compiled by the
    // producer the first time and served from its store the second.
    let doc_file = pki.join("notice.txt");
    fs::write(
        &doc_file,
        "The mail server is down on Friday from six to eight; call extension 4417 if urgent.",
    )
    .unwrap();
    let docs = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_scd"))
            .args(["docs"])
            .args(args)
            .args(["--node", &admin, "--name", "ops", "--pki-dir"])
            .arg(pki)
            .output()
            .unwrap()
    };
    let out = docs(&["add", doc_file.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let doc_id = stdout.split_whitespace().next().unwrap().to_owned();
    assert_eq!(doc_id.len(), 32, "{stdout}");
    for compiled in [1, 0] {
        let out = submit(&["--expert", "mail", "--document", &doc_id]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert!(
            !String::from_utf8_lossy(&out.stdout).trim().is_empty(),
            "{stderr}"
        );
        let id: JobId = stderr
            .lines()
            .find_map(|l| l.strip_prefix("job "))
            .expect("the job id on stderr")
            .trim()
            .parse()
            .unwrap();
        let served = client
            .get(id)
            .await
            .unwrap()
            .documents
            .expect("documents served");
        assert_eq!(
            (served.compiled.len(), served.hits as usize),
            (compiled, 1 - compiled),
            "{served:?}"
        );
    }
    // A file too long for one request, after one that fits: refused before anything is sent
    // (exit 2, saying what to do), so the one that fits is not added either.
    let (other, long) = (pki.join("other.txt"), pki.join("long.txt"));
    fs::write(&other, "The canteen opens at nine.").unwrap();
    fs::write(&long, "All work and no play. ".repeat(4000)).unwrap();
    let out = docs(&["add", other.to_str().unwrap(), long.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("split it"));
    let out = docs(&["list", "--json"]);
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list.as_array().map(Vec::len), Some(1), "{list}");
    assert_eq!(list[0]["id"], doc_id.as_str());
    assert_eq!(list[0]["held_by"][0], "producer", "{list}");
    // A mode other than oracle with documents: refused (exit 5), saying why.
    let out = submit(&["--expert", "mail", "--document", &doc_id, "--mode", "raw"]);
    assert_eq!(out.status.code(), Some(5));
    assert!(String::from_utf8_lossy(&out.stderr).contains("mode oracle"));
    // The same job, followed again by its id: the same text, as JSON.
    let job = stderr
        .lines()
        .find_map(|l| l.strip_prefix("job "))
        .expect("the job id on stderr")
        .trim()
        .to_owned();
    let out = Command::new(env!("CARGO_BIN_EXE_scd"))
        .args([
            "jobs",
            "watch",
            "--json",
            "--node",
            &admin,
            "--name",
            "ops",
            "--pki-dir",
        ])
        .arg(pki)
        .arg(&job)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["state"], "done");
    // The trace id printed at submission is the job's trace.
    let trace = stderr
        .lines()
        .find_map(|l| l.strip_prefix("trace "))
        .expect("the trace id on stderr")
        .trim();
    assert!(
        summary["traceparent"]
            .as_str()
            .is_some_and(|p| p.contains(trace)),
        "{summary}"
    );
    assert_eq!(summary["job"], job.as_str());
    assert_eq!(
        summary["text"].as_str().unwrap().trim_end(),
        want_mail_scd.trim_end()
    );
    // A fan-out to mail and sotu: no node hosts both here, so it is refused before anything
    // is created, with the reason.
    let out = submit(&["--expert", "mail", "--expert", "sotu", "--mode", "raw"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{stderr}");
    assert!(
        stderr.contains("fan-out to mail, sotu") && stderr.contains("no consumer node hosts all"),
        "{stderr}"
    );
    // The operator's views: nodes, pools, jobs, one job's record.
    let admin_cmd = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_scd"))
            .args(args)
            .args(["--node", &admin, "--name", "ops", "--pki-dir"])
            .arg(pki)
            .output()
            .unwrap()
    };
    let admin_json = |args: &[&str]| -> serde_json::Value {
        let out = admin_cmd(args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let listed = admin_json(&["nodes", "--json"]);
    let mut ids: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["id"].as_str().unwrap())
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, ["consumer-a", "consumer-b", "producer"]);
    let pools = admin_json(&["pools", "--json"]);
    assert_eq!(
        pools,
        serde_json::json!({"mail": ["producer"], "sotu": ["producer"]})
    );
    // The same from a client config file instead of flags.
    let client_config = dir.path().join("client.toml");
    fs::write(
        &client_config,
        format!(
            "node = \"{admin}\"\npki_dir = \"{}\"\nname = \"ops\"\n",
            pki.display()
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_scd"))
        .args(["pools", "--json", "--client-config"])
        .arg(&client_config)
        .env_remove("SCD_NODE")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let from_file: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(from_file, pools);
    // No node anywhere: a usage error that says where to give one.
    let out = Command::new(env!("CARGO_BIN_EXE_scd"))
        .args(["pools"])
        .env_remove("SCD_NODE")
        .env_remove("SCD_CLIENT_CONFIG")
        .env("HOME", dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--node"));
    let jobs = admin_json(&["jobs", "list", "--json"]);
    let listed = jobs
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["job"] == job.as_str())
        .expect("the job is listed");
    assert_eq!(listed["state"], "done");
    let record = admin_json(&["jobs", "show", &job]);
    assert_eq!(record["state"], "done");
    assert!(record["request"]["prompt"]
        .as_array()
        .is_some_and(|p| !p.is_empty()));
    assert!(
        record["stages"]["prefill"]["end_ms"].is_number(),
        "{record}"
    );

    // Translator versions: each pair's configured version is live; publishing and activating
    // another switches the nodes that serve the pair without a restart, and rolling back
    // returns them.
    let shipped = scd_models::translator::Translator::load(&repo().join("experts/mail/translator"))
        .unwrap()
        .hash();
    let listed = admin_json(&["translators", "list", "--json"]);
    let live: Vec<(&str, &str)> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["consumer"].as_str().unwrap(),
                p["active"]["content_hash"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(live[0], ("mail", shipped.to_string().as_str()), "{listed}");
    assert_eq!(live[1].0, "sotu");
    let other_dir = dir.path().join("translators/mail-v2");
    let mut other =
        scd_models::translator::Translator::load(&repo().join("experts/mail/translator")).unwrap();
    // The same weights stored in f32 (the shipped file is bf16): another content hash.
    other.manifest.weights_dtype = scd_models::translator::WeightsDtype::F32;
    let other_hash = other.save(&other_dir).unwrap();
    // A folder outside the nodes' [models] translator_roots: refused, saying so (a version is
    // a path, and the node reads only the folders meant for it).
    let stray = dir.path().join("elsewhere");
    other.save(&stray).unwrap();
    let out = admin_cmd(&[
        "translators",
        "publish",
        "--expert",
        "mail",
        "--version",
        "stray",
        "--translator",
        stray.to_str().unwrap(),
    ]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("outside [models] translator_roots"), "{said}");
    let out = admin_cmd(&[
        "translators",
        "publish",
        "--expert",
        "mail",
        "--version",
        "v2",
        "--activate",
        "--translator",
        other_dir.to_str().unwrap(),
    ]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        said.contains("published v2")
            && said.contains(&other_hash.short())
            && said.contains("live: v2"),
        "{said}"
    );
    let switched = |nodes: &mut [NodeProc], version: &str| {
        let started = Instant::now();
        for n in nodes.iter_mut().filter(|n| n.id != "consumer-b") {
            while !n
                .log()
                .lines()
                .any(|l| l.contains("translator switched") && l.contains(version))
            {
                n.check_alive();
                assert!(
                    started.elapsed() < JOB_WITHIN,
                    "{} never switched to {version}",
                    n.id
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    switched(&mut nodes, "\"v2\"");
    let scd_job = |client: &ClusterClient| {
        let client = client.clone();
        let prompt = request(prompt.clone());
        async move {
            let id = client.submit("mail", Mode::Scd, prompt).await.unwrap();
            client.wait(id, JOB_WITHIN).await.unwrap()
        }
    };
    let job = scd_job(&client).await;
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    assert_eq!(job.translator, Some(other_hash));
    let out = admin_cmd(&["translators", "rollback", "--expert", "mail"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.contains(&format!("({})", shipped.short())),
        "{said}"
    );
    let job = scd_job(&client).await;
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    // A version nobody published: refused, exit code 5, saying which.
    let out = admin_cmd(&[
        "translators",
        "activate",
        "--expert",
        "mail",
        "--version",
        "v9",
    ]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{said}");
    assert!(said.contains("v9"), "{said}");

    // An expert nobody serves: refused with what to do, exit code 5.
    let out = submit(&["--expert", "nope"]);
    assert_eq!(out.status.code(), Some(5));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no consumer serves expert nope"),
        "{stderr}"
    );
    // An admin certificate of another CA: the node refuses the connection, exit code 3.
    let rogue = dir.path().join("rogue");
    fs::create_dir(&rogue).unwrap();
    init_ca_dir(&rogue, "other").unwrap();
    issue_in_dir(&rogue, "ops", Role::Admin).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_scd"))
        .args(["submit", "--node", &admin, "--name", "ops", "--pki-dir"])
        .arg(&rogue)
        .args(["--expert", "mail", "--prompt", "hi"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Ctrl-C on `scd submit`: the CLI closes its connection, exits 130, and the
    // node it submitted through cancels the job, which nobody would read now.
    let mut long = Command::new(env!("CARGO_BIN_EXE_scd"))
        .args(["submit", "--node", &admin, "--name", "ops", "--pki-dir"])
        .arg(pki)
        .args(["--raw", "--prompt", PROMPT, "--max-tokens", "2000"])
        .args(["--expert", "mail", "--mode", "raw"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Its stderr is read to the end (a closed pipe would fail its status lines), the job's
    // id handed over when it comes.
    let (id_tx, id_rx) = std::sync::mpsc::channel();
    let stderr = long.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        let mut all = String::new();
        for line in std::io::BufReader::new(stderr).lines() {
            let line = line.unwrap();
            if let Some(Ok(id)) = line.strip_prefix("job ").map(str::parse::<JobId>) {
                let _ = id_tx.send(id);
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let id = id_rx
        .recv_timeout(JOB_WITHIN)
        .expect("scd submit names its job");
    let since = Instant::now();
    while client.get(id).await.map(|j| j.state).ok() != Some(JobState::Decoding) {
        assert!(since.elapsed() < JOB_WITHIN, "job {id} never decoded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = Command::new("kill")
        .args(["-INT", &long.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let code = long.wait().unwrap().code();
    let said = reader.join().unwrap();
    assert_eq!(code, Some(130), "{said}");
    assert!(said.contains("interrupted"), "{said}");
    let cancelled = loop {
        let job = client.get(id).await.unwrap();
        if job.state.is_finished() {
            break job;
        }
        assert!(since.elapsed() < JOB_WITHIN, "job {id} still {}", job.state);
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        cancelled.state,
        JobState::Cancelled,
        "{:?}",
        cancelled.error
    );
    assert!(
        cancelled.output.map_or(0, |o| o.tokens.len()) < 2000,
        "it was stopped, not finished"
    );

    // SIGTERM: consumer-b drains (nothing in flight), revokes its lease and exits 0; it is gone
    // from the cluster at once, long before its lease (10 s) would have expired.
    let b = nodes.pop().unwrap();
    let status = Command::new("kill")
        .args(["-TERM", &b.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let mut b = b;
    let stopped = Instant::now();
    let exit = loop {
        if let Some(status) = b.child.try_wait().unwrap() {
            break status;
        }
        assert!(stopped.elapsed() < Duration::from_secs(60), "{}", b.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(exit.success(), "{}", b.log());
    let live = client.nodes().await.unwrap();
    assert!(!live.contains_key("consumer-b"), "{:?}", live.keys());
    assert!(b.log().contains("draining"), "{}", b.log());
    // With it gone, nobody serves sotu: a submission says what to start.
    let err = client
        .submit("sotu", Mode::Raw, request(prompt.clone()))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("no consumer serves expert sotu"),
        "{err}"
    );
}

/// The prompt of fault-test job `i`: distinct from its first block on, so that prefix affinity
/// spreads the jobs over both producers instead of sending them all to one cache.
fn numbered_prompt(i: usize) -> String {
    format!("Note {i}. {PROMPT}")
}

/// Waits until `pick` finds a job of `ids` that is in one of `states` on the node it names,
/// and returns that job's id.
async fn job_in_flight(
    client: &ClusterClient,
    ids: &[scd_scheduler::JobId],
    states: &[JobState],
    on: impl Fn(&scd_scheduler::JobRecord) -> bool,
) -> scd_scheduler::JobId {
    let started = Instant::now();
    loop {
        for &id in ids {
            // The store may be restarting: an error is a miss, not a failure.
            let Ok(job) = client.get(id).await else {
                continue;
            };
            if states.contains(&job.state) && on(&job) {
                return id;
            }
        }
        assert!(
            started.elapsed() < JOB_WITHIN,
            "no job reached {states:?} on the node in time"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Kill -9 under load, against real processes and a real etcd: two producers that are both
/// scheduler replicas and two consumers of the mail expert run 20 jobs; the producer that
/// leads the schedulers is killed with a job of its own in flight, etcd is restarted while
/// jobs are running, and a consumer is killed with jobs in flight (it holds every job it
/// decodes, by the `hold-before-report` failpoint, so it has some by construction). Every job ends done,
/// exactly once, its record shows the abandoned attempts and whom they blamed, the jobs re-run
/// elsewhere answer what one process answers, and exactly one scheduler leads at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_nodes_and_a_restarted_etcd_lose_no_job() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path();
    let mut etcd = etcd_over_tls(pki).await;
    init_ca_dir(pki, "test").unwrap();
    for id in ["p1", "p2", "c1", "c2"] {
        issue_in_dir(pki, id, Role::Node).unwrap();
    }
    let prefix = "/scd-faults";
    let specs: [NodeSpec; 4] = [
        ("p1", "\"producer\", \"scheduler\"", vec![("mail", false)]),
        ("p2", "\"producer\", \"scheduler\"", vec![("mail", false)]),
        ("c1", "\"consumer\"", vec![("mail", true)]),
        ("c2", "\"consumer\"", vec![("mail", true)]),
    ];
    let (mut nodes, client) = start_cluster(pki, &etcd, prefix, &specs, &["c2"]).await;
    let file = GgufFile::open(model_path()).unwrap();
    let tok = Tokenizer::from_gguf(file.content()).unwrap();
    let submit = |i: usize| {
        let client = client.clone();
        let request = JobRequest {
            prompt: tok.encode(&numbered_prompt(i), false).unwrap(),
            max_tokens: MAX_TOKENS,
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            stop_tokens: tok.stop_ids().to_vec(),
            documents: Vec::new(),
        };
        async move { client.submit("mail", Mode::Raw, request).await.unwrap() }
    };
    let store = etcd.store().await.unwrap();
    let election = Keys::new(prefix).election("scheduler").unwrap();
    let leader = || async {
        store
            .get(&election)
            .await
            .ok()
            .flatten()
            .map(|kv| String::from_utf8_lossy(&kv.value).into_owned())
    };

    // Wave one: 12 jobs. The leading scheduler's producer dies with one of its jobs running.
    let mut ids = Vec::new();
    for i in 0..12 {
        ids.push(submit(i).await);
    }
    let first_leader = loop {
        if let Some(l) = leader().await {
            break l;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let victim = first_leader.clone();
    let caught = job_in_flight(
        &client,
        &ids,
        &[JobState::Prefilling, JobState::Transferring],
        |j| j.producer.as_deref() == Some(victim.as_str()),
    )
    .await;
    let at = nodes.iter().position(|n| n.id == victim).unwrap();
    let mut dead = nodes.remove(at);
    dead.child.kill().unwrap();
    dead.child.wait().unwrap();
    let killed = Instant::now();
    // The other replica takes over once the dead leader's lease runs out (a bound, not a
    // speed claim: the lease is 10 s).
    let survivor = loop {
        match leader().await {
            Some(l) if l != first_leader => break l,
            _ => {}
        }
        assert!(
            killed.elapsed() < Duration::from_secs(90),
            "no new scheduler leader after the leader was killed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    // Wave two, then etcd restarts under it.
    for i in 12..20 {
        ids.push(submit(i).await);
    }
    etcd.restart().await.unwrap();
    // The nodes come back to the restarted store: exactly the three live ones are listed.
    let mut want = vec![survivor.clone(), "c1".to_string(), "c2".to_string()];
    want.sort();
    let restarted = Instant::now();
    loop {
        if let Ok(live) = client.nodes().await {
            if live.keys().cloned().collect::<Vec<_>>() == want {
                break;
            }
        }
        assert!(
            restarted.elapsed() < START_WITHIN,
            "the nodes did not re-register after etcd restarted"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A consumer dies with jobs of its own in flight: c2 holds every job it decodes instead of
    // reporting it (`hold-before-report`), so the jobs the scheduler gave it are still its own
    // when it dies, however fast this machine decodes. Before, the test caught a job running on
    // c2 and killed it, and on a busy machine every such job had ended by the kill.
    let running_on_c2 =
        |j: &scd_scheduler::JobRecord| j.state.is_running() && j.consumer.as_deref() == Some("c2");
    job_in_flight(&client, &ids, &[JobState::Decoding], running_on_c2).await;
    let at = nodes.iter().position(|n| n.id == "c2").unwrap();
    let mut dead_consumer = nodes.remove(at);
    dead_consumer.child.kill().unwrap();
    dead_consumer.child.wait().unwrap();
    // Each job c2 held goes back to the queue, blaming c2, once its lapsed lease tells the
    // scheduler that c2 is gone.
    let mut lost_on_c2 = Vec::new();
    for &id in &ids {
        let deadline = Instant::now() + JOB_WITHIN;
        let mut job = client.get(id).await.unwrap();
        if !running_on_c2(&job) {
            continue;
        }
        while running_on_c2(&job) {
            assert!(Instant::now() < deadline, "{id}: still held by the dead c2");
            tokio::time::sleep(Duration::from_millis(100)).await;
            job = client.get(id).await.unwrap();
        }
        assert!(
            job.failed_consumers.iter().any(|c| c == "c2"),
            "{id}: taken back from the dead c2 without blaming it: {job:?}"
        );
        lost_on_c2.push(id);
    }
    assert!(
        !lost_on_c2.is_empty(),
        "c2 held no job when it died, although it holds every job it decodes"
    );

    let mut finished = Vec::new();
    for &id in &ids {
        let job = match client.wait(id, JOB_WITHIN * 2).await {
            Ok(job) => job,
            Err(e) => {
                let logs: Vec<String> = nodes.iter().map(NodeProc::log).collect();
                panic!("job {id}: {e}\n{}", logs.join("\n----\n"));
            }
        };
        assert_eq!(job.state, JobState::Done, "{id}: {:?}", job.error);
        let states: Vec<JobState> = job.history.iter().map(|h| h.state).collect();
        // Done once; every assignment is one attempt, each from the queue (never assigned
        // twice at once).
        assert_eq!(
            states.iter().filter(|s| **s == JobState::Done).count(),
            1,
            "{states:?}"
        );
        let assigned: Vec<usize> = (0..states.len())
            .filter(|&k| states[k] == JobState::Assigned)
            .collect();
        assert_eq!(assigned.len() as u32, job.attempts, "{states:?}");
        assert!(
            assigned.iter().all(|&k| states[k - 1] == JobState::Queued),
            "{states:?}"
        );
        finished.push(job);
    }
    let record = |id| finished.iter().find(|j| j.id == id).unwrap();
    let caught_job = record(caught);
    assert!(caught_job.attempts >= 2, "{caught_job:?}");
    assert!(
        caught_job.failed_producers.iter().any(|p| *p == victim),
        "{:?}",
        caught_job.failed_producers
    );
    for &id in &lost_on_c2 {
        let lost = record(id);
        assert!(lost.attempts >= 2, "{lost:?}");
        assert_ne!(lost.consumer.as_deref(), Some("c2"), "{lost:?}");
    }
    // Re-run jobs answer what one process answers for their prompts.
    for (job, i) in [caught, lost_on_c2[0]]
        .into_iter()
        .map(|id| (record(id), ids.iter().position(|x| *x == id).unwrap()))
    {
        let text = tok
            .decode(&job.output.as_ref().unwrap().tokens, true)
            .unwrap();
        let want = in_process_for("mail", Mode::Raw, &numbered_prompt(i));
        assert_eq!(text.trim_end(), want.trim_end(), "job {i}");
    }
    // One leader, the survivor, and it still schedules: a new job runs.
    assert_eq!(leader().await.as_deref(), Some(survivor.as_str()));
    let last = submit(20).await;
    let job = client.wait(last, JOB_WITHIN).await.unwrap();
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    for n in &mut nodes {
        n.check_alive();
    }
}
