//! Standalone vhost-user-fs backend serving a [`SessionFs`], for testing and
//! benchmarking the device with QEMU (`devices/benches/bench-fs.sh`).
//!
//! ```text
//! fs-vhost-user --socket PATH [--request-queues N] [--queue-size N] [--xattr]
//!               --grant SESSION:MOUNT:HOST_PATH:MODE ...
//! ```
//!
//! Binds the vhost-user socket, adds each grant (mode `ro`, `rw` or `rwd`;
//! the host path may not contain `:`), serves one QEMU until it
//! disconnects, prints the request counters (total, malformed, and per FUSE
//! opcode) and exits. `--xattr` serves extended attributes
//! (`SessionFsOptions::xattr`; off by default, as in the helper). Logs go to stderr,
//! filtered by `RUST_LOG` (default `info`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use devices::fs::{GrantMode, SessionFs, SessionFsOptions};
use devices::vhost_user::fs::{VhostUserFsConfig, VhostUserFsServer};

fn usage() -> ExitCode {
    eprintln!(
        "usage: fs-vhost-user --socket PATH [--request-queues N] [--queue-size N] [--xattr] --grant SESSION:MOUNT:HOST_PATH:MODE..."
    );
    ExitCode::from(2)
}

/// A `--grant` value.
struct Grant {
    session: String,
    mount: String,
    host: PathBuf,
    mode: GrantMode,
}

fn parse_grant(v: &str) -> Option<Grant> {
    let mut it = v.splitn(4, ':');
    let (session, mount, host, mode) = (it.next()?, it.next()?, it.next()?, it.next()?);
    Some(Grant {
        session: session.to_string(),
        mount: mount.to_string(),
        host: PathBuf::from(host),
        mode: GrantMode::parse(mode)?,
    })
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let mut args = std::env::args().skip(1);
    let mut socket = None;
    let mut queues = None;
    let mut qsize = None;
    let mut grants = Vec::new();
    let mut fs_options = SessionFsOptions::default();
    while let Some(a) = args.next() {
        if a == "--xattr" {
            fs_options.xattr = true;
            continue;
        }
        let Some(v) = args.next() else {
            return usage();
        };
        match a.as_str() {
            "--socket" => socket = Some(PathBuf::from(v)),
            "--request-queues" => match v.parse() {
                Ok(n) => queues = Some(n),
                Err(_) => return usage(),
            },
            "--queue-size" => match v.parse() {
                Ok(n) => qsize = Some(n),
                Err(_) => return usage(),
            },
            "--grant" => match parse_grant(&v) {
                Some(g) => grants.push(g),
                None => {
                    eprintln!("fs-vhost-user: bad --grant {v:?}");
                    return usage();
                }
            },
            _ => return usage(),
        }
    }
    let Some(socket) = socket else {
        return usage();
    };
    let mut cfg = VhostUserFsConfig::new(socket);
    if let Some(n) = queues {
        cfg.request_queues = n;
    }
    if let Some(n) = qsize {
        cfg.queue_size = n;
    }
    let fs = Arc::new(SessionFs::new(fs_options));
    for g in &grants {
        if let Err(e) = fs.add_grant(&g.session, &g.mount, &g.host, g.mode) {
            eprintln!("fs-vhost-user: {e}");
            return ExitCode::FAILURE;
        }
    }
    let server = match VhostUserFsServer::bind(&cfg, fs) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("fs-vhost-user: {e}");
            return ExitCode::FAILURE;
        }
    };
    let stats = server.stats();
    let res = server.run();
    eprintln!(
        "fs-vhost-user: {} requests, {} malformed",
        stats.chains.load(Ordering::Relaxed),
        stats.malformed.load(Ordering::Relaxed)
    );
    let ops: Vec<String> = stats
        .opcode_counts()
        .iter()
        .map(|(op, n)| format!("{op}:{n}"))
        .collect();
    eprintln!("fs-vhost-user: requests by FUSE opcode: {}", ops.join(" "));
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fs-vhost-user: {e}");
            ExitCode::FAILURE
        }
    }
}
