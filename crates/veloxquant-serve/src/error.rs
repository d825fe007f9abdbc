//! Errors: the crate's own (`ServeError`) and what a client sees (`ApiError`, OpenAI's
//! `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// Failures of the server itself (start-up, the engine).
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("model: {0}")]
    Llm(#[from] veloxquant_llm::LlmError),
    #[error("cache: {0}")]
    Cache(#[from] veloxquant::VqError),
    #[error("chat template: {0}")]
    Template(String),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("engine: {0}")]
    Engine(String),
}

pub type Result<T> = std::result::Result<T, ServeError>;

/// An error answered to a client.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: invalid_request_error, authentication_error, not_found_error, …
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub param: Option<&'static str>,
    /// Seconds for a Retry-After header (503 when the queue is full).
    pub retry_after: Option<u32>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), kind, code: None, param: None, retry_after: None }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }
    pub fn invalid_param(param: &'static str, message: impl Into<String>) -> Self {
        Self { param: Some(param), ..Self::bad_request(message) }
    }
    pub fn context_length(message: impl Into<String>) -> Self {
        Self { code: Some("context_length_exceeded"), param: Some("messages"), ..Self::bad_request(message) }
    }
    pub fn unauthorized() -> Self {
        Self {
            code: Some("invalid_api_key"),
            ..Self::new(StatusCode::UNAUTHORIZED, "authentication_error", "missing or invalid API key")
        }
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found_error", message)
    }
    pub fn model_not_found(model: &str) -> Self {
        Self {
            code: Some("model_not_found"),
            param: Some("model"),
            ..Self::not_found(format!("the model `{model}` does not exist (see /v1/models)"))
        }
    }
    pub fn busy(message: impl Into<String>) -> Self {
        Self {
            code: Some("server_busy"),
            retry_after: Some(1),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
        }
    }
    pub fn timeout() -> Self {
        Self {
            code: Some("timeout"),
            ..Self::new(StatusCode::GATEWAY_TIMEOUT, "server_error", "the request exceeded the server's time limit")
        }
    }
    pub fn not_implemented(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_IMPLEMENTED, "not_implemented_error", message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }
    pub fn with_status(status: StatusCode, message: impl Into<String>) -> Self {
        let kind = if status.is_server_error() { "server_error" } else { "invalid_request_error" };
        Self::new(status, kind, message)
    }

    /// The JSON body (also sent as an SSE event when a stream fails midway).
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}
