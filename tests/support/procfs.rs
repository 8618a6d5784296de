//! What `/proc` says about the helper under test and its children: child
//! processes by name, threads, open KVM descriptors, memory figures. Linux
//! only; a process that is gone reads as empty (`Vec::new()` or `None`).

/// Children of `pid` whose command name (`comm`, at most 15 bytes) starts
/// with `prefix`.
pub fn children_named(pid: u32, prefix: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
                return false;
            };
            // pid (comm) state ppid ...
            let Some((head, rest)) = stat.rsplit_once(") ") else {
                return false;
            };
            let comm = head.split_once(" (").map_or("", |(_, c)| c);
            let ppid = rest.split_whitespace().nth(1).and_then(|s| s.parse().ok());
            ppid == Some(pid) && comm.starts_with(prefix)
        })
        .collect()
}

/// Names of the threads of `pid`.
pub fn thread_names(pid: u32) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect()
}

/// Open fds of `pid` on `/dev/kvm` or KVM's anonymous inodes (VM, vCPUs).
pub fn kvm_fds(pid: u32) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|t| t.to_string_lossy().into_owned())
        .filter(|t| t == "/dev/kvm" || t.starts_with("anon_inode:kvm"))
        .collect()
}

/// Resident KiB of the mappings of `pid` at least `min_kib` large (a
/// guest's RAM: nothing else in the helper maps that much).
pub fn large_mappings_rss_kib(pid: u32, min_kib: u64) -> Option<u64> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let kib = |l: &str, key: &str| -> Option<u64> {
        l.strip_prefix(key)?.split_whitespace().next()?.parse().ok()
    };
    let mut total = 0;
    let mut size = 0;
    for l in smaps.lines() {
        if let Some(s) = kib(l, "Size:") {
            size = s;
        } else if let Some(r) = kib(l, "Rss:") {
            if size >= min_kib {
                total += r;
            }
        }
    }
    Some(total)
}

/// `field` (e.g. `VmRSS`) of `/proc/<pid>/status`, in KiB.
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Open descriptors of `pid` by kind, counted: the link target with any
/// inode number dropped (`anon_inode:[eventfd]`, `socket`, `pipe`,
/// `anon_inode:[eventpoll]`, or the file's path).
pub fn fd_kinds(pid: u32) -> std::collections::BTreeMap<String, usize> {
    let mut kinds = std::collections::BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return kinds;
    };
    for target in dir
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
    {
        let t = target.to_string_lossy();
        let numbered = |n: &str| {
            n.strip_suffix(']')
                .is_some_and(|d| d.bytes().all(|b| b.is_ascii_digit()))
        };
        let kind = match t.split_once(":[") {
            Some((k, rest)) if numbered(rest) => k.to_string(),
            _ => t.into_owned(),
        };
        *kinds.entry(kind).or_insert(0) += 1;
    }
    kinds
}

/// `fd_kinds(pid)` once two readings 300 ms apart agree (threads that end
/// after stopVM's reply close theirs), at most 10 s.
pub async fn settled_fd_kinds(pid: u32) -> std::collections::BTreeMap<String, usize> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut last = fd_kinds(pid);
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let now = fd_kinds(pid);
        if now == last || std::time::Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}
