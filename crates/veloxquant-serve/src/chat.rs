//! Chat prompts: the GGUF's `tokenizer.chat_template` (Jinja, rendered by minijinja), and
//! the rendered text tokenized with its special tokens (`<|im_start|>` …) as their ids.

use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde::Serialize;
use veloxquant_llm::Tokenizer;

use crate::error::{Result, ServeError};

/// ChatML, for a model whose GGUF carries no template.
const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Bound on a template's source (templates of real models are a few KiB).
const MAX_TEMPLATE_BYTES: usize = 64 << 10;

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    /// Special tokens by text, longest first (so a longer one wins at the same place).
    specials: Vec<(String, u32)>,
}

impl ChatTemplate {
    /// `source`: the GGUF's template, or None for ChatML.
    pub fn new(source: Option<&str>, tok: &Tokenizer) -> Result<Self> {
        let source = source.unwrap_or(CHATML);
        if source.len() > MAX_TEMPLATE_BYTES {
            return Err(ServeError::Template(format!(
                "template of {} bytes exceeds {MAX_TEMPLATE_BYTES}",
                source.len()
            )));
        }
        let mut env = Environment::new();
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source.to_string()).map_err(|e| ServeError::Template(e.to_string()))?;
        let text = |id: Option<u32>| id.and_then(|i| tok.decode(&[i]).ok()).unwrap_or_default();
        let mut specials: Vec<(String, u32)> = (0..tok.n_vocab() as u32)
            .filter(|&i| tok.is_control(i))
            .filter_map(|i| tok.decode(&[i]).ok().filter(|s| !s.is_empty()).map(|s| (s, i)))
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let bos = text(tok.add_bos);
        Ok(Self { env, bos, eos: text(tok.eos), specials })
    }

    /// The prompt text for `messages`, ending with the assistant's turn opened. A template
    /// error (e.g. its own `raise_exception` on a bad role order) is the client's fault.
    pub fn render(&self, messages: &[Message]) -> std::result::Result<String, String> {
        let t = self.env.get_template("chat").map_err(|e| e.to_string())?;
        t.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos,
            eos_token => self.eos,
        })
        .map_err(|e| format!("chat template: {e}"))
    }

    /// Tokenizes rendered text: special-token text becomes its id, the rest is encoded
    /// plainly; BOS is prepended when the model asks for it and the text lacks it.
    pub fn encode(&self, tok: &Tokenizer, text: &str) -> veloxquant_llm::Result<Vec<u32>> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let next = self
                .specials
                .iter()
                .filter_map(|(s, id)| rest.find(s.as_str()).map(|p| (p, s.len(), *id)))
                .min_by_key(|&(p, len, _)| (p, usize::MAX - len));
            match next {
                Some((p, len, id)) => {
                    if p > 0 {
                        out.extend(tok.encode_raw(&rest[..p])?);
                    }
                    out.push(id);
                    rest = &rest[p + len..];
                }
                None => {
                    out.extend(tok.encode_raw(rest)?);
                    break;
                }
            }
        }
        if let Some(b) = tok.add_bos {
            if out.first() != Some(&b) {
                out.insert(0, b);
            }
        }
        Ok(out)
    }
}
