//! Guest-originated requests: something inside the guest asks the desktop
//! client a question (`AgentMessage::Request`), and the client's answer
//! comes back as `HostMessage::GuestResponse` with the same id.
//!
//! [`GuestRequests`] hands out ids (`g<n>`), sends the request through the
//! outbox and parks the caller until the answer is routed back by
//! [`GuestRequests::complete`]. A caller gives up after its timeout; a
//! connection that ends fails every pending request. Answers for unknown
//! ids (late, duplicate) are dropped.
//!
//! Limits: nothing inside the guest reaches this yet; a later change wires
//! the in-guest CLI to [`GuestRequests::request`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::oneshot;

use super::outbox::Outbox;
use crate::proto::AgentMessage;
use crate::sync::MutexExt;

/// Errors of a guest-originated request.
#[derive(Debug, thiserror::Error)]
pub enum GuestRequestError {
    #[error("the host connection is closed")]
    Disconnected,
    #[error("no answer from the client within {0:?}")]
    Timeout(Duration),
    #[error("the client answered with an error: {0}")]
    Client(String),
    #[error("the client's answer is not valid JSON: {0}")]
    BadResult(serde_json::Error),
}

type Answer = Result<Value, GuestRequestError>;

/// Router of guest-originated requests; cheap to clone.
#[derive(Clone)]
pub struct GuestRequests {
    outbox: Outbox,
    pending: Arc<Mutex<HashMap<String, oneshot::Sender<Answer>>>>,
    next: Arc<AtomicU64>,
}

impl GuestRequests {
    pub(crate) fn new(outbox: Outbox) -> Self {
        Self {
            outbox,
            pending: Arc::default(),
            next: Arc::new(AtomicU64::new(1)),
        }
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<String, oneshot::Sender<Answer>>> {
        self.pending.locked()
    }

    /// Sends `method(params)` to the client and waits up to `timeout` for its answer.
    pub async fn request(&self, method: &str, params: Value, timeout: Duration) -> Answer {
        let id = format!("g{}", self.next.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = oneshot::channel();
        self.pending().insert(id.clone(), tx);
        let msg = AgentMessage::Request {
            id: id.clone(),
            method: method.to_string(),
            params,
        };
        if self.outbox.send(&msg, &[]).await.is_err() {
            self.pending().remove(&id);
            return Err(GuestRequestError::Disconnected);
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(GuestRequestError::Disconnected),
            Err(_) => {
                self.pending().remove(&id);
                Err(GuestRequestError::Timeout(timeout))
            }
        }
    }

    /// Routes the client's answer to the waiting caller. Returns false for an
    /// unknown id.
    pub fn complete(&self, id: &str, result_json: Option<String>, error: Option<String>) -> bool {
        let Some(tx) = self.pending().remove(id) else {
            tracing::debug!(id, "answer for an unknown guest request dropped");
            return false;
        };
        let answer = match (error, result_json) {
            (Some(e), _) => Err(GuestRequestError::Client(e)),
            (None, Some(j)) => serde_json::from_str(&j).map_err(GuestRequestError::BadResult),
            (None, None) => Ok(Value::Null),
        };
        let _ = tx.send(answer);
        true
    }

    /// Fails every pending request (the connection ended).
    pub fn fail_all(&self) {
        self.pending().clear();
    }

    /// Number of requests waiting for an answer.
    pub fn in_flight(&self) -> usize {
        self.pending().len()
    }
}
