//! The loop every in-process device runs when a queue is kicked: serve each
//! available descriptor chain, return it on the used ring, and re-arm
//! notifications without losing a chain the driver added meanwhile.
//!
//! With notifications suppressed (`VIRTIO_RING_F_EVENT_IDX` or the
//! `NO_NOTIFY` flag) the driver does not kick for chains it adds while the
//! device is busy, so after turning notifications back on the device must
//! look at the available ring once more; [`drain`] repeats until a re-check
//! finds nothing. Whether the driver then wants an interrupt is for the
//! caller to act on (it owns the interrupt line).
//!
//! Limits: one chain at a time, in ring order; split queues only (as the
//! rest of [`super`]).

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::GuestMemory;

/// Serves every available chain of `q`, in order, until the ring stays
/// empty after notifications are re-enabled.
///
/// `serve` handles one chain and returns the number of bytes it wrote into
/// the chain's writable buffers (the used length); its error ends the drain.
/// When putting a served chain on the used ring fails (the driver gave an
/// out-of-range head or corrupted the ring), `add_used_failed` decides:
/// `Ok(())` skips that chain and goes on, an error ends the drain. `qerr`
/// turns the queue's own errors (unreadable rings) into the caller's.
///
/// Returns whether any chain was used and the driver asked to be notified
/// of it.
pub fn drain<'m, M: GuestMemory, E>(
    q: &mut Queue,
    mem: &'m M,
    qerr: impl Fn(virtio_queue::Error) -> E,
    mut serve: impl FnMut(DescriptorChain<&'m M>) -> Result<u32, E>,
    mut add_used_failed: impl FnMut(u16, virtio_queue::Error) -> Result<(), E>,
) -> Result<bool, E> {
    let mut used = false;
    loop {
        q.disable_notification(mem).map_err(&qerr)?;
        loop {
            let chain = match q.iter(mem) {
                Ok(mut it) => it.next(),
                Err(e) => return Err(qerr(e)),
            };
            let Some(chain) = chain else { break };
            let head = chain.head_index();
            let len = serve(chain)?;
            match q.add_used(mem, head, len) {
                Ok(()) => used = true,
                Err(e) => add_used_failed(head, e)?,
            }
        }
        if !q.enable_notification(mem).map_err(&qerr)? {
            break;
        }
    }
    Ok(used && q.needs_notification(mem).map_err(&qerr)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{GuestAddress, GuestMemoryMmap};

    const QSIZE: u16 = 16;

    fn memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    /// Adds `n` one-descriptor chains (writable, 16 bytes each).
    fn add_chains(mock: &MockSplitQueue<GuestMemoryMmap>, n: u16) {
        let descs: Vec<RawDescriptor> = (0..n)
            .map(|i| {
                RawDescriptor::from(SplitDescriptor::new(
                    0x8000 + u64::from(i) * 0x100,
                    16,
                    virtio_bindings::virtio_ring::VRING_DESC_F_WRITE as u16,
                    0,
                ))
            })
            .collect();
        mock.add_desc_chains(&descs, 0).unwrap();
    }

    #[test]
    fn serves_every_chain_in_order_and_reports_the_used_lengths() {
        let mem = memory();
        let mock = MockSplitQueue::new(&mem, QSIZE);
        add_chains(&mock, 3);
        let mut q: Queue = mock.create_queue().unwrap();
        let mut heads = Vec::new();
        let notify = drain(
            &mut q,
            &mem,
            |e| e.to_string(),
            |chain| {
                heads.push(chain.head_index());
                Ok(7)
            },
            |_, e| Err(e.to_string()),
        )
        .unwrap();
        assert_eq!(heads, [0, 1, 2]);
        assert!(notify, "the driver asked for interrupts (no EVENT_IDX)");
        let used = mock.used();
        assert_eq!(used.idx().load(), 3);
        for i in 0..3u16 {
            let e = used.ring().ref_at(usize::from(i)).unwrap().load();
            assert_eq!((e.id(), e.len()), (u32::from(i), 7));
        }
    }

    #[test]
    fn an_empty_ring_needs_no_notification() {
        let mem = memory();
        let mock = MockSplitQueue::new(&mem, QSIZE);
        let mut q: Queue = mock.create_queue().unwrap();
        let notify = drain(
            &mut q,
            &mem,
            |e| e.to_string(),
            |_| -> Result<u32, String> { panic!("no chain to serve") },
            |_, e| Err(e.to_string()),
        )
        .unwrap();
        assert!(!notify);
    }

    #[test]
    fn a_serve_error_stops_the_drain_where_it_happened() {
        let mem = memory();
        let mock = MockSplitQueue::new(&mem, QSIZE);
        add_chains(&mock, 3);
        let mut q: Queue = mock.create_queue().unwrap();
        let err = drain(
            &mut q,
            &mem,
            |e| e.to_string(),
            |chain| {
                if chain.head_index() == 1 {
                    Err("bad chain".to_string())
                } else {
                    Ok(0)
                }
            },
            |_, e| Err(e.to_string()),
        )
        .unwrap_err();
        assert_eq!(err, "bad chain");
        assert_eq!(mock.used().idx().load(), 1, "chain 0 was returned");
    }

    #[test]
    fn a_failed_add_used_is_skipped_or_fatal_as_the_caller_says() {
        for fatal in [false, true] {
            let mem = memory();
            let mock = MockSplitQueue::new(&mem, QSIZE);
            add_chains(&mock, 3);
            // The driver puts an out-of-range head on the ring: the chain
            // cannot go on the used ring.
            mock.avail()
                .ring()
                .ref_at(1)
                .unwrap()
                .store(u16::to_le(100));
            let mut q: Queue = mock.create_queue().unwrap();
            let mut served = Vec::new();
            let mut failed = Vec::new();
            let res = drain(
                &mut q,
                &mem,
                |e| e.to_string(),
                |chain| {
                    served.push(chain.head_index());
                    Ok(0)
                },
                |head, e| {
                    failed.push(head);
                    if fatal {
                        Err(e.to_string())
                    } else {
                        Ok(())
                    }
                },
            );
            assert_eq!(failed, [100]);
            if fatal {
                assert!(res.is_err());
                assert_eq!(served, [0, 100]);
                assert_eq!(mock.used().idx().load(), 1);
            } else {
                assert!(res.unwrap());
                assert_eq!(served, [0, 100, 2]);
                assert_eq!(mock.used().idx().load(), 2);
            }
        }
    }
}
