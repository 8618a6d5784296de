//! Per-profile event fan-out to subscription connections.
//!
//! Events are serialized once into a complete frame (length prefix + JSON)
//! and shared by every subscriber. Each subscriber has a bounded queue;
//! publishing waits for room (backpressure reaches the agent instead of
//! growing memory) but gives up on a subscriber that stays stuck for
//! [`STUCK_SUBSCRIBER`], dropping it.
//!
//! Nothing is lost between `startVM` and a subscription that arrives a little
//! later: while a profile has no subscriber, events are kept in a bounded
//! buffer ([`UNDELIVERED_MAX_EVENTS`] / [`UNDELIVERED_MAX_BYTES`], oldest
//! dropped first) and handed to the next subscriber. Events that were
//! delivered are not replayed (a resubscribing client would otherwise see
//! output twice), except the latest `networkStatus` and `apiReachability`,
//! which describe current state and are sent to every new subscriber.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::mpsc;
use vmm::sync::MutexExt;

/// A complete frame ready to write.
pub type Frame = Arc<Vec<u8>>;

/// Queue depth per subscriber, in frames. An output frame carries up to one
/// agent chunk (256 KiB of text, a little more once escaped), so this bounds
/// what a slow subscriber can make the helper hold to about 9 MiB.
pub const SUBSCRIBER_QUEUE: usize = 32;

/// Events kept for the next subscriber while none is connected.
pub const UNDELIVERED_MAX_EVENTS: usize = 1024;

/// Byte cap of that buffer.
pub const UNDELIVERED_MAX_BYTES: usize = 8 * 1024 * 1024;

/// A subscriber whose queue stays full this long is dropped.
pub const STUCK_SUBSCRIBER: Duration = Duration::from_secs(30);

/// Encodes an event as a frame.
pub fn frame(event: &Value) -> Frame {
    let body = serde_json::to_vec(event).unwrap_or_default();
    let mut out = Vec::with_capacity(body.len() + 4);
    guest_agent::framing::encode_frame_into(&mut out, &body);
    Arc::new(out)
}

/// Encodes a `stdout`/`stderr` event without building a JSON tree: this is
/// the hot path of process output.
pub fn output_frame(stream: &str, id: &str, data: &str) -> Frame {
    let mut out = Vec::with_capacity(data.len() + data.len() / 8 + id.len() + 48);
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(b"{\"type\":\"");
    out.extend_from_slice(stream.as_bytes());
    out.extend_from_slice(b"\",\"id\":");
    push_json_str(&mut out, id);
    out.extend_from_slice(b",\"data\":");
    push_json_str(&mut out, data);
    out.push(b'}');
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_be_bytes());
    Arc::new(out)
}

/// Every byte of a word set to 0x01.
const ONES: u64 = 0x0101_0101_0101_0101;
/// Every byte of a word set to 0x80.
const HIGHS: u64 = 0x8080_8080_8080_8080;

/// Whether any byte of `w` needs escaping in a JSON string: a control
/// character (< 0x20), `"` or `\`. SWAR: the classic "has a byte less than
/// n" and "has a zero byte" tests, exact for detecting presence.
#[inline]
fn word_needs_escape(w: u64) -> bool {
    let below_space = w.wrapping_sub(ONES * 0x20) & !w & HIGHS;
    let q = w ^ (ONES * u64::from(b'"'));
    let quote = q.wrapping_sub(ONES) & !q & HIGHS;
    let b = w ^ (ONES * u64::from(b'\\'));
    let backslash = b.wrapping_sub(ONES) & !b & HIGHS;
    (below_space | quote | backslash) != 0
}

/// Appends `s` as a JSON string literal (RFC 8259 escaping), skipping
/// eight clean bytes at a time: process output is mostly plain text.
pub fn push_json_str(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = s.as_bytes();
    out.push(b'"');
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        if let Some(chunk) = bytes.get(i..i + 8) {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            if !word_needs_escape(u64::from_le_bytes(word)) {
                i += 8;
                continue;
            }
        }
        let c = bytes[i];
        let escape: &[u8] = match c {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0x00..=0x1f => b"",
            _ => {
                i += 1;
                continue;
            }
        };
        out.extend_from_slice(&bytes[start..i]);
        if escape.is_empty() {
            out.extend_from_slice(b"\\u00");
            out.push(HEX[usize::from(c >> 4)]);
            out.push(HEX[usize::from(c & 0xf)]);
        } else {
            out.extend_from_slice(escape);
        }
        i += 1;
        start = i;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

#[derive(Default)]
struct Inner {
    subscribers: Vec<(u64, mpsc::Sender<Frame>)>,
    next_id: u64,
    undelivered: VecDeque<Frame>,
    undelivered_bytes: usize,
    network_status: Option<Frame>,
    api_reachability: Option<Frame>,
}

/// Fan-out point of one profile.
#[derive(Default)]
pub struct EventHub {
    inner: Mutex<Inner>,
}

/// A subscription's receiving end.
pub struct Subscriber {
    pub id: u64,
    pub rx: mpsc::Receiver<Frame>,
}

impl EventHub {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.locked()
    }

    /// Registers a subscriber and queues what it must see first.
    pub fn subscribe(&self) -> Subscriber {
        let mut inner = self.lock();
        let backlog = inner.undelivered.len();
        let (tx, rx) = mpsc::channel(SUBSCRIBER_QUEUE + backlog + 2);
        let undelivered = std::mem::take(&mut inner.undelivered);
        inner.undelivered_bytes = 0;
        let mut sent_state = (false, false);
        for f in &undelivered {
            sent_state.0 |= inner
                .network_status
                .as_ref()
                .is_some_and(|s| Arc::ptr_eq(s, f));
            sent_state.1 |= inner
                .api_reachability
                .as_ref()
                .is_some_and(|s| Arc::ptr_eq(s, f));
        }
        if !sent_state.0 {
            if let Some(f) = &inner.network_status {
                let _ = tx.try_send(f.clone());
            }
        }
        if !sent_state.1 {
            if let Some(f) = &inner.api_reachability {
                let _ = tx.try_send(f.clone());
            }
        }
        for f in undelivered {
            let _ = tx.try_send(f);
        }
        let id = inner.next_id;
        inner.next_id += 1;
        inner.subscribers.push((id, tx));
        Subscriber { id, rx }
    }

    /// Removes a subscriber (its connection closed).
    pub fn unsubscribe(&self, id: u64) {
        self.lock().subscribers.retain(|(sid, _)| *sid != id);
    }

    /// Number of live subscribers.
    pub fn subscriber_count(&self) -> usize {
        self.lock().subscribers.len()
    }

    /// Publishes an event to every subscriber, or keeps it for the next one.
    pub async fn publish(&self, event: &Value) {
        self.publish_frame(frame(event), event.get("type").and_then(Value::as_str))
            .await
    }

    /// Publishes a pre-encoded output frame (see [`output_frame`]).
    pub async fn publish_output(&self, f: Frame) {
        self.publish_frame(f, None).await
    }

    async fn publish_frame(&self, f: Frame, kind: Option<&str>) {
        let targets: Vec<(u64, mpsc::Sender<Frame>)> = {
            let mut inner = self.lock();
            match kind {
                Some("networkStatus") => inner.network_status = Some(f.clone()),
                Some("apiReachability") => inner.api_reachability = Some(f.clone()),
                _ => {}
            }
            if inner.subscribers.is_empty() {
                inner.undelivered_bytes += f.len();
                inner.undelivered.push_back(f);
                while inner.undelivered.len() > UNDELIVERED_MAX_EVENTS
                    || inner.undelivered_bytes > UNDELIVERED_MAX_BYTES
                {
                    match inner.undelivered.pop_front() {
                        Some(old) => inner.undelivered_bytes -= old.len(),
                        None => break,
                    }
                }
                return;
            }
            inner.subscribers.clone()
        };
        let mut dead = Vec::new();
        for (id, tx) in &targets {
            let ok = match tx.try_send(f.clone()) {
                Ok(()) => true,
                Err(mpsc::error::TrySendError::Closed(_)) => false,
                Err(mpsc::error::TrySendError::Full(f)) => {
                    matches!(
                        tokio::time::timeout(STUCK_SUBSCRIBER, tx.send(f)).await,
                        Ok(Ok(()))
                    )
                }
            };
            if !ok {
                tracing::warn!(
                    subscriber = id,
                    "dropping event subscriber that stopped reading"
                );
                dead.push(*id);
            }
        }
        if !dead.is_empty() {
            self.lock().subscribers.retain(|(id, _)| !dead.contains(id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(f: &Frame) -> Value {
        serde_json::from_slice(&f[4..]).unwrap()
    }

    #[tokio::test]
    async fn late_subscriber_gets_undelivered_events_once() {
        let hub = EventHub::default();
        hub.publish(&json!({"type": "startupStep", "step": "vm_boot", "status": "started"}))
            .await;
        hub.publish(&json!({"type": "networkStatus", "status": "connected"}))
            .await;
        let mut s = hub.subscribe();
        assert_eq!(body(&s.rx.recv().await.unwrap())["type"], "startupStep");
        assert_eq!(body(&s.rx.recv().await.unwrap())["type"], "networkStatus");
        assert!(s.rx.try_recv().is_err());
        hub.publish(&json!({"type": "stdout", "id": "a", "data": "x"}))
            .await;
        assert_eq!(body(&s.rx.recv().await.unwrap())["data"], "x");
        hub.unsubscribe(s.id);
        // A resubscriber sees current state, not the output it already had.
        let mut s2 = hub.subscribe();
        assert_eq!(body(&s2.rx.recv().await.unwrap())["type"], "networkStatus");
        assert!(s2.rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn undelivered_buffer_is_bounded() {
        let hub = EventHub::default();
        for i in 0..UNDELIVERED_MAX_EVENTS + 10 {
            hub.publish(&json!({"type": "stdout", "id": "a", "data": i.to_string()}))
                .await;
        }
        let mut s = hub.subscribe();
        assert_eq!(body(&s.rx.recv().await.unwrap())["data"], "10");
    }

    #[test]
    fn output_frame_matches_generic_encoding() {
        let f = output_frame("stdout", "p\"1", "a\nb\u{1}✓");
        assert_eq!(
            body(&f),
            json!({"type": "stdout", "id": "p\"1", "data": "a\nb\u{1}✓"})
        );
        assert_eq!(
            u32::from_be_bytes([f[0], f[1], f[2], f[3]]) as usize,
            f.len() - 4
        );
    }

    #[test]
    fn json_escaping_matches_serde_json() {
        let mut samples: Vec<String> = vec![
            String::new(),
            "plain ascii text that is longer than eight bytes".into(),
            "quote\" back\\slash\n\r\t\u{8}\u{c}\u{0}\u{1f}\u{7f} ✓ 𝄞".into(),
        ];
        // Every byte value at every offset within a word.
        for b in 0u8..0x80 {
            for pad in 0..9 {
                let mut t = "x".repeat(pad);
                t.push(char::from(b));
                t.push_str("tail-of-text");
                samples.push(t);
            }
        }
        for t in samples {
            let mut ours = Vec::new();
            push_json_str(&mut ours, &t);
            let theirs = serde_json::to_vec(&t).unwrap();
            let back: String = serde_json::from_slice(&ours).unwrap();
            assert_eq!(back, t);
            assert_eq!(ours.len(), theirs.len(), "{t:?}");
        }
    }

    #[tokio::test]
    async fn closed_subscribers_are_dropped() {
        let hub = EventHub::default();
        let s = hub.subscribe();
        drop(s.rx);
        hub.publish(&json!({"type": "stdout"})).await;
        assert_eq!(hub.subscriber_count(), 0);
    }
}
