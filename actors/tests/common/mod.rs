//! What the actors' tests share: the real base model and the shipped `mail` expert with its
//! translator (loaded once per test binary), a chat prompt, greedy parameters, and the
//! in-process reference a job through the actors must equal; and a cluster of nodes on the
//! embedded store.
#![allow(dead_code)]

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use std::time::Duration;

use scd_actors::{ClusterClient, JobCodec, Node, NodeConfig, Served};
use scd_models::codec::{self, CodecOptions};
use scd_models::tokenizer::{ChatMessage, Tokenizer};
use scd_models::translator::Translator;
use scd_models::{
    generate_with_cache, AdapterMode, Codec, GenerateParams, GgufFile, Input, Llama, LogitsWanted,
    LoraAdapter, Prefix, Sampling,
};
use scd_scheduler::{EmbeddedStore, JobRequest, Keys, MetaStore};
use scd_transport::{ClusterCa, Role};
use scd_transport::{CodeDType, Mode};
use tokio_util::sync::CancellationToken;

pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const MAX_TOKENS: usize = 16;

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `$SCD_MODEL_DIR/<model>` or `<repo>/.cache/models/<model>`; fails with the fix when absent.
pub fn model_path() -> PathBuf {
    let dir = std::env::var_os("SCD_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".cache/models"));
    let path = dir.join(MODEL_FILE);
    assert!(
        path.exists(),
        "{} is missing: run `make model` (or set SCD_MODEL_DIR to the folder holding {MODEL_FILE})",
        path.display()
    );
    path
}

/// The base model, the mail expert, their translator (with the expert's index in it) and the
/// tokenizer, loaded once per test binary.
pub struct Models {
    pub base: Arc<Llama>,
    pub expert: Arc<Llama>,
    pub translator: (Arc<Translator>, usize),
    pub tok: Tokenizer,
}

pub fn models() -> &'static Models {
    static MODELS: OnceLock<Models> = OnceLock::new();
    MODELS.get_or_init(|| {
        let file = GgufFile::open(model_path()).unwrap();
        let tok = Tokenizer::from_gguf(file.content()).unwrap();
        let base = file.load_model().unwrap();
        let mail = repo().join("experts/mail");
        let adapter = LoraAdapter::load(mail.join("adapter.safetensors"), base.config()).unwrap();
        let expert = base.with_adapter(&adapter, AdapterMode::Merge).unwrap();
        let translator = Translator::load(&mail.join("translator")).unwrap();
        let index = translator.check_pair(&base, &expert).unwrap();
        Models {
            base: Arc::new(base),
            expert: Arc::new(expert),
            translator: (Arc::new(translator), index),
            tok,
        }
    })
}

/// A chat prompt of about a hundred tokens, long enough that the prefill takes a while.
pub fn prompt(m: &Models) -> Vec<u32> {
    let text = "Please read this message and write a short, polite reply. \
        From: Jane Smith <jane@example.org>. Subject: Re: the server upgrade on Friday. \
        Hi all, a reminder that the mail server will be down for maintenance from six to \
        eight in the evening on Friday. Messages sent during that window will be queued and \
        delivered afterwards. If you have urgent deliveries, send them before five. Thanks \
        for your patience, Jane.";
    let chat = m
        .tok
        .apply_chat_template(&[ChatMessage::user(text.to_owned())], true)
        .unwrap();
    let ids = m.tok.encode(&chat, false).unwrap();
    assert!(ids.len() > 64, "prompt of {} tokens", ids.len());
    ids
}

pub fn params() -> GenerateParams {
    GenerateParams {
        max_tokens: MAX_TOKENS,
        sampling: Sampling::Greedy,
        seed: 0,
        // No stop token: every run generates exactly MAX_TOKENS, so the comparison is long.
        stop_tokens: Vec::new(),
    }
}

pub fn raw_codec() -> JobCodec {
    JobCodec::for_mode(Mode::Raw, None, &CodecOptions::default()).unwrap()
}

pub fn scd_codec(m: &Models) -> JobCodec {
    let (t, index) = &m.translator;
    let codec = JobCodec::for_mode(
        Mode::Scd,
        Some((t, *index)),
        &CodecOptions {
            code_dtype: CodeDType::I8_ROWS,
            ..CodecOptions::default()
        },
    )
    .unwrap();
    assert_eq!(codec.translator, Some(t.hash()));
    codec
}

/// [`reference`] for `mode` with the shipped mail translator.
#[allow(dead_code)]
pub fn reference_for(m: &Models, mode: Mode, prompt: &[u32]) -> Vec<u32> {
    let (t, index) = &m.translator;
    let codec = JobCodec::for_mode(mode, Some((t, *index)), &CodecOptions::default()).unwrap();
    reference(m, codec.codec.as_ref(), prompt)
}

/// The same mode in one process, without actors or QUIC: the whole prefix's captures encoded,
/// decoded with the codec's layer decoder, generated with the same function.
pub fn reference(m: &Models, codec: &dyn Codec, prompt: &[u32]) -> Vec<u32> {
    let (&last, prefix) = prompt.split_last().unwrap();
    let codes = match codec.capture() {
        Some(capture) => {
            let captured = m
                .base
                .forward(
                    Input::new(prefix)
                        .capture(capture)
                        .logits(LogitsWanted::None),
                )
                .unwrap()
                .captured;
            codec::encode(codec, &captured).unwrap()
        }
        None => Vec::new(),
    };
    let mut cache = codec::decode(codec, &m.expert, &codes, Prefix::new(prefix)).unwrap();
    generate_with_cache(&m.expert, &mut cache, &[last], &params(), |_| {
        ControlFlow::Continue(())
    })
    .unwrap()
    .tokens
}

pub const WAIT: Duration = Duration::from_secs(300);

/// A node config on the embedded store: `roles` as TOML list items, the mail expert if
/// `expert`.
pub fn config(id: &str, roles: &str, expert: bool) -> NodeConfig {
    config_with(
        id,
        roles,
        expert,
        &repo().join("experts/mail/translator"),
        "",
    )
}

/// [`config`] with another mail translator and more TOML (`extra`: node keys, then sections).
pub fn config_with(
    id: &str,
    roles: &str,
    expert: bool,
    translator: &Path,
    extra: &str,
) -> NodeConfig {
    let mail = repo().join("experts/mail");
    let experts = if expert {
        format!(
            "[[experts]]\nname = \"mail\"\nadapter = \"{}\"\ntranslator = \"{}\"\n",
            mail.display(),
            translator.display()
        )
    } else {
        String::new()
    };
    // The translator's default ranks, so that results compare with the in-process
    // references; adaptive ranks have tests of their own.
    let text = format!(
        "[node]\nid = \"{id}\"\nlisten = \"127.0.0.1:0\"\nroles = [{roles}]\n{extra}\n\
         [models]\nbase = \"{}\"\ntranslator_roots = [\"{}\", \"{}\"]\n\n{experts}\n\
         [store]\nkind = \"embedded\"\n\n\
         [tls]\nca = \"ca.pem\"\ncert = \"{id}.pem\"\nkey = \"{id}.key\"\n\n\
         [codec]\nranks = \"default\"\n",
        model_path().display(),
        // The shipped experts, and the temporary folders tests write other versions in.
        repo().join("experts").display(),
        std::env::temp_dir().display(),
    );
    NodeConfig::parse(&text, &repo()).unwrap()
}

/// Nodes on one embedded store, with certificates from one CA.
pub struct Cluster {
    pub store: Arc<dyn MetaStore>,
    pub ca: ClusterCa,
    pub client: ClusterClient,
}

impl Cluster {
    pub fn new() -> Self {
        // The nodes' logs, where `RUST_LOG` asks for them (printed with a failing test's
        // output): what each node did with a job that did not end.
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_test_writer()
                .try_init();
        }
        let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
        let client = ClusterClient::new(store.clone(), Keys::default());
        Self {
            store,
            ca: ClusterCa::generate("test").unwrap(),
            client,
        }
    }

    pub async fn start(&self, config: &NodeConfig) -> Node {
        self.start_traced(config, None).await
    }

    /// [`Cluster::start`] with the node's spans going to `telemetry`.
    pub async fn start_traced(
        &self,
        config: &NodeConfig,
        telemetry: Option<scd_actors::telemetry::Telemetry>,
    ) -> Node {
        let served = Arc::new(Served::load(config, scd_models::KernelChoice::best()).unwrap());
        let identity = self.ca.issue(&config.node.id, Role::Node).unwrap();
        Node::start(
            config,
            &identity,
            served,
            self.store.clone(),
            telemetry,
            CancellationToken::new(),
        )
        .await
        .unwrap()
    }

    /// Submits a mail job for `prompt` in `mode` and waits for its record to finish.
    pub async fn run_mail(
        &self,
        mode: Mode,
        prompt: &[u32],
        max_tokens: usize,
    ) -> scd_scheduler::JobRecord {
        self.run("mail", mode, request(prompt, max_tokens)).await
    }

    /// Submits `request` for `expert` in `mode` and waits for its record to finish.
    pub async fn run(
        &self,
        expert: &str,
        mode: Mode,
        request: JobRequest,
    ) -> scd_scheduler::JobRecord {
        let id = self.client.submit(expert, mode, request).await.unwrap();
        self.client.wait(id, WAIT).await.unwrap()
    }

    /// The producer node (also the scheduler replica) and a consumer node serving mail.
    pub async fn two_nodes(&self) -> (Node, Node) {
        let producer = self
            .start(&config("prefill-0", "\"producer\", \"scheduler\"", true))
            .await;
        let consumer = self.start(&config("mail-0", "\"consumer\"", true)).await;
        (producer, consumer)
    }
}

/// A greedy request without stop tokens.
pub fn request(prompt: &[u32], max_tokens: usize) -> JobRequest {
    JobRequest {
        prompt: prompt.to_vec(),
        max_tokens: max_tokens as u32,
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
        stop_tokens: Vec::new(),
        documents: Vec::new(),
    }
}

/// The Python with `openai`, `prometheus_client` and `opentelemetry-proto` installed: `$SCD_OPENAI_PYTHON`, else the venv `ops/setup.sh` makes.
pub fn python() -> PathBuf {
    let path = std::env::var_os("SCD_OPENAI_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".cache/openai-venv/bin/python"));
    assert!(
        path.exists(),
        "{} is missing: run `make setup` (ops/setup.sh installs the openai client there) or set SCD_OPENAI_PYTHON",
        path.display()
    );
    path
}
