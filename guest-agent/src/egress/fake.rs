//! The fake-IP table: which host name each address of a private pool stands
//! for.
//!
//! The agent's DNS stub ([`super::dns`]) answers every `A` query with an
//! address from [`POOL_NET`]/[`POOL_PREFIX_LEN`] and records the name here;
//! when the capture ([`super::capture`]) later accepts a connection to such
//! an address, [`FakePool::name_of`] gives back the name, and the relay asks
//! the host's proxy for *that name*, so the host applies its allowlist to
//! names, not to addresses it never resolved.
//!
//! Names are normalised (ASCII lowercase, one trailing dot removed) and must
//! look like DNS host names ([`normalise`]); anything else gets no address.
//! A name keeps its address for as long as it is in the table; once every
//! address is taken, the entry assigned (or re-asked for) least recently is
//! given to the new name.
//!
//! Limits: a program that caches an address longer than the table keeps it
//! (after about 131 000 other names) reaches the wrong name; the DNS TTL is
//! short to make that unlikely. The table lives in memory only (bounded by
//! the pool size, at most a few tens of MiB with maximal names) and is lost
//! when the agent restarts.

use crate::sync::MutexExt;
use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex, MutexGuard};

/// First address of the pool: `198.18.0.0/15` is reserved for network
/// benchmarking (RFC 2544, RFC 6890) and never routed on the internet, so a
/// fake address cannot shadow a real server. Xray/V2Ray's FakeDNS use the
/// same range.
pub const POOL_NET: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 0);

/// Prefix length of the pool (`/15`: 198.18.0.0 to 198.19.255.255).
pub const POOL_PREFIX_LEN: u32 = 15;

/// Number of addresses in the pool, network and last address included.
const POOL_SIZE: u32 = 1 << (32 - POOL_PREFIX_LEN);

/// Addresses handed out: all but the pool's first (the network address) and
/// last (its broadcast-like address), which some stacks treat specially.
const POOL_USABLE: u32 = POOL_SIZE - 2;

/// Longest host name in its text form (RFC 1035 §2.3.4: 255 octets on the
/// wire, which is 253 characters without the trailing dot).
pub const MAX_NAME_LEN: usize = 253;

/// Longest label (RFC 1035 §2.3.4).
pub const MAX_LABEL_LEN: usize = 63;

/// `name` normalised for the table: ASCII lowercase, one trailing dot
/// removed; `None` unless it is 1 to [`MAX_NAME_LEN`] characters of labels
/// of 1 to [`MAX_LABEL_LEN`] characters from `[a-z0-9-_]` (RFC 1123 host
/// names, plus `_` as in `_service` names that tools do resolve).
pub fn normalise(name: &str) -> Option<String> {
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return None;
    }
    let name = name.to_ascii_lowercase();
    let label_ok = |l: &str| {
        (1..=MAX_LABEL_LEN).contains(&l.len())
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
    };
    name.split('.').all(label_ok).then_some(name)
}

/// One assigned address.
struct Entry {
    name: Arc<str>,
    /// When it was last assigned or asked for (key in `Table::by_age`).
    stamp: u64,
}

/// The mutable state behind [`FakePool`].
struct Table {
    /// Usable addresses: offsets `1..=capacity` from [`POOL_NET`].
    capacity: u32,
    /// Offsets never handed out yet start here (`capacity + 1`: none left).
    next_fresh: u32,
    by_name: HashMap<Arc<str>, u32>,
    /// Offset → entry.
    by_offset: HashMap<u32, Entry>,
    /// Stamp → offset, oldest first: the eviction order.
    by_age: BTreeMap<u64, u32>,
    /// Next stamp (grows by one per assignment; never wraps in practice).
    clock: u64,
}

/// Name ↔ address table over the fake pool; see the module doc. Shared as
/// `Arc<FakePool>` by the DNS stub and the relay.
pub struct FakePool {
    table: Mutex<Table>,
}

impl std::fmt::Debug for FakePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = self.lock();
        f.debug_struct("FakePool")
            .field("capacity", &t.capacity)
            .field("assigned", &t.by_offset.len())
            .finish()
    }
}

impl Default for FakePool {
    fn default() -> Self {
        Self::new()
    }
}

impl FakePool {
    /// An empty table over the whole pool.
    pub fn new() -> FakePool {
        FakePool::with_capacity(POOL_USABLE)
    }

    /// An empty table using only the first `capacity` usable addresses
    /// (clamped to 1..=[`POOL_USABLE`]); small ones let tests exhaust it.
    fn with_capacity(capacity: u32) -> FakePool {
        let capacity = capacity.clamp(1, POOL_USABLE);
        FakePool {
            table: Mutex::new(Table {
                capacity,
                next_fresh: 1,
                by_name: HashMap::new(),
                by_offset: HashMap::new(),
                by_age: BTreeMap::new(),
                clock: 0,
            }),
        }
    }

    /// The table; a panic elsewhere while holding the lock leaves it
    /// consistent enough (each update is a few map operations), so a
    /// poisoned lock is used as is rather than taking the agent down.
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.locked()
    }

    /// The address for `name` ([`normalise`]d; `None` when invalid): the one
    /// it already has, else a fresh one, else the least recently assigned
    /// entry's. Each call counts as a use for the eviction order.
    pub fn assign(&self, name: &str) -> Option<Ipv4Addr> {
        let name = normalise(name)?;
        let mut t = self.lock();
        let t = &mut *t;
        t.clock += 1;
        let stamp = t.clock;
        if let Some(&offset) = t.by_name.get(name.as_str()) {
            if let Some(e) = t.by_offset.get_mut(&offset) {
                t.by_age.remove(&e.stamp);
                e.stamp = stamp;
                t.by_age.insert(stamp, offset);
            }
            return Some(address(offset));
        }
        let offset = if t.next_fresh <= t.capacity {
            t.next_fresh += 1;
            t.next_fresh - 1
        } else {
            // Exhausted: reuse the oldest entry.
            let (_, offset) = t.by_age.pop_first()?;
            if let Some(old) = t.by_offset.remove(&offset) {
                t.by_name.remove(&old.name);
            }
            offset
        };
        let name: Arc<str> = name.into();
        t.by_name.insert(name.clone(), offset);
        t.by_offset.insert(offset, Entry { name, stamp });
        t.by_age.insert(stamp, offset);
        Some(address(offset))
    }

    /// The name `ip` was assigned to, if it is a pool address in use.
    pub fn name_of(&self, ip: Ipv4Addr) -> Option<String> {
        let offset = offset(ip)?;
        self.lock()
            .by_offset
            .get(&offset)
            .map(|e| e.name.to_string())
    }

    /// Whether `ip` is in the pool range (`198.18.0.0/15`), assigned or not.
    pub fn contains(ip: Ipv4Addr) -> bool {
        offset(ip).is_some()
    }
}

/// The pool address at `offset` from [`POOL_NET`].
fn address(offset: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(POOL_NET) + offset)
}

/// `ip`'s offset from [`POOL_NET`], when it lies in the pool.
fn offset(ip: Ipv4Addr) -> Option<u32> {
    let off = u32::from(ip).wrapping_sub(u32::from(POOL_NET));
    (off < POOL_SIZE).then_some(off)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_normalised_and_checked() {
        assert_eq!(normalise("Example.COM.").as_deref(), Some("example.com"));
        assert_eq!(normalise("a-b_c.x9").as_deref(), Some("a-b_c.x9"));
        assert_eq!(normalise("localhost").as_deref(), Some("localhost"));
        for bad in [
            "",
            ".",
            "example.com..",
            ".example.com",
            "a..b",
            "exa mple.com",
            "exämple.com",
            "a/b",
            "a:443",
            "*.example.com",
        ] {
            assert_eq!(normalise(bad), None, "{bad:?}");
        }
        let label63 = "a".repeat(63);
        assert!(normalise(&format!("{label63}.com")).is_some());
        assert_eq!(normalise(&format!("a{label63}.com")), None);
        // 4 labels of 63 + 3 dots = 255 > 253; 253 exactly passes.
        let long = [label63.as_str(); 4].join(".");
        assert_eq!(normalise(&long), None);
        let exact = format!("{}.{}", [label63.as_str(); 3].join("."), "a".repeat(61));
        assert_eq!(exact.len(), 253);
        assert!(normalise(&exact).is_some());
        assert!(normalise(&format!("{exact}.")).is_some());
    }

    #[test]
    fn a_name_keeps_its_address_and_maps_back() {
        let pool = FakePool::new();
        let a = pool.assign("api.example.com").unwrap();
        let b = pool.assign("registry.npmjs.org.").unwrap();
        assert_ne!(a, b);
        assert_eq!(pool.assign("API.Example.com.").unwrap(), a);
        assert_eq!(pool.name_of(a).as_deref(), Some("api.example.com"));
        assert_eq!(pool.name_of(b).as_deref(), Some("registry.npmjs.org"));
        assert!(FakePool::contains(a) && FakePool::contains(b));
        // Neither the network address nor the last one is handed out.
        assert_eq!(a, Ipv4Addr::new(198, 18, 0, 1));
        assert_eq!(pool.name_of(Ipv4Addr::new(198, 18, 0, 0)), None);
        assert_eq!(pool.name_of(Ipv4Addr::new(198, 18, 0, 200)), None);
        assert_eq!(pool.name_of(Ipv4Addr::new(10, 0, 0, 1)), None);
        assert_eq!(pool.assign("bad name"), None);
    }

    #[test]
    fn the_pool_is_198_18_slash_15() {
        assert!(FakePool::contains(Ipv4Addr::new(198, 18, 0, 0)));
        assert!(FakePool::contains(Ipv4Addr::new(198, 19, 255, 255)));
        assert!(!FakePool::contains(Ipv4Addr::new(198, 17, 255, 255)));
        assert!(!FakePool::contains(Ipv4Addr::new(198, 20, 0, 0)));
        assert!(!FakePool::contains(Ipv4Addr::new(127, 0, 0, 1)));
        assert!(!FakePool::contains(Ipv4Addr::new(0, 0, 0, 0)));
        assert!(!FakePool::contains(Ipv4Addr::new(255, 255, 255, 255)));
        assert_eq!(address(POOL_USABLE), Ipv4Addr::new(198, 19, 255, 254));
    }

    #[test]
    fn an_exhausted_pool_reuses_the_least_recently_assigned_entry() {
        let pool = FakePool::with_capacity(3);
        let a = pool.assign("a.test").unwrap();
        let b = pool.assign("b.test").unwrap();
        let c = pool.assign("c.test").unwrap();
        // Asking for "a" again makes "b" the oldest.
        assert_eq!(pool.assign("a.test"), Some(a));
        let d = pool.assign("d.test").unwrap();
        assert_eq!(d, b);
        assert_eq!(pool.name_of(b).as_deref(), Some("d.test"));
        assert_eq!(pool.name_of(a).as_deref(), Some("a.test"));
        // "b" comes back at the now-oldest address, "c"'s.
        assert_eq!(pool.assign("b.test"), Some(c));
        assert_eq!(pool.name_of(c).as_deref(), Some("b.test"));
        for (name, ip) in [("a.test", a), ("d.test", d), ("b.test", c)] {
            assert_eq!(pool.assign(name), Some(ip), "{name}");
        }
        let t = pool.lock();
        assert_eq!(
            (t.by_name.len(), t.by_offset.len(), t.by_age.len()),
            (3, 3, 3)
        );
    }

    #[test]
    fn a_one_address_pool_still_works() {
        let pool = FakePool::with_capacity(0);
        let a = pool.assign("x.test").unwrap();
        assert_eq!(pool.assign("y.test"), Some(a));
        assert_eq!(pool.name_of(a).as_deref(), Some("y.test"));
    }

    #[test]
    fn the_pool_is_shareable_across_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<FakePool>();
        let pool = Arc::new(FakePool::new());
        let threads: Vec<_> = (0..4)
            .map(|i| {
                let pool = pool.clone();
                std::thread::spawn(move || {
                    (0..200)
                        .map(|n| pool.assign(&format!("h{}.t{i}.test", n % 50)).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut all = std::collections::HashSet::new();
        for t in threads {
            all.extend(t.join().unwrap());
        }
        assert_eq!(all.len(), 200);
    }
}
