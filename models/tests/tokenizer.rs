//! The tokenizer against reference fixtures produced by llama.cpp and transformers
//! (`ops/tokenizer-fixtures.py`, provenance inside each fixture), on the real SmolLM2 GGUF.

use std::io::Cursor;
use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::quantized::gguf_file::{self, Content, Value};
use scd_models::tokenizer::{
    ChatMessage, ChatTemplate, ChatTemplateError, Tokenizer, TokenizerError,
};
use serde::Deserialize;

const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Deserialize)]
struct EncodeFixture {
    generator: serde_json::Value,
    disagreements: Vec<serde_json::Value>,
    cases: Vec<EncodeCase>,
}

#[derive(Deserialize)]
struct EncodeCase {
    name: String,
    text: String,
    ids: Vec<u32>,
    ids_plain: Vec<u32>,
    decoded: String,
}

#[derive(Deserialize)]
struct ChatFixture {
    chat_template: String,
    disagreements: Vec<serde_json::Value>,
    conversations: Vec<ChatCase>,
}

#[derive(Deserialize)]
struct ChatCase {
    name: String,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    rendered: String,
    ids: Vec<u32>,
}

fn encode_fixture() -> &'static EncodeFixture {
    static F: OnceLock<EncodeFixture> = OnceLock::new();
    F.get_or_init(|| serde_json::from_str(include_str!("fixtures/tokenizer_encode.json")).unwrap())
}

fn chat_fixture() -> &'static ChatFixture {
    static F: OnceLock<ChatFixture> = OnceLock::new();
    F.get_or_init(|| serde_json::from_str(include_str!("fixtures/tokenizer_chat.json")).unwrap())
}

fn model_path() -> PathBuf {
    let dir = std::env::var_os("SCD_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/models"));
    let path = dir.join(MODEL_FILE);
    assert!(
        path.exists(),
        "{} is missing: run `make model` (or set SCD_MODEL_DIR)",
        path.display()
    );
    path
}

/// A directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("scd-tokenizer-test-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn gguf_tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let mut file = std::fs::File::open(model_path()).unwrap();
        let content = Content::read(&mut file).unwrap();
        Tokenizer::from_gguf(&content).unwrap()
    })
}

#[test]
fn fixtures_come_from_llama_cpp_cross_checked_by_transformers() {
    let f = encode_fixture();
    assert!(f.cases.len() >= 40, "only {} cases", f.cases.len());
    assert!(f.generator["command"]
        .as_str()
        .unwrap()
        .contains("tokenizer-fixtures.py"));
    assert!(f.generator["primary_reference"]
        .as_str()
        .unwrap()
        .starts_with("llama.cpp"));
    // transformers' GGUF converter ignores `tokenizer.ggml.pre` (plain ByteLevel, no digit
    // isolation), so it differs from llama.cpp exactly where a space precedes a non-ASCII
    // numeric character (½, Ⅰ, ٣ ...). Everything else agrees.
    let mut disagreeing: Vec<&str> = f
        .disagreements
        .iter()
        .map(|d| d["case"].as_str().unwrap())
        .collect();
    disagreeing.dedup();
    assert_eq!(disagreeing, ["math_unicode", "numeric_symbols"]);
    assert!(chat_fixture().disagreements.is_empty());
}

#[test]
fn exact_ids_for_every_fixture() {
    let tok = gguf_tokenizer();
    let mut failures = Vec::new();
    for c in &encode_fixture().cases {
        let ids = tok.encode(&c.text, false).unwrap();
        if ids != c.ids {
            failures.push(format!("{}: got {:?}, want {:?}", c.name, ids, c.ids));
        }
        let plain = tok.encode_plain(&c.text, false).unwrap();
        if plain != c.ids_plain {
            failures.push(format!(
                "{} (plain): got {:?}, want {:?}",
                c.name, plain, c.ids_plain
            ));
        }
        let decoded = tok.decode(&c.ids, false).unwrap();
        if decoded != c.decoded {
            failures.push(format!(
                "{} (decode): got {decoded:?}, want {:?}",
                c.name, c.decoded
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn special_tokens_are_single_ids_and_stop_generation() {
    let tok = gguf_tokenizer();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.token_to_id("<|endoftext|>"), Some(0));
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    assert_eq!(tok.id_to_token(2).as_deref(), Some("<|im_end|>"));
    assert_eq!(tok.token_to_id("Ġthe"), Some(260));
    assert_eq!(tok.id_to_token(260).as_deref(), Some("Ġthe"));
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_id(), Some(2));
    assert_eq!(tok.stop_ids(), &[0, 2]);
    assert!(tok.is_stop(2) && tok.is_stop(0) && !tok.is_stop(1));
    assert!(tok.is_special(1) && !tok.is_special(260));
    // SmolLM2's GGUF asks for no bos: add_special_tokens changes nothing.
    assert_eq!(
        tok.encode("Hi", true).unwrap(),
        tok.encode("Hi", false).unwrap()
    );
}

#[test]
fn decode_of_encode_is_the_identity() {
    let tok = gguf_tokenizer();
    let extra = [
        "trailing newline\n",
        "🦀🦀🦀 crab 蟹",
        "\u{0}\u{1}\u{7f} control bytes",
        "a\u{a0}b\u{2003}c", // no-break and em spaces
        "<|im_start|>assistant\n🙂<|im_end|>",
    ];
    let specials: Vec<String> = (0..tok.vocab_size() as u32)
        .filter(|&id| tok.is_special(id))
        .map(|id| tok.id_to_token(id).unwrap())
        .collect();
    assert_eq!(specials.len(), 17, "{specials:?}");
    let texts = encode_fixture()
        .cases
        .iter()
        .map(|c| c.text.as_str())
        .chain(extra);
    for text in texts {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        let mut without_special = text.to_owned();
        for s in &specials {
            without_special = without_special.replace(s.as_str(), "");
        }
        assert_eq!(tok.decode(&ids, true).unwrap(), without_special, "{text:?}");
        let plain = tok.encode_plain(text, false).unwrap();
        assert_eq!(
            tok.decode(&plain, true).unwrap(),
            text,
            "plain ids carry no special token"
        );
    }
}

#[test]
fn unknown_ids_are_errors() {
    let tok = gguf_tokenizer();
    assert!(matches!(
        tok.decode(&[5, 49152], false),
        Err(TokenizerError::UnknownId {
            id: 49152,
            vocab_size: 49152
        })
    ));
    let mut stream = tok.stream_decoder(false);
    assert!(matches!(
        stream.step(u32::MAX),
        Err(TokenizerError::UnknownId { .. })
    ));
}

/// Feeds ids one by one; returns the pieces, including the final flush.
fn stream_pieces(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> Vec<String> {
    let mut stream = tok.stream_decoder(skip_special);
    let mut pieces: Vec<String> = ids.iter().map(|&id| stream.step(id).unwrap()).collect();
    pieces.push(stream.finish());
    assert!(!stream.has_pending());
    pieces
}

#[test]
fn streaming_decode_concatenates_to_the_full_decode() {
    let tok = gguf_tokenizer();
    let mut held_back = 0;
    for c in &encode_fixture().cases {
        for skip in [false, true] {
            let pieces = stream_pieces(tok, &c.ids, skip);
            assert_eq!(
                pieces.concat(),
                tok.decode(&c.ids, skip).unwrap(),
                "{}",
                c.name
            );
            // The texts are valid UTF-8, so a correct stream never needs a replacement char.
            assert!(
                pieces.iter().all(|p| !p.contains('\u{fffd}')),
                "{}: {pieces:?}",
                c.name
            );
        }
        let pieces = stream_pieces(tok, &c.ids, false);
        held_back += pieces[..c.ids.len()]
            .iter()
            .filter(|p| p.is_empty())
            .count();
    }
    // Emoji and CJK characters span several byte-level tokens here; the stream held them back.
    assert!(held_back > 0);
    let crab = tok.encode("🦀", false).unwrap();
    assert!(crab.len() > 1, "{crab:?}");
    let pieces = stream_pieces(tok, &crab, false);
    assert_eq!(pieces.last().unwrap(), "");
    assert_eq!(pieces.concat(), "🦀");
    assert!(pieces[..crab.len() - 1].iter().all(String::is_empty));
}

#[test]
fn streaming_decode_replaces_invalid_bytes_like_a_full_decode() {
    let tok = gguf_tokenizer();
    // The byte-level tokens for single bytes: 'ł' stands for 0x82 (a lone continuation byte),
    // 'ð' for 0xF0 (the lead byte of a 4-byte character).
    let cont = tok.token_to_id("ł").unwrap();
    let lead = tok.token_to_id("ð").unwrap();
    let a = tok.token_to_id("a").unwrap();
    for ids in [
        vec![a, cont, a],
        vec![lead, a, a],
        vec![a, lead],
        vec![lead, lead, cont],
        vec![cont],
    ] {
        let full = tok.decode(&ids, false).unwrap();
        assert!(full.contains('\u{fffd}'), "{ids:?} -> {full:?}");
        assert_eq!(stream_pieces(tok, &ids, false).concat(), full, "{ids:?}");
    }
    // A trailing incomplete character is held until the stream ends.
    let mut stream = tok.stream_decoder(false);
    assert_eq!(stream.step(a).unwrap(), "a");
    assert_eq!(stream.step(lead).unwrap(), "");
    assert!(stream.has_pending());
    assert_eq!(stream.finish(), "\u{fffd}");
}

#[test]
fn chat_template_matches_the_reference_rendering() {
    let tok = gguf_tokenizer();
    let f = chat_fixture();
    let template = tok.chat_template().unwrap();
    assert_eq!(template.source(), f.chat_template);
    assert_eq!(template.bos_token(), Some("<|im_start|>"));
    assert_eq!(template.eos_token(), Some("<|im_end|>"));
    for c in &f.conversations {
        let rendered = tok
            .apply_chat_template(&c.messages, c.add_generation_prompt)
            .unwrap();
        assert_eq!(
            rendered, c.rendered,
            "{} gen={}",
            c.name, c.add_generation_prompt
        );
        assert_eq!(tok.encode(&rendered, false).unwrap(), c.ids, "{}", c.name);
    }
    // An empty conversation renders nothing but the generation prompt (the template's loop
    // inserts the default system turn only before a first message).
    assert_eq!(
        template.render(&[], true).unwrap(),
        "<|im_start|>assistant\n"
    );
}

#[test]
fn calibration_chat_turns_are_the_template_around_the_text() {
    use scd_models::translator::calibrate::ChatWrap;
    let tok = gguf_tokenizer();
    let wrap = ChatWrap::for_tokenizer(tok, 0.25).unwrap();
    let message = "It was the best of times.";
    let whole = tok
        .apply_chat_template(&[ChatMessage::user(message)], true)
        .unwrap();
    let mut pieces = wrap.head.clone();
    pieces.extend(tok.encode(message, false).unwrap());
    pieces.extend(&wrap.tail);
    // The special tokens split the text, so the pieces tokenise as the whole turn does.
    assert_eq!(pieces, tok.encode(&whole, false).unwrap());
    assert_eq!(
        tok.id_to_token(wrap.head[0]).as_deref(),
        Some("<|im_start|>")
    );
    assert!(tok
        .decode(&wrap.tail, false)
        .unwrap()
        .ends_with("<|im_start|>assistant\n"));
    assert!(ChatWrap::for_tokenizer(tok, 1.5).is_err());
}

#[test]
fn tokenizer_json_round_trip_agrees() {
    let tok = gguf_tokenizer();
    let dir = TempDir::new();
    let path = dir.path().join("tokenizer.json");
    tok.save(&path).unwrap();
    let loaded = Tokenizer::from_file(&path).unwrap();
    assert_eq!(loaded.vocab_size(), tok.vocab_size());
    for c in &encode_fixture().cases {
        assert_eq!(loaded.encode(&c.text, false).unwrap(), c.ids, "{}", c.name);
        assert_eq!(
            loaded.encode_plain(&c.text, false).unwrap(),
            c.ids_plain,
            "{}",
            c.name
        );
        assert_eq!(
            loaded.decode(&c.ids, false).unwrap(),
            c.decoded,
            "{}",
            c.name
        );
    }
    // tokenizer.json alone knows no bos/eos and no template; the ChatML stop tokens it knows.
    assert_eq!(loaded.bos_id(), None);
    assert_eq!(loaded.eos_id(), None);
    assert_eq!(loaded.stop_ids(), &[0, 2]);
    assert!(matches!(
        loaded.apply_chat_template(&[ChatMessage::user("x")], true),
        Err(TokenizerError::NoChatTemplate)
    ));

    // A Hugging Face directory adds them through tokenizer_config.json.
    let config = serde_json::json!({
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": true},
        "chat_template": chat_fixture().chat_template,
    });
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let hf = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert_eq!(hf.bos_id(), Some(1));
    assert_eq!(hf.eos_id(), Some(2));
    assert_eq!(hf.stop_ids(), &[0, 2]);
    for c in &chat_fixture().conversations {
        let rendered = hf
            .apply_chat_template(&c.messages, c.add_generation_prompt)
            .unwrap();
        assert_eq!(rendered, c.rendered, "{}", c.name);
    }
}

#[test]
fn tokenizer_json_without_byte_level_decoder_is_refused() {
    let dir = TempDir::new();
    let path = dir.path().join("tokenizer.json");
    gguf_tokenizer().save(&path).unwrap();
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["decoder"] = serde_json::Value::Null;
    std::fs::write(&path, json.to_string()).unwrap();
    let err = Tokenizer::from_file(&path).unwrap_err();
    assert!(
        matches!(err, TokenizerError::UnsupportedDecoder { .. }),
        "{err}"
    );
    let err = Tokenizer::from_file(dir.path().join("absent.json")).unwrap_err();
    assert!(matches!(err, TokenizerError::Io { .. }), "{err}");
}

/// An in-memory GGUF holding only tokenizer metadata: `<s>` (control, the bos), a, b, ab, Ġ,
/// Ġab, `</s>` (control, not the eos unless a test says so), and no chat template.
fn tiny_gguf(model: &str, pre: &str, add_bos: bool) -> Content {
    let strings = |v: &[&str]| Value::Array(v.iter().map(|s| Value::String((*s).into())).collect());
    let tokens = strings(&["<s>", "a", "b", "ab", "Ġ", "Ġab", "</s>"]);
    let merges = strings(&["a b", "Ġ ab"]);
    let types = Value::Array([3, 1, 1, 1, 1, 1, 3].into_iter().map(Value::I32).collect());
    let model = Value::String(model.into());
    let pre = Value::String(pre.into());
    let bos = Value::U32(0);
    let add_bos = Value::Bool(add_bos);
    let metadata: Vec<(&str, &Value)> = vec![
        ("tokenizer.ggml.model", &model),
        ("tokenizer.ggml.pre", &pre),
        ("tokenizer.ggml.tokens", &tokens),
        ("tokenizer.ggml.merges", &merges),
        ("tokenizer.ggml.token_type", &types),
        ("tokenizer.ggml.bos_token_id", &bos),
        ("tokenizer.ggml.add_bos_token", &add_bos),
    ];
    let mut file = Cursor::new(Vec::new());
    gguf_file::write(&mut file, &metadata, &[]).unwrap();
    file.set_position(0);
    Content::read(&mut file).unwrap()
}

#[test]
fn unsupported_gguf_tokenizers_give_typed_errors() {
    let err = Tokenizer::from_gguf(&tiny_gguf("llama", "default", false)).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::UnsupportedModel(m) if m == "llama"),
        "{err}"
    );
    assert!(err.to_string().contains("llama"));
    let err = Tokenizer::from_gguf(&tiny_gguf("gpt2", "qwen2", false)).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::UnsupportedPreTokenizer(p) if p == "qwen2"),
        "{err}"
    );
    let mut content = tiny_gguf("gpt2", "gpt-2", false);
    content.metadata.remove("tokenizer.ggml.merges");
    let err = Tokenizer::from_gguf(&content).unwrap_err();
    assert!(
        matches!(
            err,
            TokenizerError::MissingMetadata("tokenizer.ggml.merges")
        ),
        "{err}"
    );
}

#[test]
fn gguf_add_bos_token_prepends_bos() {
    let tok = Tokenizer::from_gguf(&tiny_gguf("gpt2", "gpt-2", true)).unwrap();
    assert_eq!(tok.encode("ab ab", false).unwrap(), vec![3, 5]);
    assert_eq!(tok.encode("ab ab", true).unwrap(), vec![0, 3, 5]);
    assert_eq!(tok.encode("<s>a", false).unwrap(), vec![0, 1]);
    assert_eq!(tok.decode(&[0, 3, 5], true).unwrap(), "ab ab");
    assert_eq!(tok.decode(&[0, 3, 5], false).unwrap(), "<s>ab ab");
    assert_eq!(tok.bos_id(), Some(0));
    assert_eq!(tok.eos_id(), None);
    assert!(tok.stop_ids().is_empty());
}

/// A Llama-2-style template written for these tests: a leading system message folded into the
/// first user turn, roles that must alternate (or `raise_exception`), bos/eos from the
/// tokenizer, a Python string method, and `{% %}` lines that Hugging Face's `trim_blocks` /
/// `lstrip_blocks` leave no trace of. The expected renderings in the tests are Jinja2's
/// (3.1.6, with Hugging Face's environment settings), written out.
const INST_TEMPLATE: &str = r#"{{ bos_token }}
{% if messages[0].role == 'system' %}
    {% set system = messages[0].content %}
    {% set turns = messages[1:] %}
{% else %}
    {% set turns = messages %}
{% endif %}
{% for m in turns %}
    {% if (m.role == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('roles must alternate user/assistant, turn ' ~ loop.index ~ ' is ' ~ m.role) }}
    {% endif %}
    {% if m.role == 'user' %}
[INST] {% if loop.first and system is defined %}<<SYS>>{{ system }}<</SYS>> {% endif %}{{ m.content.strip() }} [/INST]
    {% else %}
{{ m.content }}{{ eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
ASSISTANT:
{% endif %}
"#;

/// The tiny GGUF with `</s>` as eos and `template` as its chat template.
fn tiny_with_template(template: &str) -> Tokenizer {
    let mut content = tiny_gguf("gpt2", "gpt-2", false);
    let md = &mut content.metadata;
    md.insert(
        "tokenizer.chat_template".into(),
        Value::String(template.into()),
    );
    md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(6));
    Tokenizer::from_gguf(&content).unwrap()
}

/// A system message, then user / assistant / user.
fn inst_conversation() -> [ChatMessage; 4] {
    [
        ChatMessage::system("Be brief."),
        ChatMessage::user("  Hi  "),
        ChatMessage::assistant("Hello"),
        ChatMessage::user("Bye"),
    ]
}

#[test]
fn a_gguf_chat_template_renders_as_written() {
    let tok = tiny_with_template(INST_TEMPLATE);
    let template = tok.chat_template().unwrap();
    assert_eq!(template.source(), INST_TEMPLATE);
    assert_eq!(template.bos_token(), Some("<s>"));
    assert_eq!(template.eos_token(), Some("</s>"));
    let chat = |m: &[ChatMessage], gen| tok.apply_chat_template(m, gen).unwrap();
    let full = inst_conversation();
    assert_eq!(
        chat(&full, true),
        "<s>\n[INST] <<SYS>>Be brief.<</SYS>> Hi [/INST]\nHello</s>\n[INST] Bye [/INST]\nASSISTANT:\n"
    );
    assert_eq!(
        chat(&full, false),
        "<s>\n[INST] <<SYS>>Be brief.<</SYS>> Hi [/INST]\nHello</s>\n[INST] Bye [/INST]\n"
    );
    // No system message: none is made up.
    assert_eq!(
        chat(&full[1..2], true),
        "<s>\n[INST] Hi [/INST]\nASSISTANT:\n"
    );
    assert_eq!(chat(&full[1..2], false), "<s>\n[INST] Hi [/INST]\n");

    // Without an eos in the metadata, `eos_token` is undefined and prints nothing, as in Jinja2.
    let mut content = tiny_gguf("gpt2", "gpt-2", false);
    content.metadata.insert(
        "tokenizer.chat_template".into(),
        Value::String(INST_TEMPLATE.into()),
    );
    let no_eos = Tokenizer::from_gguf(&content).unwrap();
    assert_eq!(no_eos.chat_template().unwrap().eos_token(), None);
    assert_eq!(
        no_eos.apply_chat_template(&full[1..3], false).unwrap(),
        "<s>\n[INST] Hi [/INST]\nHello\n"
    );
}

#[test]
fn a_chat_template_that_raises_gives_a_typed_error_with_its_message() {
    let tok = tiny_with_template(INST_TEMPLATE);
    let err = tok
        .apply_chat_template(&[ChatMessage::user("a"), ChatMessage::user("b")], true)
        .unwrap_err();
    let TokenizerError::ChatTemplate(ChatTemplateError::Raised(message)) = &err else {
        panic!("{err:?}");
    };
    assert_eq!(
        message,
        "roles must alternate user/assistant, turn 2 is user"
    );
    assert!(err.to_string().contains(message.as_str()), "{err}");
}

#[test]
fn a_chat_template_that_does_not_compile_fails_the_load() {
    let mut content = tiny_gguf("gpt2", "gpt-2", false);
    content.metadata.insert(
        "tokenizer.chat_template".into(),
        Value::String("{% for m in messages %}{{ m.content }}".into()),
    );
    let err = Tokenizer::from_gguf(&content).unwrap_err();
    assert!(
        matches!(
            err,
            TokenizerError::ChatTemplate(ChatTemplateError::Syntax(_))
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("chat_template:1"), "{err}");
}

#[test]
fn without_a_chat_template_chat_is_an_error_and_chatml_an_explicit_fallback() {
    let tok = Tokenizer::from_gguf(&tiny_gguf("gpt2", "gpt-2", false)).unwrap();
    assert!(tok.chat_template().is_none());
    let hi = [ChatMessage::user("hi")];
    assert!(matches!(
        tok.apply_chat_template(&hi, true),
        Err(TokenizerError::NoChatTemplate)
    ));
    let fallback = tok
        .chat_template()
        .cloned()
        .unwrap_or_else(ChatTemplate::chatml);
    assert_eq!(
        fallback.render(&hi, true).unwrap(),
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn a_hugging_face_directory_renders_the_default_template_of_its_config() {
    let dir = TempDir::new();
    gguf_tokenizer()
        .save(dir.path().join("tokenizer.json"))
        .unwrap();
    let config = serde_json::json!({
        "bos_token": "<|endoftext|>",
        "eos_token": {"content": "<|im_end|>", "special": true},
        "chat_template": [
            {"name": "tool_use", "template": "{{ raise_exception('not the chat template') }}"},
            {"name": "default", "template": INST_TEMPLATE},
        ],
    });
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let hf = Tokenizer::from_hf_dir(dir.path()).unwrap();
    let rendered = hf.apply_chat_template(&inst_conversation(), true).unwrap();
    assert_eq!(
        rendered,
        "<|endoftext|>\n[INST] <<SYS>>Be brief.<</SYS>> Hi [/INST]\nHello<|im_end|>\n[INST] Bye [/INST]\nASSISTANT:\n"
    );
    // The special-token texts the template printed are single ids again.
    let ids = hf.encode(&rendered, false).unwrap();
    assert_eq!(ids[0], 0);
    assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 1);
}

/// Build, encoding and chat-template times; run with `--ignored --nocapture`. The text is every
/// fixture string (about 4,000 distinct tokens' worth): the first encode runs with a cold BPE
/// word cache, the repeats with a warm one, as a server sees after its first prompts. The
/// chat template renders each fixture conversation.
#[test]
#[ignore]
fn encode_speed() {
    use std::time::Instant;
    let mut file = std::fs::File::open(model_path()).unwrap();
    let start = Instant::now();
    let content = Content::read(&mut file).unwrap();
    let read = start.elapsed();
    let start = Instant::now();
    let tok = Tokenizer::from_gguf(&content).unwrap();
    let build = start.elapsed();
    let text: String = encode_fixture()
        .cases
        .iter()
        .map(|c| c.text.as_str())
        .chain(
            chat_fixture()
                .conversations
                .iter()
                .map(|c| c.rendered.as_str()),
        )
        .collect::<Vec<_>>()
        .join("\n");
    let text = std::iter::repeat_n(text.as_str(), 3)
        .collect::<Vec<_>>()
        .join("\n");
    let start = Instant::now();
    let ids = tok.encode(&text, false).unwrap();
    let cold = start.elapsed();
    let rounds = 20;
    let start = Instant::now();
    for _ in 0..rounds {
        std::hint::black_box(tok.encode(&text, false).unwrap());
    }
    let warm = start.elapsed() / rounds;
    let start = Instant::now();
    let mut stream = tok.stream_decoder(false);
    let streamed: usize = ids.iter().map(|&id| stream.step(id).unwrap().len()).sum();
    let stream_time = start.elapsed();
    let conversations = &chat_fixture().conversations;
    let start = Instant::now();
    for _ in 0..rounds {
        for c in conversations {
            let rendered = tok
                .apply_chat_template(&c.messages, c.add_generation_prompt)
                .unwrap();
            std::hint::black_box(rendered);
        }
    }
    let render = start.elapsed() / (rounds * conversations.len() as u32);
    println!(
        "gguf read {read:?}, build {build:?}; encode {} tokens ({} bytes): cold {cold:?}, warm {warm:?}; stream-decode {stream_time:?} ({streamed} bytes); chat template {render:?} per conversation",
        ids.len(),
        text.len()
    );
}
