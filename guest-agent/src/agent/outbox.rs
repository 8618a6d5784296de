//! The single writer of the host link.
//!
//! Every agent message — responses, process output, exits, guest requests —
//! goes through one FIFO queue into one task that owns the socket's write
//! side. Order of enqueueing is order on the wire, which is what gives the
//! protocol its guarantees (a spawn's response precedes its output; an exit
//! follows its output; a shutdown reply follows the exits).
//!
//! Memory is bounded by a byte budget ([`QUEUE_BUDGET`]): a producer waits
//! for budget before it may enqueue, and budget returns when the frame was
//! written. A slow host therefore slows the producers down (process pipes
//! fill up and the processes block), instead of growing the agent's memory.
//! The writer drains several queued frames into one `writev`
//! (`MAX_BATCH_FRAMES`, `MAX_BATCH_BYTES`).

use std::io::IoSlice;
use std::sync::Arc;

use serde::Serialize;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

use super::fdio::FdIo;
use crate::proto;

/// Most bytes of encoded frames queued but not yet written.
pub const QUEUE_BUDGET: usize = 16 * 1024 * 1024;

/// Smallest budget charge of one frame, so floods of tiny frames are bounded too.
const MIN_FRAME_COST: usize = 256;

/// Most frames merged into one `writev`.
const MAX_BATCH_FRAMES: usize = 64;

/// Most bytes merged into one `writev`.
const MAX_BATCH_BYTES: usize = 4 * 1024 * 1024;

/// Errors of the outbox.
#[derive(Debug, thiserror::Error)]
pub enum OutboxError {
    /// The writer stopped (the host link failed or the agent is exiting).
    #[error("the connection to the host is closed")]
    Closed,
    /// A frame larger than the link's limit was refused.
    #[error("message of {0} bytes exceeds the link's frame limit")]
    TooLarge(usize),
}

enum Item {
    Frame {
        bytes: Vec<u8>,
        _permit: OwnedSemaphorePermit,
    },
    Flush(oneshot::Sender<()>),
}

/// The sending side of the host link; cheap to clone.
#[derive(Clone)]
pub struct Outbox {
    tx: mpsc::UnboundedSender<Item>,
    budget: Arc<Semaphore>,
}

impl Outbox {
    /// Starts the writer task on `io`. The task ends when every `Outbox`
    /// clone is dropped (after writing what was queued) or a write fails.
    pub fn start(io: FdIo) -> (Outbox, JoinHandle<std::io::Result<()>>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let budget = Arc::new(Semaphore::new(QUEUE_BUDGET));
        let task = tokio::spawn(writer(io, rx, budget.clone()));
        (Outbox { tx, budget }, task)
    }

    /// Queues a complete frame (length prefix included), waiting for budget.
    pub async fn send_frame(&self, bytes: Vec<u8>) -> Result<(), OutboxError> {
        if bytes.len() > proto::MAX_MESSAGE + crate::framing::PREFIX_LEN {
            return Err(OutboxError::TooLarge(bytes.len()));
        }
        let cost = bytes.len().clamp(MIN_FRAME_COST, QUEUE_BUDGET) as u32;
        let permit = self
            .budget
            .clone()
            .acquire_many_owned(cost)
            .await
            .map_err(|_| OutboxError::Closed)?;
        self.tx
            .send(Item::Frame {
                bytes,
                _permit: permit,
            })
            .map_err(|_| OutboxError::Closed)
    }

    /// Encodes and queues one message with its payload.
    pub async fn send<T: Serialize>(&self, header: &T, payload: &[u8]) -> Result<(), OutboxError> {
        let mut frame = Vec::with_capacity(128 + payload.len());
        proto::encode_frame_into(&mut frame, header, payload);
        self.send_frame(frame).await
    }

    /// Waits until everything queued before this call was written.
    pub async fn flush(&self) -> Result<(), OutboxError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Item::Flush(tx))
            .map_err(|_| OutboxError::Closed)?;
        rx.await.map_err(|_| OutboxError::Closed)
    }

    /// Whether the writer is gone.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

async fn writer(
    io: FdIo,
    rx: mpsc::UnboundedReceiver<Item>,
    budget: Arc<Semaphore>,
) -> std::io::Result<()> {
    let res = write_all_queued(io, rx).await;
    // Producers waiting for budget must learn that nothing will be written.
    budget.close();
    res
}

async fn write_all_queued(io: FdIo, mut rx: mpsc::UnboundedReceiver<Item>) -> std::io::Result<()> {
    let mut batch: Vec<Item> = Vec::with_capacity(MAX_BATCH_FRAMES);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        let mut bytes = 0;
        while batch.len() < MAX_BATCH_FRAMES && bytes < MAX_BATCH_BYTES {
            match rx.try_recv() {
                Ok(item) => {
                    if let Item::Frame { bytes: b, .. } = &item {
                        bytes += b.len();
                    }
                    batch.push(item);
                }
                Err(_) => break,
            }
        }
        let mut slices: Vec<IoSlice<'_>> = batch
            .iter()
            .filter_map(|i| match i {
                Item::Frame { bytes, .. } if !bytes.is_empty() => Some(IoSlice::new(bytes)),
                _ => None,
            })
            .collect();
        let res = io.writev_all(&mut slices).await;
        drop(slices);
        // Frames are written: release their budget, then wake flushers.
        for item in batch.drain(..) {
            if let Item::Flush(done) = item {
                let _ = done.send(());
            }
        }
        if let Err(e) = res {
            tracing::warn!(error = %e, "writing to the host failed");
            return Err(e);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::framing;
    use crate::proto::AgentMessage;

    #[tokio::test]
    async fn frames_arrive_in_order_and_flush_waits() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let (outbox, task) = Outbox::start(FdIo::new(a.into()).unwrap());
        for i in 0..100u32 {
            let msg = AgentMessage::Stdout {
                id: format!("p{i}"),
            };
            outbox.send(&msg, &i.to_be_bytes()).await.unwrap();
        }
        outbox.flush().await.unwrap();
        drop(outbox);
        task.await.unwrap().unwrap();
        let mut r = FdIo::new(b.into()).unwrap().reader();
        let mut buf = Vec::new();
        for i in 0..100u32 {
            assert!(framing::read_frame(&mut r, proto::MAX_MESSAGE, &mut buf)
                .await
                .unwrap());
            let env: proto::Envelope<AgentMessage> = proto::decode(buf.clone()).unwrap();
            assert_eq!(
                env.header,
                AgentMessage::Stdout {
                    id: format!("p{i}")
                }
            );
            assert_eq!(env.payload, i.to_be_bytes());
        }
        assert!(!framing::read_frame(&mut r, proto::MAX_MESSAGE, &mut buf)
            .await
            .unwrap());
    }

    #[tokio::test]
    async fn a_dead_link_releases_waiting_producers() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let (outbox, task) = Outbox::start(FdIo::new(a.into()).unwrap());
        let chunk = vec![0u8; proto::MAX_CHUNK];
        let msg = AgentMessage::Stdout { id: "p".into() };
        // Fill the socket and the budget until a send waits.
        loop {
            let fut = outbox.send(&msg, &chunk);
            if tokio::time::timeout(std::time::Duration::from_millis(100), fut)
                .await
                .is_err()
            {
                break;
            }
        }
        let waiting = {
            let outbox = outbox.clone();
            let chunk = chunk.clone();
            tokio::spawn(async move {
                outbox
                    .send(&AgentMessage::Stdout { id: "p".into() }, &chunk)
                    .await
            })
        };
        drop(b); // the host goes away: the writer's next write fails
        assert!(task.await.unwrap().is_err());
        let res = tokio::time::timeout(std::time::Duration::from_secs(5), waiting).await;
        assert!(matches!(res, Ok(Ok(Err(OutboxError::Closed)))), "{res:?}");
    }

    #[tokio::test]
    async fn a_slow_reader_bounds_the_queue() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let (outbox, _task) = Outbox::start(FdIo::new(a.into()).unwrap());
        // Nobody reads `_b`: after the socket buffer and the budget are full,
        // a further send must wait instead of queueing without bound.
        let chunk = vec![0u8; proto::MAX_CHUNK];
        let mut sent = 0usize;
        let blocked = loop {
            let msg = AgentMessage::Stdout { id: "p".into() };
            let fut = outbox.send(&msg, &chunk);
            match tokio::time::timeout(std::time::Duration::from_millis(200), fut).await {
                Ok(r) => {
                    r.unwrap();
                    sent += chunk.len();
                }
                Err(_) => break true,
            }
            if sent > 20 * QUEUE_BUDGET {
                break false;
            }
        };
        assert!(
            blocked,
            "the outbox accepted {sent} bytes without backpressure"
        );
        assert!(sent <= QUEUE_BUDGET + 64 * 1024 * 1024, "{sent}");
    }
}
