//! Embeddings: the node's served embedding models (`[[embeddings]]`), reached through the
//! embeddings actor, which owns them.

use std::time::Duration;

use mesh_actors::embeddings::{EmbedFailure, EmbeddingsMsg};

use super::{Error, Kind, Service};

/// One embeddings request.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbedCall {
    /// A served embedding model's name.
    pub model: String,
    /// The texts, as given (task prefixes such as nomic's `search_query: ` are the
    /// caller's to add).
    pub input: Vec<String>,
}

/// The vectors of an [`EmbedCall`].
#[derive(Debug, Clone, PartialEq)]
pub struct EmbedReply {
    /// The model that embedded them.
    pub model: String,
    /// One L2-normalised vector per input, in order.
    pub vectors: Vec<Vec<f32>>,
    /// Tokens the model read.
    pub prompt_tokens: usize,
}

impl Service {
    /// Names of the embedding models this node serves.
    pub fn embedding_models(&self) -> &[String] {
        self.inner
            .actors
            .embeddings
            .as_ref()
            .map_or(&[], |(_, names)| names.as_slice())
    }

    /// Embeds `call.input` with `call.model`. Cancel-safe (a dropped call's vectors are
    /// computed and dropped).
    pub async fn embed(&self, call: EmbedCall) -> Result<EmbedReply, Error> {
        let Some((slot, names)) = &self.inner.actors.embeddings else {
            return Err(Error::new(
                Kind::ModelNotFound,
                format!(
                    "The model `{}` does not exist on this node: it serves no embedding model \
                     (`[[embeddings]]` in the node config, `mesh up --embedding NAME=MODEL`).",
                    call.model
                ),
            )
            .with_param("model"));
        };
        if !names.contains(&call.model) {
            return Err(Error::model_not_found(&call.model, names));
        }
        if call.input.is_empty() {
            return Err(Error::invalid(
                "`input` must hold at least one text",
                Some("input"),
            ));
        }
        let _permit = self.permit()?;
        let actor = slot
            .get()
            .ok_or_else(|| Error::unavailable("the embeddings actor is restarting; retry"))?;
        let timeout = self.settings().request_timeout;
        let model = call.model.clone();
        let r = ractor::call_t!(
            actor,
            |reply| EmbeddingsMsg::Embed {
                model: call.model,
                texts: call.input,
                reply,
            },
            u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)
        );
        let embedded = match r {
            Ok(Ok(e)) => e,
            Ok(Err(EmbedFailure::UnknownModel { model, served })) => {
                return Err(Error::model_not_found(&model, &served))
            }
            Ok(Err(EmbedFailure::BadInput(why))) => return Err(Error::invalid(why, Some("input"))),
            Ok(Err(EmbedFailure::Failed(why))) => return Err(Error::internal(why)),
            Err(ractor::RactorErr::Timeout) => {
                return Err(Error::new(
                    Kind::Unavailable,
                    format!("no embeddings within {}", secs(timeout)),
                ))
            }
            Err(e) => return Err(Error::unavailable(format!("the embeddings actor: {e}"))),
        };
        Ok(EmbedReply {
            model,
            vectors: embedded.vectors,
            prompt_tokens: embedded.tokens,
        })
    }
}

fn secs(d: Duration) -> String {
    format!("{} s", d.as_secs())
}
