//! Standalone vhost-user vsock backend for testing and benchmarking the
//! device with QEMU, plus the host half of the bench protocol.
//!
//! ```text
//! vsock-vhost-user serve --socket PATH [--guest-cid 3] [--bench-port P]...
//!                        [--map P=unix:PATH]...
//! vsock-vhost-user bench-server --unix PATH
//! ```
//!
//! `serve` binds the vhost-user socket, serves one QEMU until it exits, and
//! answers the bench protocol in-process on every `--bench-port` (the path a
//! helper uses: a `VsockHost` listener). `--map` forwards a port to a host
//! Unix socket instead. `bench-server` answers the same protocol on a Unix
//! listener: behind `--map`, or behind vhost-device-vsock's `<uds>_<port>`.
//!
//! Bench protocol: the guest sends one line, then:
//! * `P` — the host answers `p\n` and the guest closes (connect+ping);
//! * `S <n>` — the guest sends n bytes; the host answers `OK <fnv1a64 hex>`;
//! * `R <n>` — the host sends n bytes of [`pattern`] and half-closes;
//! * `C <port> <n>` — the host dials guest port `port` (on the vsock host it
//!   serves), sends n pattern bytes, expects them echoed, and answers
//!   `OK <hash>` or `ERR <why>` on the first connection (in-process only).

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use devices::vhost_user::vsock::{VhostUserVsockConfig, VhostUserVsockServer};
use devices::vsock::VsockHost;

/// FNV-1a 64-bit offset basis.
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a 64-bit prime.
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
/// Chunk size of bulk transfers.
const CHUNK: usize = 64 * 1024;
/// Longest request line.
const MAX_LINE: usize = 128;

/// Byte `i` of the test pattern (the guest program computes the same).
fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 13) as u8
}

fn fnv(mut h: u64, data: &[u8]) -> u64 {
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

fn usage() -> ExitCode {
    eprintln!(
        "usage: vsock-vhost-user serve --socket PATH [--guest-cid CID] [--bench-port PORT]... [--map PORT=unix:PATH]...\n       vsock-vhost-user bench-server --unix PATH"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(io::stderr)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let res = match args.first().map(String::as_str) {
        Some("serve") => serve(&args[1..]),
        Some("bench-server") => bench_server(&args[1..]),
        _ => return usage(),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vsock-vhost-user: {e}");
            ExitCode::FAILURE
        }
    }
}

type AnyError = Box<dyn std::error::Error + Send + Sync>;

fn serve(args: &[String]) -> Result<(), AnyError> {
    let mut socket = None;
    let mut cid = 3u64;
    let mut bench_ports = Vec::new();
    let mut maps = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--socket" => socket = Some(PathBuf::from(val()?)),
            "--guest-cid" => cid = val()?.parse()?,
            "--bench-port" => bench_ports.push(val()?.parse::<u32>()?),
            "--map" => {
                let v = val()?;
                let (port, target) = v.split_once('=').ok_or("--map wants PORT=unix:PATH")?;
                let path = target
                    .strip_prefix("unix:")
                    .ok_or("--map wants PORT=unix:PATH")?;
                maps.push((port.parse::<u32>()?, PathBuf::from(path)));
            }
            _ => return Err(format!("unknown argument {a}").into()),
        }
    }
    let socket = socket.ok_or("--socket is required")?;
    let host = VsockHost::new()?;
    for (port, path) in maps {
        host.map_unix(port, path)?;
    }
    for port in bench_ports {
        let listener = host.listen(port)?;
        let host = host.clone();
        std::thread::spawn(move || loop {
            match listener.accept() {
                Ok(s) => {
                    let host = host.clone();
                    std::thread::spawn(move || {
                        if let Err(e) = handle(s, Some(&host)) {
                            eprintln!("bench connection: {e}");
                        }
                    });
                }
                Err(e) => {
                    eprintln!("accept: {e}");
                    return;
                }
            }
        });
    }
    let server = VhostUserVsockServer::bind(&VhostUserVsockConfig::new(socket, cid), &host)?;
    server.run()?;
    Ok(())
}

fn bench_server(args: &[String]) -> Result<(), AnyError> {
    let path = match args {
        [flag, p] if flag == "--unix" => PathBuf::from(p),
        _ => return Err("bench-server wants --unix PATH".into()),
    };
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)?;
    for s in listener.incoming() {
        let s = s?;
        std::thread::spawn(move || {
            if let Err(e) = handle(s, None) {
                eprintln!("bench connection: {e}");
            }
        });
    }
    Ok(())
}

fn read_line(s: &mut UnixStream) -> io::Result<String> {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while line.len() < MAX_LINE {
        if s.read(&mut b)? == 0 {
            break;
        }
        if b[0] == b'\n' {
            break;
        }
        line.push(b[0]);
    }
    Ok(String::from_utf8_lossy(&line).into_owned())
}

fn send_pattern(s: &mut UnixStream, n: u64) -> io::Result<u64> {
    let mut buf = vec![0u8; CHUNK];
    let mut sent = 0u64;
    let mut h = FNV_OFFSET;
    while sent < n {
        let k = (n - sent).min(CHUNK as u64) as usize;
        for (j, b) in buf[..k].iter_mut().enumerate() {
            *b = pattern(sent + j as u64);
        }
        h = fnv(h, &buf[..k]);
        s.write_all(&buf[..k])?;
        sent += k as u64;
    }
    Ok(h)
}

fn recv_hash(s: &mut UnixStream, n: u64) -> io::Result<u64> {
    let mut buf = vec![0u8; CHUNK];
    let mut got = 0u64;
    let mut h = FNV_OFFSET;
    while got < n {
        let k = (n - got).min(CHUNK as u64) as usize;
        let r = s.read(&mut buf[..k])?;
        if r == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("EOF after {got} of {n} bytes"),
            ));
        }
        h = fnv(h, &buf[..r]);
        got += r as u64;
    }
    Ok(h)
}

fn handle(mut s: UnixStream, host: Option<&VsockHost>) -> Result<(), AnyError> {
    let line = read_line(&mut s)?;
    let words: Vec<&str> = line.split_whitespace().collect();
    match words.as_slice() {
        ["P"] => s.write_all(b"p\n")?,
        ["S", n] => {
            let h = recv_hash(&mut s, n.parse()?)?;
            s.write_all(format!("OK {h:016x}\n").as_bytes())?;
        }
        ["R", n] => {
            send_pattern(&mut s, n.parse()?)?;
            s.shutdown(std::net::Shutdown::Write)?;
            // Wait for the guest to close its side.
            let mut sink = [0u8; 64];
            while s.read(&mut sink)? > 0 {}
        }
        ["C", port, n] => {
            let host = host.ok_or("C needs the in-process host")?;
            let reply = match connect_back(host, port.parse()?, n.parse()?) {
                Ok(h) => format!("OK {h:016x}\n"),
                Err(e) => format!("ERR {e}\n"),
            };
            s.write_all(reply.as_bytes())?;
        }
        _ => return Err(format!("bad request line {line:?}").into()),
    }
    Ok(())
}

/// Dials the guest, sends `n` pattern bytes and checks they come back.
fn connect_back(host: &VsockHost, port: u32, n: u64) -> Result<u64, AnyError> {
    let c = host.connect(port, Duration::from_secs(10))?;
    let mut w = c.try_clone()?;
    let sender = std::thread::spawn(move || -> io::Result<u64> {
        let h = send_pattern(&mut w, n)?;
        w.shutdown(std::net::Shutdown::Write)?;
        Ok(h)
    });
    let mut r = BufReader::new(c);
    let mut got = 0u64;
    let mut h = FNV_OFFSET;
    loop {
        let buf = r.fill_buf()?;
        if buf.is_empty() {
            break;
        }
        h = fnv(h, buf);
        got += buf.len() as u64;
        let k = buf.len();
        r.consume(k);
    }
    let sent = sender.join().map_err(|_| "sender thread panicked")??;
    if got != n || h != sent {
        return Err(
            format!("echo mismatch: got {got} of {n} bytes, hash {h:016x} vs {sent:016x}").into(),
        );
    }
    Ok(h)
}
