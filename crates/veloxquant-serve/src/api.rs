//! OpenAI request bodies and their validation into what the scheduler runs.

use serde::Deserialize;

use crate::chat::Message;
use crate::error::ApiError;
use crate::sampling::SamplingParams;

/// Bounds checked before anything is allocated for a request.
pub const MAX_STOPS: usize = 4;
pub const MAX_STOP_BYTES: usize = 256;
pub const MAX_MESSAGES: usize = 1024;

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Debug, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields shared by both endpoints (unknown fields are ignored, as OpenAI-compatible servers do).
#[derive(Deserialize, Debug, Default)]
pub struct Params {
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<StopInput>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u64>,
    /// llama-server's name: the slot whose cache this request continues and leaves behind.
    pub id_slot: Option<i64>,
}

#[derive(Deserialize, Debug)]
pub struct CompletionRequest {
    pub prompt: PromptInput,
    #[serde(flatten)]
    pub params: Params,
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum ContentInput {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize, Debug)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Deserialize, Debug)]
pub struct MessageInput {
    pub role: String,
    pub content: Option<ContentInput>,
}

#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    pub messages: Vec<MessageInput>,
    #[serde(flatten)]
    pub params: Params,
}

/// What a request asks for, validated (the prompt is tokenized separately).
#[derive(Clone, Debug)]
pub struct Validated {
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub slot: Option<usize>,
}

impl Params {
    /// Checks every field's range; `random_seed` is used when the request gives none.
    pub fn validate(&self, max_slots: usize, random_seed: u64) -> Result<Validated, ApiError> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid_param("n", "only n = 1 is supported"));
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid_param("temperature", format!("temperature {temperature} is not in [0, 2]")));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid_param("top_p", format!("top_p {top_p} is not in (0, 1]")));
        }
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => return Err(ApiError::invalid_param("top_k", format!("top_k {k} must be ≥ 0 (or -1: off)"))),
        };
        let max_tokens = match self.max_completion_tokens.or(self.max_tokens) {
            Some(0) => return Err(ApiError::invalid_param("max_tokens", "max_tokens must be ≥ 1")),
            Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            None => None,
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopInput::One(s)) => vec![s.clone()],
            Some(StopInput::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOPS || stop.iter().any(|s| s.len() > MAX_STOP_BYTES) {
            return Err(ApiError::invalid_param(
                "stop",
                format!("at most {MAX_STOPS} stop sequences of at most {MAX_STOP_BYTES} bytes"),
            ));
        }
        let slot = match self.id_slot {
            None | Some(-1) => None,
            Some(s) if s >= 0 && (s as u64) < max_slots as u64 => Some(s as usize),
            Some(s) => return Err(ApiError::invalid_param("id_slot", format!("id_slot {s} is not in 0..{max_slots}"))),
        };
        let seed = self.seed.map(|s| s as u64).unwrap_or(random_seed);
        Ok(Validated {
            max_tokens,
            sampling: SamplingParams { temperature: temperature as f32, top_p: top_p as f32, top_k, seed },
            stop,
            stream: self.stream,
            include_usage: self.stream_options.as_ref().is_some_and(|o| o.include_usage),
            slot,
        })
    }
}

impl ChatRequest {
    /// The messages as the template sees them (text parts joined).
    pub fn messages(&self) -> Result<Vec<Message>, ApiError> {
        if self.messages.is_empty() || self.messages.len() > MAX_MESSAGES {
            return Err(ApiError::invalid_param("messages", format!("1 to {MAX_MESSAGES} messages are required")));
        }
        self.messages
            .iter()
            .map(|m| {
                let content = match &m.content {
                    None => String::new(),
                    Some(ContentInput::Text(s)) => s.clone(),
                    Some(ContentInput::Parts(parts)) => {
                        let mut s = String::new();
                        for p in parts {
                            match (p.kind.as_str(), &p.text) {
                                ("text", Some(t)) => s.push_str(t),
                                (kind, _) => {
                                    return Err(ApiError::invalid_param(
                                        "messages",
                                        format!("content part of type {kind:?} is not supported (text only)"),
                                    ))
                                }
                            }
                        }
                        s
                    }
                };
                Ok(Message { role: m.role.clone(), content })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(json: &str) -> Params {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn defaults_and_ranges() {
        let v = params("{}").validate(8, 42).unwrap();
        assert_eq!((v.sampling.temperature, v.sampling.top_p, v.sampling.top_k, v.sampling.seed), (1.0, 1.0, 0, 42));
        assert!(v.stop.is_empty() && !v.stream && v.max_tokens.is_none() && v.slot.is_none());
        let v = params(r#"{"temperature":0,"stop":"\n","seed":5,"max_tokens":3,"id_slot":2,"top_k":-1}"#)
            .validate(8, 1)
            .unwrap();
        assert_eq!((v.sampling.seed, v.max_tokens, v.slot, v.stop), (5, Some(3), Some(2), vec!["\n".to_string()]));
        for (bad, param) in [
            (r#"{"n":2}"#, "n"),
            (r#"{"temperature":2.5}"#, "temperature"),
            (r#"{"top_p":0}"#, "top_p"),
            (r#"{"top_k":-3}"#, "top_k"),
            (r#"{"max_tokens":0}"#, "max_tokens"),
            (r#"{"stop":["a","b","c","d","e"]}"#, "stop"),
            (r#"{"id_slot":8}"#, "id_slot"),
        ] {
            let e = params(bad).validate(8, 1).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param), (400, Some(param)), "{bad}");
        }
    }

    #[test]
    fn prompts_and_messages_parse() {
        let r: CompletionRequest = serde_json::from_str(r#"{"prompt":[1,2,3],"stream":true}"#).unwrap();
        assert!(matches!(r.prompt, PromptInput::Tokens(ref t) if t == &[1, 2, 3]) && r.params.stream);
        let c: ChatRequest = serde_json::from_str(
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"text","text":"!"}]}]}"#,
        )
        .unwrap();
        assert_eq!(c.messages().unwrap(), vec![Message { role: "user".into(), content: "hi!".into() }]);
        let c: ChatRequest = serde_json::from_str(r#"{"messages":[]}"#).unwrap();
        assert_eq!(c.messages().unwrap_err().status.as_u16(), 400);
    }
}
