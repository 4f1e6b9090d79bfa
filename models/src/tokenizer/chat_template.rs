//! Chat templates: conversations ([`ChatMessage`]s) rendered to prompt text by the model's own
//! Jinja template (the GGUF's `tokenizer.chat_template`, or `chat_template` in a Hugging Face
//! `tokenizer_config.json`), run by the `minijinja` engine the way Hugging Face's
//! `apply_chat_template` runs it with Jinja2.
//!
//! What a template sees is what Hugging Face gives it: `messages` (a list of `{role, content}`
//! maps), `add_generation_prompt`, `bos_token` and `eos_token` (the token texts; undefined when
//! the model has none), and the function `raise_exception(message)`, with Jinja's `trim_blocks`
//! and `lstrip_blocks` on and loop controls (`break`, `continue`). Python's string and dict
//! methods that templates call (`.strip()`, `.startswith()`, `.items()` ...) come from
//! `minijinja-contrib`'s pycompat layer.
//!
//! Where this differs from Hugging Face: `tojson` escapes `<`, `>`, `&` and `'` in strings
//! (minijinja's filter is HTML-safe), and `strftime_now`, `tools` and `documents` are not
//! provided (templates that use them test `is defined` first).
//!
//! [`ChatTemplate::chatml`] is the one built-in template: ChatML, for a model that has no
//! template at all and a caller that chooses to fall back to it. Nothing here substitutes it
//! for a model's own template, or recognises templates by their content.

use std::fmt;
use std::sync::Arc;

use minijinja::syntax::SyntaxConfig;
use minijinja::{context, AutoEscape, Environment, Error, ErrorKind, Value};

/// The name the template has inside its environment; errors say `(in chat_template:LINE)`.
const NAME: &str = "chat_template";

/// ChatML as Jinja: `<|im_start|>{role}\n{content}<|im_end|>\n` per message and
/// `<|im_start|>assistant\n` as the generation prompt.
const CHATML: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Errors from compiling or rendering a [`ChatTemplate`]. Each carries the engine's own message,
/// with the template line where it has one.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    /// The template source is not valid Jinja (or uses syntax the engine lacks).
    #[error("the chat template does not compile: {0}")]
    Syntax(Error),
    /// The template called `raise_exception`: it refuses this conversation, e.g. roles that do
    /// not alternate. The message is the template's own.
    #[error("the chat template refused the conversation: {0}")]
    Raised(String),
    /// Rendering failed otherwise: an operation on a value of the wrong type, an unknown
    /// filter or method, ...
    #[error("the chat template failed to render: {0}")]
    Render(Error),
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant` (or any role the model's template knows).
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// A compiled chat template and the special-token texts it is rendered with.
///
/// Compiled once; rendering only runs it. Cloning shares the compiled template.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    source: Arc<str>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles a Jinja chat template (as found in `tokenizer.chat_template` or
    /// `tokenizer_config.json`). It renders without `bos_token` / `eos_token` until
    /// [`ChatTemplate::with_special_tokens`] gives them.
    pub fn from_source(source: impl Into<String>) -> Result<Self, ChatTemplateError> {
        let source: String = source.into();
        let env = environment(source.clone()).map_err(ChatTemplateError::Syntax)?;
        Ok(Self {
            env: Arc::new(env),
            source: source.into(),
            bos_token: None,
            eos_token: None,
        })
    }

    /// ChatML without a system prompt of its own: the fallback for a model that has no chat
    /// template at all, for callers that choose it (a model's own template always wins; see
    /// [`Tokenizer::apply_chat_template`](super::Tokenizer::apply_chat_template)).
    pub fn chatml() -> Self {
        // A constant that the unit tests compile and render.
        Self::from_source(CHATML).expect("the built-in ChatML template compiles")
    }

    /// The same template rendered with these texts as `bos_token` and `eos_token` (`None`
    /// leaves the variable undefined, as Hugging Face does for a token the model lacks).
    pub fn with_special_tokens(
        mut self,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Self {
        self.bos_token = bos_token;
        self.eos_token = eos_token;
        self
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The text given to the template as `bos_token`.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The text given to the template as `eos_token`.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Renders a conversation; `add_generation_prompt` asks the template to end with the
    /// opening of an assistant turn.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let template = self
            .env
            .get_template(NAME)
            .map_err(ChatTemplateError::Render)?;
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| context! { role => m.role.as_str(), content => m.content.as_str() })
            .collect();
        let token = |t: &Option<String>| t.as_deref().map_or(Value::UNDEFINED, Value::from);
        let ctx = context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => token(&self.bos_token),
            eos_token => token(&self.eos_token),
        };
        template.render(ctx).map_err(render_error)
    }
}

/// The environment Hugging Face's Jinja2 environment corresponds to, holding `source` as
/// [`NAME`]. Fails when the source does not compile.
fn environment(source: String) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    // Templates are written for Hugging Face's settings: with these, a `{% ... %}` line leaves no
    // newline or indentation behind.
    env.set_syntax(
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?,
    );
    // The output is a prompt, not HTML, whatever the template's name suggests.
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_template_owned(NAME, source)?;
    Ok(env)
}

/// The message of a `raise_exception` call, carried as the engine error's source so that
/// [`render_error`] can tell a refusal from a failure.
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

fn render_error(err: Error) -> ChatTemplateError {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = cause {
        if let Some(Raised(message)) = e.downcast_ref::<Raised>() {
            return ChatTemplateError::Raised(message.clone());
        }
        cause = e.source();
    }
    ChatTemplateError::Render(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, messages: &[ChatMessage], gen: bool) -> String {
        ChatTemplate::from_source(source)
            .unwrap()
            .render(messages, gen)
            .unwrap()
    }

    #[test]
    fn chatml_renders_every_turn_and_the_generation_prompt() {
        let chatml = ChatTemplate::chatml();
        let conversation = [
            ChatMessage::system("Be brief."),
            ChatMessage::user("hi"),
            ChatMessage::assistant("hello"),
        ];
        assert_eq!(
            chatml.render(&conversation, true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n\
             <|im_start|>assistant\nhello<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            chatml.render(&conversation[1..2], false).unwrap(),
            "<|im_start|>user\nhi<|im_end|>\n"
        );
        assert_eq!(chatml.render(&[], false).unwrap(), "");
    }

    #[test]
    fn block_lines_leave_no_whitespace_behind() {
        // trim_blocks drops the newline after a block tag; lstrip_blocks the indentation
        // before it. Without them this renders with blank lines and spaces.
        let source = "{% for m in messages %}\n    {% if m.role == 'user' %}\nU:{{ m.content }}\n    {% endif %}\n{% endfor %}";
        let out = render(
            source,
            &[
                ChatMessage::user("a"),
                ChatMessage::assistant("b"),
                ChatMessage::user("c"),
            ],
            false,
        );
        assert_eq!(out, "U:a\nU:c\n");
    }

    #[test]
    fn python_methods_and_loop_controls_work() {
        let source =
            "{% for m in messages %}{% if m.content.startswith('skip') %}{% continue %}{% endif %}\
                      [{{ m['role'].upper() }}] {{ m.content.strip() }}|{% endfor %}";
        let out = render(
            source,
            &[
                ChatMessage::user("  x  "),
                ChatMessage::user("skip me"),
                ChatMessage::assistant("y\n"),
            ],
            false,
        );
        assert_eq!(out, "[USER] x|[ASSISTANT] y|");
    }

    #[test]
    fn special_tokens_are_undefined_until_given() {
        let source =
            "{% if bos_token is defined %}{{ bos_token }}{% else %}-{% endif %}{{ eos_token }}.";
        let t = ChatTemplate::from_source(source).unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "-.");
        let t = t.with_special_tokens(Some("<s>".into()), Some("</s>".into()));
        assert_eq!(t.bos_token(), Some("<s>"));
        assert_eq!(t.render(&[], false).unwrap(), "<s></s>.");
    }

    #[test]
    fn raise_exception_is_a_refusal_with_the_template_message() {
        let t = ChatTemplate::from_source(
            "{% if messages[0].role != 'user' %}{{ raise_exception('first turn must be user') }}{% endif %}ok",
        )
        .unwrap();
        assert_eq!(t.render(&[ChatMessage::user("u")], false).unwrap(), "ok");
        let err = t.render(&[ChatMessage::assistant("a")], false).unwrap_err();
        assert!(
            matches!(&err, ChatTemplateError::Raised(m) if m == "first turn must be user"),
            "{err:?}"
        );
        assert!(err.to_string().contains("first turn must be user"), "{err}");
    }

    #[test]
    fn other_failures_are_render_or_syntax_errors_with_the_engine_message() {
        let err = ChatTemplate::from_source("{% for m in messages %}{{ m.content }}").unwrap_err();
        let ChatTemplateError::Syntax(inner) = &err else {
            panic!("{err:?}");
        };
        assert_eq!(inner.kind(), ErrorKind::SyntaxError);
        assert!(err.to_string().contains("(in chat_template:1)"), "{err}");
        // Names are looked up when rendering, as in Jinja2.
        for (source, kind) in [
            (
                "{{ messages[0].content | no_such_filter }}",
                ErrorKind::UnknownFilter,
            ),
            (
                "{{ messages[0].content.no_such_method() }}",
                ErrorKind::UnknownMethod,
            ),
            ("{{ messages[0].content + 1 }}", ErrorKind::InvalidOperation),
        ] {
            let t = ChatTemplate::from_source(source).unwrap();
            let err = t.render(&[ChatMessage::user("x")], false).unwrap_err();
            assert!(
                matches!(&err, ChatTemplateError::Render(e) if e.kind() == kind),
                "{source}: {err:?}"
            );
        }
    }
}
