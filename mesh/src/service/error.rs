//! The service layer's one error type: a closed set of kinds the HTTP layer maps to
//! statuses and OpenAI's error codes (`crate::http::error`), with a reason a caller can act
//! on and, for bad input, the offending parameter.

use mesh_actors::tuner::TuneError;
use mesh_tiers::TierError;

/// What went wrong, as a class the HTTP layer has one status and code for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The request is malformed or asks for something this node does not do.
    InvalidRequest,
    /// No API key, or not one of this node's.
    Unauthenticated,
    /// The key may not do this (a scope it lacks, a tool it may not run).
    PermissionDenied,
    /// Prompt + completion budget exceed the model's context.
    ContextLengthExceeded,
    /// No node knows the model.
    ModelNotFound,
    /// Too many requests in flight (gateway permits or a full engine queue), or a key over its
    /// rate or concurrency; retry later.
    RateLimited,
    /// The request body is larger than the node takes.
    PayloadTooLarge,
    /// The model is known but no node can serve it now (restarting, lost).
    Unavailable,
    /// The tuner is switched off on this node.
    TunerDisabled,
    /// A tuning cycle or a policy reload is running; retry when it ends.
    TuningInProgress,
    /// A policy needs an engine that could not start.
    EngineStartFailed,
    /// Something the node needs for the call is missing (probe tasks, a probe model).
    NotReady,
    /// A bug or an I/O failure on this node.
    Internal,
}

/// An error of the service layer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct Error {
    /// Its class.
    pub kind: Kind,
    /// What went wrong and what to do about it.
    pub message: String,
    /// The request field at fault, when there is one (`messages[2].role`).
    pub param: Option<String>,
    /// Seconds after which a retry may succeed.
    pub retry_after: Option<u64>,
}

impl Error {
    /// An error of `kind`.
    pub fn new(kind: Kind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            param: None,
            retry_after: None,
        }
    }

    /// A bad request naming the field at fault.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            param: param.map(str::to_owned),
            ..Self::new(Kind::InvalidRequest, message)
        }
    }

    /// With the offending parameter.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// With a retry hint.
    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// `model` is unknown; `available` lists what this node can route to.
    pub fn model_not_found(model: &str, available: &[String]) -> Self {
        Self::new(
            Kind::ModelNotFound,
            format!(
                "The model `{model}` does not exist on this node. Available: {}",
                available.join(", ")
            ),
        )
        .with_param("model")
    }

    /// The model is known but nothing serves it now.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(Kind::Unavailable, message).retry_after(1)
    }

    /// Too many requests.
    pub fn busy(message: impl Into<String>, retry_after: u64) -> Self {
        Self::new(Kind::RateLimited, message).retry_after(retry_after)
    }

    /// A 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Kind::Internal, message)
    }

    /// A tier's refusal, as the client should see it.
    pub fn from_tier(e: TierError, retry_after: u64) -> Self {
        match e {
            TierError::ContextExceeded {
                prompt,
                max_tokens,
                limit,
            } => Self::new(
                Kind::ContextLengthExceeded,
                format!(
                    "This model's maximum context length is {limit} tokens. However, you requested {} tokens ({prompt} in the messages, {max_tokens} in the completion).",
                    prompt + max_tokens
                ),
            )
            .with_param("messages"),
            TierError::Overloaded(n) => Self::busy(
                format!("The tier is busy ({n} requests queued); retry later."),
                retry_after,
            ),
            TierError::InvalidRequest(m) => Self::invalid(m, None),
            TierError::EngineStopped => Self::unavailable("The tier is restarting; retry shortly."),
            other => Self::internal(other.to_string()),
        }
    }
}

/// Why the tuner did not run a cycle or a reload, as a caller should see it.
impl From<TuneError> for Error {
    fn from(e: TuneError) -> Self {
        let message = e.to_string();
        match e {
            TuneError::Disabled => Self::new(Kind::TunerDisabled, message),
            TuneError::InProgress => Self::new(Kind::TuningInProgress, message),
            TuneError::Invalid { param, .. } => Self {
                param,
                ..Self::new(Kind::InvalidRequest, message)
            },
            TuneError::NotReady(_) => Self::new(Kind::NotReady, message),
            TuneError::EngineStart(_) => {
                Self::new(Kind::EngineStartFailed, message).with_param("quantization")
            }
            TuneError::Internal(_) => Self::internal(message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuner_refusals_keep_their_class_reason_and_field() {
        let cases = [
            (TuneError::Disabled, Kind::TunerDisabled, None),
            (TuneError::InProgress, Kind::TuningInProgress, None),
            (
                TuneError::Invalid {
                    message: "unknown knob `x`".into(),
                    param: Some("knob".into()),
                },
                Kind::InvalidRequest,
                Some("knob"),
            ),
            (
                TuneError::NotReady("no probe tasks".into()),
                Kind::NotReady,
                None,
            ),
            (
                TuneError::EngineStart("t1-q4_0.gguf: no such file".into()),
                Kind::EngineStartFailed,
                Some("quantization"),
            ),
            (
                TuneError::Internal("disk full".into()),
                Kind::Internal,
                None,
            ),
        ];
        for (tune, kind, param) in cases {
            let message = tune.to_string();
            let e = Error::from(tune);
            assert_eq!(e.kind, kind, "{message}");
            assert_eq!(e.message, message);
            assert_eq!(e.param.as_deref(), param, "{message}");
            assert_eq!(e.retry_after, None, "{message}");
        }
    }
}
