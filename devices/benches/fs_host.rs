//! virtio-fs server versus the host filesystem, over `/dev/fuse`.
//!
//! `cargo bench -p devices --bench fs_host` (as root: it mounts). The same
//! `SessionFs` the virtio-fs device serves is mounted on the host with
//! `HostMount` (one `rwd` grant of a scratch directory) and the same
//! workload runs against the scratch directory directly and through the
//! mount:
//!
//! * sequential write: a 256 MiB file in 1 MiB `write`s, then close. The
//!   mount has no write-back cache, so every write reached the server (and
//!   the host page cache) when it returns; neither side fsyncs.
//! * sequential read: the same file in 1 MiB `read`s, with the host page
//!   cache warm and the reading side's own cache dropped first
//!   (`posix_fadvise(DONTNEED)` on the mount), i.e. what a guest reading a
//!   host file it has not cached sees.
//! * metadata: 5,000 small files (100 bytes) created, then each `stat`ed,
//!   then each unlinked; ops/s counts the 15,000 create/stat/unlink calls.
//!
//! Each figure is the best of [`ROUNDS`] rounds. Environment overrides:
//! `FS_BENCH_MIB` (file size), `FS_BENCH_FILES` (file count),
//! `FS_BENCH_DIR` (where the scratch directory and mount point go),
//! `FS_BENCH_WORKERS` (server threads, default 2), `FS_BENCH_MODE` (the
//! grant's mode, `rwd` by default; `rw` adds the server's "created by the
//! guest" check to every unlink), `FS_BENCH_OWNER` (a uid: the grant
//! presents it as owner and group of its files, as session grants do; the
//! benchmark still runs as root).

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use devices::fs::fusedev::HostMount;
use devices::fs::{GrantMode, GrantOwner, SessionFs, SessionFsOptions};

/// Rounds per figure; the best is reported.
const ROUNDS: usize = 3;
/// Size of one read or write call.
const CHUNK: usize = 1 << 20;
/// Default sequential file size in MiB.
const DEFAULT_MIB: usize = 256;
/// Default number of small files.
const DEFAULT_FILES: usize = 5000;
/// Size of each small file.
const SMALL_FILE: usize = 100;
/// Default server worker threads.
const DEFAULT_WORKERS: usize = 2;
/// Default grant mode: deletion without the `rw` creation check.
const DEFAULT_MODE: GrantMode = GrantMode::Rwd;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The grant mode from `FS_BENCH_MODE` (default `rwd`); `ro` cannot run the
/// workload.
fn env_mode() -> GrantMode {
    match std::env::var("FS_BENCH_MODE") {
        Err(_) => DEFAULT_MODE,
        Ok(v) => match GrantMode::parse(&v) {
            Some(GrantMode::Ro) | None => panic!("FS_BENCH_MODE must be rw or rwd, not {v:?}"),
            Some(m) => m,
        },
    }
}

fn mib_per_s(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / (1024.0 * 1024.0) / d.as_secs_f64()
}

fn seq_write(path: &Path, mib: usize) -> Duration {
    let buf: Vec<u8> = (0..CHUNK).map(|i| (i * 31 % 251) as u8).collect();
    let start = Instant::now();
    let mut f = File::create(path).expect("create the big file");
    for _ in 0..mib {
        f.write_all(&buf).expect("write");
    }
    drop(f);
    start.elapsed()
}

fn seq_read(path: &Path, mib: usize, drop_own_cache: bool) -> Duration {
    let mut f = File::open(path).expect("open the big file");
    if drop_own_cache {
        // SAFETY: plain advice on an open fd.
        let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(r, 0, "posix_fadvise");
    }
    let mut buf = vec![0u8; CHUNK];
    let mut total = 0;
    let start = Instant::now();
    loop {
        let n = f.read(&mut buf).expect("read");
        if n == 0 {
            break;
        }
        total += n;
    }
    let d = start.elapsed();
    assert_eq!(total, mib * CHUNK, "short read");
    d
}

fn metadata(dir: &Path, files: usize) -> Duration {
    let work = dir.join("meta");
    std::fs::create_dir_all(&work).expect("create the metadata dir");
    let data = [b'm'; SMALL_FILE];
    let names: Vec<PathBuf> = (0..files).map(|i| work.join(format!("f{i:05}"))).collect();
    let start = Instant::now();
    for p in &names {
        File::create(p)
            .and_then(|mut f| f.write_all(&data))
            .expect("create a small file");
    }
    for p in &names {
        let m = std::fs::metadata(p).expect("stat");
        assert_eq!(m.len() as usize, SMALL_FILE);
    }
    for p in &names {
        std::fs::remove_file(p).expect("unlink");
    }
    let d = start.elapsed();
    std::fs::remove_dir(&work).expect("remove the metadata dir");
    d
}

/// Best-of-ROUNDS figures for one target directory.
struct Figures {
    write_mib_s: f64,
    read_mib_s: f64,
    meta_ops_s: f64,
}

fn measure(dir: &Path, mib: usize, files: usize, through_mount: bool) -> Figures {
    let big = dir.join("big.bin");
    let mut best = Figures {
        write_mib_s: 0.0,
        read_mib_s: 0.0,
        meta_ops_s: 0.0,
    };
    for _ in 0..ROUNDS {
        let w = seq_write(&big, mib);
        best.write_mib_s = best.write_mib_s.max(mib_per_s(mib * CHUNK, w));
        let r = seq_read(&big, mib, through_mount);
        best.read_mib_s = best.read_mib_s.max(mib_per_s(mib * CHUNK, r));
        std::fs::remove_file(&big).expect("remove the big file");
        let m = metadata(dir, files);
        best.meta_ops_s = best.meta_ops_s.max((3 * files) as f64 / m.as_secs_f64());
    }
    best
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else is accepted.
    let mib = env_usize("FS_BENCH_MIB", DEFAULT_MIB);
    let files = env_usize("FS_BENCH_FILES", DEFAULT_FILES);
    let workers = env_usize("FS_BENCH_WORKERS", DEFAULT_WORKERS);
    let mode = env_mode();
    let owner = std::env::var("FS_BENCH_OWNER")
        .ok()
        .filter(|v| !v.is_empty())
        .map(|v| {
            GrantOwner::same(
                v.parse()
                    .unwrap_or_else(|_| panic!("FS_BENCH_OWNER must be a uid, not {v:?}")),
            )
        });
    let base = std::env::var_os("FS_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let scratch = tempfile::Builder::new()
        .prefix("fs-bench-data")
        .tempdir_in(&base)
        .expect("scratch dir");
    let mnt = tempfile::Builder::new()
        .prefix("fs-bench-mnt")
        .tempdir_in(&base)
        .expect("mount point");

    let host = measure(scratch.path(), mib, files, false);

    let fs = Arc::new(SessionFs::new(SessionFsOptions::default()));
    fs.add_grant_with_owner("bench", "data", scratch.path(), mode, owner)
        .expect("grant the scratch dir");
    let mount =
        HostMount::mount(fs, mnt.path(), workers).expect("mount over /dev/fuse (run as root)");
    let through = mount.mountpoint().join("bench/data");
    let ours = measure(&through, mib, files, true);
    mount.unmount().expect("unmount");

    println!(
        "virtio-fs server over /dev/fuse vs the host filesystem ({} grant, owner {}, {} workers, best of {ROUNDS}, scratch in {})",
        mode,
        owner.map_or_else(|| "host".to_string(), |o| o.to_string()),
        workers,
        base.display()
    );
    println!(
        "{:<36} {:>12} {:>12} {:>7}",
        "", "host fs", "our server", "ratio"
    );
    let row = |name: String, h: f64, o: f64| {
        println!("{name:<36} {h:>12.1} {o:>12.1} {:>7.2}", o / h);
    };
    row(
        format!("seq write {mib} MiB (MiB/s)"),
        host.write_mib_s,
        ours.write_mib_s,
    );
    row(
        format!("seq read {mib} MiB (MiB/s)"),
        host.read_mib_s,
        ours.read_mib_s,
    );
    row(
        format!("create+stat+unlink {files} files (ops/s)"),
        host.meta_ops_s,
        ours.meta_ops_s,
    );
}
