//! Attribution of a captured connection: which spawn made it, and so which
//! proxy credential the agent may use for it.
//!
//! A captured connection arrives at the agent's listener from peer `P`
//! (the client's own address) for original destination `D`. Steps, all
//! through procfs (its root is a parameter so tests can use a fake tree):
//!
//! 1. the client's socket, whose local address is `P` and remote address
//!    is `D`: the kernel's exact socket lookup ([`super::sockdiag`]) gives
//!    its inode, or, where that is unavailable, the line of `net/tcp` (or
//!    `net/tcp6`, for a dual-stack socket with IPv4-mapped addresses)
//!    ([`find_socket_inode`]);
//! 2. the process holding `socket:[inode]`: a scan of `<pid>/fd`
//!    ([`find_socket_owner`]);
//! 3. the spawn: the owner's session id (field 6 of `<pid>/stat`; each
//!    spawn is the leader of its own session, see `agent::process`) is
//!    looked up in the [`Spawns`] registry; when it is not registered (the
//!    process started a session of its own) its ancestors are tried, each
//!    by pid and session id, following the parent pid ([`attribute`]).
//!
//! Any step that finds nothing makes the connection unattributable: the
//! caller closes it. No guess is ever made (no "the only live spawn").
//!
//! Limits: the agent must be allowed to read other users' `<pid>/fd`
//! (root with `CAP_SYS_PTRACE` in the VM, the same user in the sandbox); a
//! process that exits (or closes the socket) before the scan, or a daemon
//! whose parent chain was cut by a double fork and a new session, is
//! unattributable. The scan costs one `readlink` per open descriptor of
//! every process, fine for a guest's few hundred processes.

use std::fs;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::sockdiag::Diag;
use super::spawns::{ProxyCredential, Spawns};

/// Where procfs is mounted on a running machine.
pub const PROC_ROOT: &str = "/proc";

/// Longest parent chain followed before giving up: deeper process trees
/// than this are not made by session tools, and a bound keeps a loop in a
/// (fake or racing) tree finite.
pub const MAX_ANCESTRY: usize = 64;

/// Why a connection could not be attributed.
#[derive(Debug, thiserror::Error)]
pub enum AttribError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("no socket from {peer} to {dst} in the connection table (closed already?)")]
    NoSocket { peer: SocketAddr, dst: SocketAddr },
    #[error("no process holds socket inode {inode} (it exited already?)")]
    NoOwner { inode: u64 },
    #[error("process {pid} (session {sid}) and its ancestors belong to no spawn with an egress credential")]
    NotASpawn { pid: i32, sid: i32 },
}

/// One line of `/proc/net/tcp` or `/proc/net/tcp6`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpEntry {
    pub local: SocketAddr,
    pub remote: SocketAddr,
    pub inode: u64,
}

/// Parses `ADDR:PORT` as procfs prints it: the address as the kernel's
/// in-memory (network order) words, each printed `%08X` as a native-endian
/// u32 (8 digits for IPv4, 32 for IPv6); the port `%04X` in host order.
pub fn parse_hex_addr(s: &str) -> Option<SocketAddr> {
    let (addr, port) = s.split_once(':')?;
    if port.len() != 4 {
        return None;
    }
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |hex: &str| -> Option<[u8; 4]> {
        if hex.len() != 8 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        Some(u32::from_str_radix(hex, 16).ok()?.to_ne_bytes())
    };
    let ip = match addr.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(addr)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_exact_mut(4).enumerate() {
                chunk.copy_from_slice(&word(addr.get(i * 8..i * 8 + 8)?)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// Parses one table line (`sl local rem st queues tr retr uid timeout
/// inode ...`); the header and malformed lines give `None`.
pub fn parse_tcp_line(line: &str) -> Option<TcpEntry> {
    let mut f = line.split_whitespace();
    let slot = f.next()?;
    if !slot.ends_with(':') {
        return None;
    }
    let local = parse_hex_addr(f.next()?)?;
    let remote = parse_hex_addr(f.next()?)?;
    // st, tx:rx queue, tr:tm->when, retrnsmt, uid, timeout, then the inode.
    let inode = f.nth(6)?.parse().ok()?;
    Some(TcpEntry {
        local,
        remote,
        inode,
    })
}

/// An address with IPv4-mapped IPv6 forms turned into IPv4, so a
/// dual-stack socket's entry compares equal to what an IPv4 listener sees.
fn canonical(a: SocketAddr) -> SocketAddr {
    match a.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), a.port()),
            None => a,
        },
        IpAddr::V4(_) => a,
    }
}

/// The calling thread's network tables: `<proc>/thread-self/net` (a
/// thread may have entered a network namespace of its own, and
/// `<proc>/net` shows the main thread's), else `<proc>/net`.
fn net_dir(proc_root: &Path) -> PathBuf {
    let own = proc_root.join("thread-self/net");
    if own.is_dir() {
        own
    } else {
        proc_root.join("net")
    }
}

/// The inode of the socket whose local address is `local` and remote
/// address is `remote`, from the `tcp` and `tcp6` tables of the calling
/// thread's network namespace. Entries with inode 0 (time-wait, orphaned)
/// are skipped.
pub fn find_socket_inode(
    proc_root: &Path,
    local: SocketAddr,
    remote: SocketAddr,
) -> Result<u64, AttribError> {
    let (local, remote) = (canonical(local), canonical(remote));
    let mut readable = false;
    let mut last_err = None;
    let net = net_dir(proc_root);
    for table in ["tcp", "tcp6"] {
        let path = net.join(table);
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            Err(source) => {
                last_err = Some(AttribError::Read { path, source });
                continue;
            }
        };
        readable = true;
        let found = text
            .lines()
            .filter_map(parse_tcp_line)
            .find(|e| e.inode != 0 && canonical(e.local) == local && canonical(e.remote) == remote);
        if let Some(e) = found {
            return Ok(e.inode);
        }
    }
    match (readable, last_err) {
        (false, Some(e)) => Err(e),
        _ => Err(AttribError::NoSocket {
            peer: local,
            dst: remote,
        }),
    }
}

/// The pids below `proc_root` (its numeric entries).
fn pids(proc_root: &Path) -> Result<Vec<i32>, AttribError> {
    let dir = fs::read_dir(proc_root).map_err(|source| AttribError::Read {
        path: proc_root.to_path_buf(),
        source,
    })?;
    Ok(dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&p| p > 0)
        .collect())
}

/// A process that holds `socket:[inode]` among its descriptors. Processes
/// whose descriptors cannot be read (gone, or not ours to read) are skipped.
/// Newest pids first: the connecting process is usually recent, and the
/// long-lived low pids (init, kernel threads) come last.
pub fn find_socket_owner(proc_root: &Path, inode: u64) -> Result<i32, AttribError> {
    let want = format!("socket:[{inode}]");
    let mut pids = pids(proc_root)?;
    pids.sort_unstable_by(|a, b| b.cmp(a));
    for pid in pids {
        let Ok(fds) = fs::read_dir(proc_root.join(pid.to_string()).join("fd")) else {
            continue;
        };
        let holds = fds
            .filter_map(|e| e.ok())
            .any(|e| fs::read_link(e.path()).is_ok_and(|t| t.as_os_str() == want.as_str()));
        if holds {
            return Ok(pid);
        }
    }
    Err(AttribError::NoOwner { inode })
}

/// The ids of `<pid>/stat` that attribution needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatIds {
    pub ppid: i32,
    pub pgrp: i32,
    pub session: i32,
}

/// Parses `<pid>/stat`: `pid (comm) state ppid pgrp session ...`. The
/// command name may hold spaces and parentheses, so fields are counted
/// after the last `)`.
pub fn parse_stat(text: &str) -> Option<StatIds> {
    let (_, rest) = text.rsplit_once(')')?;
    let mut f = rest.split_whitespace();
    let _state = f.next()?;
    Some(StatIds {
        ppid: f.next()?.parse().ok()?,
        pgrp: f.next()?.parse().ok()?,
        session: f.next()?.parse().ok()?,
    })
}

fn stat_ids(proc_root: &Path, pid: i32) -> Option<StatIds> {
    let text = fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
    parse_stat(&text)
}

/// The spawn credential for the process `pid`: its session's, else the
/// first of its ancestors (by pid or session id) that is registered.
pub fn credential_of(
    proc_root: &Path,
    spawns: &Spawns,
    pid: i32,
) -> Result<Arc<ProxyCredential>, AttribError> {
    let mut current = pid;
    let mut first_sid = 0;
    for depth in 0..MAX_ANCESTRY {
        let Some(ids) = stat_ids(proc_root, current) else {
            break;
        };
        if depth == 0 {
            first_sid = ids.session;
        }
        for key in [ids.session, current] {
            if key > 1 {
                if let Some(c) = spawns.get(key) {
                    return Ok(c);
                }
            }
        }
        if ids.ppid <= 1 || ids.ppid == current {
            break;
        }
        current = ids.ppid;
    }
    Err(AttribError::NotASpawn {
        pid,
        sid: first_sid,
    })
}

/// The client socket's inode: the exact lookup, else the tables (and when
/// the tables find a socket the exact lookup missed, it is switched off).
pub fn socket_inode(
    proc_root: &Path,
    diag: &Diag,
    peer: SocketAddr,
    dst: SocketAddr,
) -> Result<u64, AttribError> {
    if let Ok(Some(inode)) = diag.inode(peer, dst) {
        return Ok(inode);
    }
    let inode = find_socket_inode(proc_root, peer, dst)?;
    diag.disable();
    Ok(inode)
}

/// Attributes the connection from `peer` to `dst`: the owning process and
/// the credential of its spawn. Blocking (netlink, procfs reads): call it
/// from a blocking thread.
pub fn attribute(
    proc_root: &Path,
    diag: &Diag,
    spawns: &Spawns,
    peer: SocketAddr,
    dst: SocketAddr,
) -> Result<(i32, Arc<ProxyCredential>), AttribError> {
    let inode = socket_inode(proc_root, diag, peer, dst)?;
    let pid = find_socket_owner(proc_root, inode)?;
    let cred = credential_of(proc_root, spawns, pid)?;
    Ok((pid, cred))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// Real lines from an x86-64 machine (little endian: procfs prints the
    /// address words as native u32s).
    #[cfg(target_endian = "little")]
    #[test]
    fn table_lines_parse_like_the_kernel_prints_them() {
        let header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode";
        assert_eq!(parse_tcp_line(header), None);
        let l = "   3: 0100007F:0C38 070012C6:01BB 01 00000000:00000000 00:00000000 00000000  1000        0 424242 1 0000000000000000 20 4 30 10 -1";
        assert_eq!(
            parse_tcp_line(l),
            Some(TcpEntry {
                local: "127.0.0.1:3128".parse().unwrap(),
                remote: "198.18.0.7:443".parse().unwrap(),
                inode: 424242,
            })
        );
        let l6 = "   0: 0000000000000000FFFF00000100007F:9C40 0000000000000000FFFF0000070012C6:0016 01 00000000:00000000 00:00000000 00000000     0        0 77 1 0000000000000000 20 4 30 10 -1";
        let e = parse_tcp_line(l6).unwrap();
        assert_eq!(e.local, "[::ffff:127.0.0.1]:40000".parse().unwrap());
        assert_eq!(canonical(e.remote), "198.18.0.7:22".parse().unwrap());
        let l6b = "   1: 00000000000000000000000001000000:0050 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 9 1 0000000000000000 100 0 0 10 0";
        assert_eq!(
            parse_tcp_line(l6b).unwrap().local,
            "[::1]:80".parse().unwrap()
        );
        for bad in [
            "",
            "0: 0100007F:0C38 070012C6:01BB 01",
            "   3: 0100007F:C38 070012C6:01BB 01 00000000:00000000 00:00000000 00000000 0 0 1",
            "   3: 0100007G:0C38 070012C6:01BB 01 00000000:00000000 00:00000000 00000000 0 0 1",
            "   3: 0100007F0C38 070012C6:01BB 01 00000000:00000000 00:00000000 00000000 0 0 1",
            "   3: 0100007F:0C38 0700012C6:01BB 01 00000000:00000000 00:00000000 00000000 0 0 1",
            "   3: 0100007F:0C38 0700012C6:01BB 01 00000000:00000000 00:00000000 00000000 0 0 x",
            "   3: +100007F:0C38 0700012C6:01BB 01 00000000:00000000 00:00000000 00000000 0 0 1",
        ] {
            assert_eq!(parse_tcp_line(bad), None, "{bad}");
        }
    }

    #[test]
    fn stat_fields_are_counted_after_the_last_parenthesis() {
        let s = "4321 (evil) 1 2 3 (x) S 17 4000 4001 0 -1 4194560 100 0 0 0";
        assert_eq!(
            parse_stat(s),
            Some(StatIds {
                ppid: 17,
                pgrp: 4000,
                session: 4001
            })
        );
        assert_eq!(parse_stat("12 (sh) S 1"), None);
        assert_eq!(parse_stat("12 sh S 1 2 3"), None);
        assert_eq!(parse_stat("12 (sh) S a 2 3"), None);
    }

    /// A fake procfs: `net/tcp{,6}`, and per process a `stat` and `fd/`
    /// links.
    struct FakeProc {
        dir: tempfile::TempDir,
    }

    impl FakeProc {
        fn new(tcp: &str, tcp6: &str) -> Self {
            let dir = tempfile::tempdir().unwrap();
            fs::create_dir(dir.path().join("net")).unwrap();
            fs::write(dir.path().join("net/tcp"), tcp).unwrap();
            fs::write(dir.path().join("net/tcp6"), tcp6).unwrap();
            fs::create_dir(dir.path().join("self")).unwrap();
            Self { dir }
        }
        fn process(&self, pid: i32, ppid: i32, sid: i32, fds: &[&str]) {
            let d = self.dir.path().join(pid.to_string());
            fs::create_dir_all(d.join("fd")).unwrap();
            fs::write(
                d.join("stat"),
                format!("{pid} (a b) c) S {ppid} {pid} {sid} 0 -1 0 0 0"),
            )
            .unwrap();
            for (i, target) in fds.iter().enumerate() {
                symlink(target, d.join("fd").join(i.to_string())).unwrap();
            }
        }
        fn root(&self) -> &Path {
            self.dir.path()
        }
    }

    const HEADER: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n";

    fn line(local: &str, remote: &str, inode: u64) -> String {
        let hex = |a: &str| {
            let a: SocketAddr = a.parse().unwrap();
            let ip = match a.ip() {
                IpAddr::V4(v4) => format!("{:08X}", u32::from_ne_bytes(v4.octets())),
                IpAddr::V6(v6) => v6
                    .octets()
                    .chunks_exact(4)
                    .map(|c| format!("{:08X}", u32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
                    .collect(),
            };
            format!("{ip}:{:04X}", a.port())
        };
        format!(
            "   0: {} {} 01 00000000:00000000 00:00000000 00000000  1000        0 {inode} 1 0000000000000000 20 4 30 10 -1\n",
            hex(local),
            hex(remote)
        )
    }

    fn registered(spawns: &Spawns, pid: i32, pass: &str) {
        spawns
            .register(pid, Some(&format!("http://s:{pass}@127.0.0.1:3128")))
            .unwrap();
    }

    #[test]
    fn a_connection_maps_to_its_spawns_credential_via_the_session() {
        let peer = "198.18.0.7:40000";
        let dst = "198.18.0.7:443";
        let tcp = format!(
            "{HEADER}{}{}{}",
            // The agent's accepted side (local = dst) must not be mistaken for it.
            line(dst, peer, 500),
            // Time-wait leftovers have inode 0.
            line(peer, dst, 0),
            line(peer, dst, 501)
        );
        let p = FakeProc::new(&tcp, HEADER);
        p.process(1, 0, 0, &["socket:[500]"]);
        // Spawn 100 (a session leader) forked 130, which holds the socket.
        p.process(100, 1, 100, &["pipe:[1]", "/dev/null"]);
        p.process(130, 100, 100, &["socket:[9]", "socket:[501]"]);
        let spawns = Spawns::new();
        registered(&spawns, 100, "cred-a");
        let (pid, cred) = attribute(
            p.root(),
            &Diag::new(),
            &spawns,
            peer.parse().unwrap(),
            dst.parse().unwrap(),
        )
        .unwrap();
        assert_eq!(pid, 130);
        assert_eq!(cred.password, b"cred-a");
    }

    #[test]
    fn a_new_session_is_attributed_through_its_ancestors() {
        let (peer, dst) = ("10.0.0.1:5555", "93.184.216.34:22");
        let p = FakeProc::new(HEADER, HEADER);
        // Spawn 200 -> 210 (setsid: session 210) -> 220 holds the socket,
        // written in tcp6 as IPv4-mapped (a dual-stack socket).
        let tcp6 = format!(
            "{HEADER}{}",
            line("[::ffff:10.0.0.1]:5555", "[::ffff:93.184.216.34]:22", 77)
        );
        fs::write(p.root().join("net/tcp6"), tcp6).unwrap();
        p.process(200, 1, 200, &[]);
        p.process(210, 200, 210, &[]);
        p.process(220, 210, 210, &["socket:[77]"]);
        let spawns = Spawns::new();
        registered(&spawns, 200, "cred-b");
        registered(&spawns, 999, "other");
        let (pid, cred) = attribute(
            p.root(),
            &Diag::new(),
            &spawns,
            peer.parse().unwrap(),
            dst.parse().unwrap(),
        )
        .unwrap();
        assert_eq!((pid, cred.password.as_slice()), (220, &b"cred-b"[..]));
    }

    #[test]
    fn unattributable_connections_say_why() {
        let (peer, dst) = ("10.0.0.1:5555", "10.9.9.9:80");
        let tcp = format!(
            "{HEADER}{}{}",
            line(peer, dst, 31),
            line(peer, "10.9.9.9:81", 32)
        );
        let p = FakeProc::new(&tcp, HEADER);
        // An orphan daemon (reparented to init, own session), a loop in a
        // racing tree, and a socket nobody holds.
        p.process(300, 1, 300, &["socket:[31]"]);
        p.process(400, 401, 400, &["socket:[32]"]);
        p.process(401, 400, 401, &[]);
        let spawns = Spawns::new();
        registered(&spawns, 1, "init-never-counts");
        let at = |d: &str| {
            attribute(
                p.root(),
                &Diag::new(),
                &spawns,
                peer.parse().unwrap(),
                d.parse().unwrap(),
            )
            .unwrap_err()
        };
        let err = at(dst);
        assert!(
            matches!(err, AttribError::NotASpawn { pid: 300, sid: 300 }),
            "{err}"
        );
        let err = at("10.9.9.9:81");
        assert!(
            matches!(err, AttribError::NotASpawn { pid: 400, .. }),
            "{err}"
        );
        let err = at("10.9.9.9:82");
        assert!(matches!(err, AttribError::NoSocket { .. }), "{err}");
        let tcp = format!("{HEADER}{}", line(peer, "10.9.9.9:83", 33));
        fs::write(p.root().join("net/tcp"), tcp).unwrap();
        let err = at("10.9.9.9:83");
        assert!(matches!(err, AttribError::NoOwner { inode: 33 }), "{err}");
        let missing = Path::new("/nonexistent/proc");
        let err = attribute(
            missing,
            &Diag::new(),
            &spawns,
            peer.parse().unwrap(),
            dst.parse().unwrap(),
        )
        .unwrap_err();
        assert!(matches!(err, AttribError::Read { .. }), "{err}");
    }

    /// The real procfs: a TCP connection of this very process is found by
    /// its addresses, its owner is this process, and this process's
    /// session id selects the registered credential.
    #[test]
    fn a_real_connection_of_this_process_is_attributed() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_accepted, _) = listener.accept().unwrap();
        let proc_root = Path::new(PROC_ROOT);
        let peer = client.local_addr().unwrap();
        let dst = client.peer_addr().unwrap();
        let inode = find_socket_inode(proc_root, peer, dst).unwrap();
        let me = std::process::id() as i32;
        assert_eq!(find_socket_owner(proc_root, inode).unwrap(), me);
        let ids = stat_ids(proc_root, me).unwrap();
        // SAFETY: getsid(0) has no preconditions.
        let sid = unsafe { libc::getsid(0) };
        assert_eq!(ids.session, sid);
        // SAFETY: as above.
        assert_eq!(ids.ppid, unsafe { libc::getppid() });
        let spawns = Spawns::new();
        if sid > 1 {
            registered(&spawns, sid, "mine");
        } else {
            registered(&spawns, me, "mine");
        }
        let diag = Diag::new();
        let (pid, cred) = attribute(proc_root, &diag, &spawns, peer, dst).unwrap();
        assert_eq!(socket_inode(proc_root, &diag, peer, dst).unwrap(), inode);
        assert_eq!((pid, cred.password.as_slice()), (me, &b"mine"[..]));
    }
}
