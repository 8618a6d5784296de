//! The checks both VM backends (`qemu_e2e`/`qemu_userland` under QEMU,
//! `kvm_backend` in-process) make of a session: host folders mounted `ro`
//! and `rw` through the backend's virtio-fs share (host-enforced modes), and
//! that a VM's default userland is one a Claude Code session can work in
//! (GNU bash, python with ssl/sqlite3/venv, node, git, curl, jq, file, its
//! own non-root user, homes closed to other sessions, a read-only `/usr`).
//!
//! Limits: the userland checks need the default Debian userland
//! (`rootfs.img`); host folders must have UTF-8 paths (they are sent as
//! JSON strings).

use std::path::{Path, PathBuf};
use std::time::Duration;

use cowork_helper::client::{Pipe, Subscription};
use serde_json::json;

use super::session::{assert_exit_0, bash, mounts_dir, ok, read_file, rel, run, sh};

/// What `readme.txt` in the `ro` host folder holds.
pub const RO_README: &str = "host ro content\n";
/// What the guest writes to `rw/new.txt` (one word: it is echoed).
pub const RW_WRITTEN: &str = "from-guest";

/// Two host folders a session mounts: `ro` (holding `readme.txt`) and `rw`.
pub struct HostFolders {
    /// Mounted `ro` as `ro`.
    pub ro: PathBuf,
    /// Mounted `rw` as `rw`.
    pub rw: PathBuf,
}

impl HostFolders {
    /// Makes `<base>/ro` (with `readme.txt`) and `<base>/rw`.
    pub fn create(base: &Path) -> HostFolders {
        let (ro, rw) = (base.join("ro"), base.join("rw"));
        for d in [&ro, &rw] {
            std::fs::create_dir_all(d).expect("host dir");
        }
        std::fs::write(ro.join("readme.txt"), RO_README).expect("ro/readme.txt");
        HostFolders { ro, rw }
    }
}

/// The host folders at spawn: process `id` in `session` runs `/bin/sh` with
/// `ro` and `rw` in `additionalMounts` (none may fail), reads `ro`'s readme,
/// is refused a new file in `ro` and writes `rw/new.txt`, then
/// runs `more` (shell lines). Asserts exit 0 and those three lines, and on
/// the host: the write arrived, the refused file does not exist, the readme
/// is unchanged. Returns the stdout of `more`.
pub async fn host_folders(
    pipe: &Pipe,
    sub: &mut Subscription,
    folders: &HostFolders,
    id: &str,
    session: &str,
    more: &str,
    limit: Duration,
) -> String {
    let m = mounts_dir(session);
    let script = format!(
        "cat {m}/ro/readme.txt
         (echo x > {m}/ro/evil.txt) 2>/dev/null && echo create-ro=ok || echo create-ro=refused
         echo {RW_WRITTEN} > {m}/rw/new.txt && echo write-rw=ok
         {more}"
    );
    let mut params = sh(id, session, &script);
    params["additionalMounts"] = json!({
        "ro": {"path": rel(&folders.ro), "mode": "ro"},
        "rw": {"path": rel(&folders.rw), "mode": "rw"}});
    let r = pipe.call("spawn", params).await.expect("spawn with mounts");
    assert_eq!(r["failedMounts"], json!([]), "{r}");
    let out = sub
        .collect_process(id, limit)
        .await
        .unwrap_or_else(|e| panic!("process {id}: {e}"));
    let text = out.stdout_str();
    eprintln!("{id}: host folders: {text:?} stderr {:?}", out.stderr_str());
    assert_exit_0(id, &out);
    let checked = format!("{RO_README}create-ro=refused\nwrite-rw=ok\n");
    let Some(rest) = text.strip_prefix(&checked) else {
        panic!(
            "expected {checked:?} first, got {text:?} (stderr: {})",
            out.stderr_str()
        );
    };
    // The host sees the guest's write; the refused change did not happen.
    assert_eq!(
        std::fs::read_to_string(folders.rw.join("new.txt")).unwrap(),
        format!("{RW_WRITTEN}\n")
    );
    assert!(!folders.ro.join("evil.txt").exists());
    assert_eq!(
        std::fs::read_to_string(folders.ro.join("readme.txt")).unwrap(),
        RO_README
    );
    rest.to_string()
}

/// The checks of a default (Debian) userland session, in sessions
/// `<tag>-a` and `<tag>-b`.
pub async fn default_userland(pipe: &Pipe, sub: &mut Subscription, tag: &str, limit: Duration) {
    let a = format!("{tag}-a");
    let b = format!("{tag}-b");

    // GNU bash is the spawn command itself; the OS is ours.
    let out = ok(
        pipe,
        sub,
        &format!("{tag}-bash"),
        &a,
        "echo \"$BASH_VERSION\"; bash --version | head -n1; . /etc/os-release; echo \"os=$ID\"",
        limit,
    )
    .await;
    assert!(
        out.contains("GNU bash") && out.contains("os=debian"),
        "{out:?}"
    );

    // Who the session is: its own non-root user, its home, its env.
    let out = ok(
        pipe,
        sub,
        &format!("{tag}-id"),
        &a,
        "id -u; id -g; id -un; echo \"home=$HOME shell=$SHELL user=$USER tmp=$TMPDIR lang=$LANG\"; \
         stat -c '%a %u' \"$HOME\"; pwd; grep -E '^Cap(Eff|Prm|Bnd)|^NoNewPrivs' /proc/self/status",
        limit,
    )
    .await;
    let lines: Vec<&str> = out.lines().collect();
    let uid: u32 = lines[0].parse().expect("uid");
    assert_ne!(uid, 0, "sessions must not run as root: {out}");
    assert_eq!(lines[1], lines[0], "gid == uid: {out}");
    assert_eq!(lines[2], a, "login name is the session name: {out}");
    assert_eq!(
        lines[3],
        format!("home=/sessions/{a} shell=/bin/bash user={a} tmp=/sessions/{a}/tmp lang=C.UTF-8"),
        "{out}"
    );
    assert_eq!(lines[4], format!("700 {uid}"), "home mode and owner: {out}");
    for cap in [
        "CapEff:\t0000000000000000",
        "CapPrm:\t0000000000000000",
        "CapBnd:\t0000000000000000",
        "NoNewPrivs:\t1",
    ] {
        assert!(out.contains(cap), "{cap} missing: {out}");
    }

    // What no systemd sets up, the agent did: /dev/fd (process
    // substitution), the hostname, resolv.conf, a raised open-file limit;
    // the overlay's layers are hidden from sessions.
    let out = ok(
        pipe,
        sub,
        &format!("{tag}-dev"),
        &a,
        "readlink /dev/fd; cat <(echo substituted); hostname; test -f /etc/resolv.conf && echo resolv; \
         ulimit -n; ls -A /run/cowork/userland 2>/dev/null | wc -l",
        limit,
    )
    .await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[..4],
        ["/proc/self/fd", "substituted", "claude", "resolv"],
        "{out}"
    );
    let nofile: u64 = lines[4].parse().expect("ulimit -n");
    assert!(nofile >= 65536, "open-file limit {nofile}");
    assert_eq!(lines[5], "0", "the overlay's layers are visible: {out}");

    // Python with ssl, sqlite3 and venv; a venv can be made in the home.
    let out = ok(
        pipe,
        sub,
        &format!("{tag}-py"),
        &a,
        "python3 -c 'import ssl, sqlite3, venv, json; c = sqlite3.connect(\":memory:\"); \
         print(ssl.OPENSSL_VERSION.split()[0], c.execute(\"select 6*7\").fetchone()[0])' && \
         python3 -m venv --without-pip ~/venv && ~/venv/bin/python -c 'import sys; print(sys.prefix)'",
        limit,
    )
    .await;
    assert!(
        out.contains("OpenSSL 42") && out.contains(&format!("/sessions/{a}/venv")),
        "{out:?}"
    );

    // Node.
    let out = ok(
        pipe,
        sub,
        &format!("{tag}-node"),
        &a,
        "node -e 'console.log(process.version, [1,2,3].map(x => x * 2).join(\",\"))'",
        limit,
    )
    .await;
    assert!(out.starts_with('v') && out.contains("2,4,6"), "{out:?}");

    // git init/add/commit in the home.
    let out = ok(
        pipe,
        sub,
        &format!("{tag}-git"),
        &a,
        "cd ~ && git init -q repo && cd repo && echo hello > a.txt && git add a.txt && \
         git -c user.name=t -c user.email=t@example.invalid commit -qm first && git log --format=%s",
        limit,
    )
    .await;
    assert_eq!(out, "first\n");

    // curl, jq and file are there and work offline.
    let out = ok(
        pipe,
        sub,
        &format!("{tag}-tools"),
        &a,
        "curl --version | head -n1; echo '{\"k\":[1,2]}' | jq -c '.k | length'; file -b /bin/bash | cut -d, -f1",
        limit,
    )
    .await;
    assert!(
        out.starts_with("curl ") && out.contains("\n2\n") && out.contains("ELF 64-bit"),
        "{out:?}"
    );

    // /usr is not writable; the session's own tmp is.
    let out = run(
        pipe,
        sub,
        bash(
            &format!("{tag}-usr"),
            &a,
            "touch /usr/bin/x 2>&1; touch /usr/x 2>&1; touch \"$TMPDIR/ok\" && echo tmp-ok",
        ),
        limit,
    )
    .await;
    let text = out.stdout_str();
    assert_eq!(
        text.matches("Permission denied").count(),
        2,
        "/usr writable? {text:?}"
    );
    assert!(text.ends_with("tmp-ok\n"), "{text:?}");

    // Another session's home is closed: b cannot list or read a's files.
    ok(
        pipe,
        sub,
        &format!("{tag}-secret"),
        &a,
        "echo secret-of-a > ~/secret.txt",
        limit,
    )
    .await;
    let out = run(
        pipe,
        sub,
        bash(
            &format!("{tag}-peek"),
            &b,
            &format!("id -u; ls /sessions/{a} 2>&1; cat /sessions/{a}/secret.txt 2>&1; echo end"),
        ),
        limit,
    )
    .await;
    let text = out.stdout_str();
    let b_uid: u32 = text
        .lines()
        .next()
        .and_then(|l| l.parse().ok())
        .expect("b's uid");
    assert!(b_uid != 0 && b_uid != uid, "b has its own uid: {text}");
    assert!(!text.contains("secret-of-a"), "b read a's file: {text}");
    assert_eq!(
        text.matches("Permission denied").count(),
        2,
        "b must be refused twice: {text}"
    );
    // The host still reads it (readFile runs as the agent).
    assert_eq!(
        read_file(pipe, &a, "secret.txt").await.as_deref(),
        Ok("secret-of-a\n")
    );
}
