//! Unit tests of the cgroup module: the texts of `/proc/self/mountinfo` and
//! `/proc/self/cgroup` (this hybrid host's, a unified desktop's, a
//! container's), and the cgroup work over fake cgroup trees in temporary
//! directories (plain files stand in for the kernel's control files). The
//! real kernels are exercised by `tests/sandbox_limits.rs`.

use std::fs;
use std::path::{Path, PathBuf};

use super::v2::Values;
use super::*;
use crate::backend::sandbox::limits::{Hold, Limit, Limits};

const MIB: u64 = 1024 * 1024;

/// This machine's mountinfo (2026-12-05): v1 controllers each on their own
/// hierarchy, a cgroup2 mount without controllers.
const HYBRID_MOUNTINFO: &str = "\
22 28 0:20 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

const HYBRID_CGROUP: &str = "\
9:name=systemd:/
8:pids:/
4:memory:/process_api/e2211458
2:cpuacct:/
1:cpu:/
0::/
";

/// A unified desktop (Debian 12, a helper started by the client).
const UNIFIED_MOUNTINFO: &str = "\
25 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
30 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";

const UNIFIED_CGROUP: &str =
    "0::/user.slice/user-1000.slice/user@1000.service/app.slice/app-claude-1234.scope\n";

fn limits() -> Limits {
    Limits {
        memory_bytes: 512 * MIB,
        pids: 4096,
        cpus: 1,
    }
}

/// Makes `files` (name, content) in `dir`.
fn files(dir: &Path, files: &[(&str, &str)]) {
    fs::create_dir_all(dir).unwrap();
    for (name, content) in files {
        fs::write(dir.join(name), content).unwrap();
    }
}

fn read(p: impl AsRef<Path>) -> String {
    fs::read_to_string(p).unwrap()
}

// ------------------------------------------------------------------ texts

#[test]
fn mountinfo_names_the_hierarchies() {
    let m = parse_mountinfo(HYBRID_MOUNTINFO);
    assert_eq!(m.len(), 7, "{m:?}");
    let memory = m
        .iter()
        .find(|m| m.point == Path::new("/sys/fs/cgroup/memory"))
        .unwrap();
    assert_eq!(memory.v1_controllers, Some(vec!["memory".to_string()]));
    assert_eq!(memory.root, "/");
    let named = m
        .iter()
        .find(|m| m.point == Path::new("/sys/fs/cgroup/systemd"))
        .unwrap();
    assert_eq!(named.v1_controllers, Some(vec![]), "name= is no controller");
    let unified = m.iter().find(|m| m.v1_controllers.is_none()).unwrap();
    assert_eq!(unified.point, Path::new("/sys/fs/cgroup/unified"));

    // Co-mounted controllers and escaped mount points.
    let m = parse_mountinfo(
        "40 31 0:37 /docker/ab /sys/fs/cgroup/cpu\\040acct rw - cgroup cgroup rw,cpu,cpuacct\n",
    );
    assert_eq!(m[0].point, Path::new("/sys/fs/cgroup/cpu acct"));
    assert_eq!(m[0].root, "/docker/ab");
    assert_eq!(
        m[0].v1_controllers,
        Some(vec!["cpu".to_string(), "cpuacct".to_string()])
    );
    assert!(parse_mountinfo("garbage\n\n1 2 3\n").is_empty());
}

#[test]
fn proc_cgroup_lists_v1_and_v2() {
    let m = parse_proc_cgroup(HYBRID_CGROUP);
    assert_eq!(m.v2.as_deref(), Some("/"));
    assert_eq!(m.v1_path("memory"), Some("/process_api/e2211458"));
    assert_eq!(m.v1_path("pids"), Some("/"));
    assert_eq!(
        m.v1_path("systemd"),
        None,
        "name=systemd is not a controller"
    );
    let m = parse_proc_cgroup("4:cpu,cpuacct:/a:b\n");
    assert_eq!(
        m.v1_path("cpuacct"),
        Some("/a:b"),
        "colons in paths survive"
    );
    let m = parse_proc_cgroup(UNIFIED_CGROUP);
    assert!(m.v1.is_empty());
    assert!(m.v2.unwrap().ends_with("app-claude-1234.scope"));
}

#[test]
fn the_hybrid_host_uses_v1_under_the_helpers_own_cgroups() {
    let Layout::V1(dirs) = detect(HYBRID_MOUNTINFO, HYBRID_CGROUP) else {
        panic!("v1 expected");
    };
    assert_eq!(
        dirs[&Controller::Memory],
        Path::new("/sys/fs/cgroup/memory/process_api/e2211458")
    );
    assert_eq!(dirs[&Controller::Pids], Path::new("/sys/fs/cgroup/pids"));
    assert_eq!(dirs[&Controller::Cpu], Path::new("/sys/fs/cgroup/cpu"));
    assert_eq!(
        dirs[&Controller::Cpuacct],
        Path::new("/sys/fs/cgroup/cpuacct")
    );
}

#[test]
fn a_unified_host_uses_v2() {
    let layout = detect(UNIFIED_MOUNTINFO, UNIFIED_CGROUP);
    let Layout::V2 { mount, own, dir } = layout else {
        panic!("v2 expected: {layout:?}");
    };
    assert_eq!(mount, Path::new("/sys/fs/cgroup"));
    assert!(own.starts_with("/user.slice/"));
    assert_eq!(
        dir,
        Path::new("/sys/fs/cgroup").join(own.trim_start_matches('/'))
    );
    // The root cgroup (a VM, the nested harness's L1).
    let layout = detect(UNIFIED_MOUNTINFO, "0::/\n");
    assert!(
        matches!(&layout, Layout::V2 { dir, .. } if dir == Path::new("/sys/fs/cgroup")),
        "{layout:?}"
    );
}

#[test]
fn subtree_mounts_and_missing_hierarchies() {
    // A container that sees its own subtree at the mount point.
    let mi = "30 24 0:26 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
    let Layout::V1(dirs) = detect(mi, "5:memory:/docker/abc/sub\n") else {
        panic!("v1");
    };
    assert_eq!(
        dirs[&Controller::Memory],
        Path::new("/sys/fs/cgroup/memory/sub")
    );
    // A cgroup outside the mounted subtree is not reachable.
    assert!(matches!(
        detect(mi, "5:memory:/docker/abcdef\n"),
        Layout::None(_)
    ));
    // No cgroup file system at all.
    let Layout::None(why) = detect("22 28 0:20 / /proc rw - proc proc rw\n", "0::/\n") else {
        panic!("none");
    };
    assert!(why.contains("no cgroup hierarchy"), "{why}");
    // A unified mount without a v2 line.
    assert!(matches!(detect(UNIFIED_MOUNTINFO, ""), Layout::None(_)));
}

#[test]
fn meminfo_swap() {
    assert_eq!(
        swap_total_kib("MemTotal: 1 kB\nSwapTotal:       0 kB\n"),
        Some(0)
    );
    assert_eq!(swap_total_kib("SwapTotal: 2097148 kB\n"), Some(2_097_148));
    assert_eq!(swap_total_kib("MemTotal: 1 kB\n"), None);
}

#[test]
fn names_carry_the_owner() {
    assert_eq!(owner_pid("cowork-sandbox-123-4"), Some(123));
    assert_eq!(owner_pid("cowork-sandbox-probe-123-4"), None);
    assert_eq!(owner_pid("cowork-sandbox-123"), None);
    assert_eq!(owner_pid("other"), None);
    let a = next_name(77);
    let b = next_name(77);
    assert!(a.starts_with("cowork-sandbox-77-") && a != b, "{a} {b}");
}

// ------------------------------------------------------------------ v1

/// A fake v1 cgroup directory with the control files the kernel would make.
fn fake_v1_dir(dir: &Path, memsw: bool) {
    let mut f = vec![
        ("cgroup.procs", ""),
        ("memory.limit_in_bytes", "9223372036854771712"),
        ("memory.swappiness", "60"),
        ("pids.max", "max"),
        ("cpu.cfs_period_us", "100000"),
        ("cpu.cfs_quota_us", "-1"),
    ];
    if memsw {
        f.push(("memory.memsw.limit_in_bytes", "9223372036854771712"));
    }
    files(dir, &f);
}

#[test]
fn v1_limits_are_written_and_read_back() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("cg");
    fake_v1_dir(&dir, true);
    let l = limits();
    for c in [Controller::Memory, Controller::Pids, Controller::Cpu] {
        v1::write_limits(c, &dir, &l).expect("written");
    }
    assert_eq!(read(dir.join("memory.limit_in_bytes")), "536870912");
    assert_eq!(read(dir.join("memory.memsw.limit_in_bytes")), "536870912");
    assert_eq!(read(dir.join("pids.max")), "4096");
    assert_eq!(read(dir.join("cpu.cfs_period_us")), "100000");
    assert_eq!(read(dir.join("cpu.cfs_quota_us")), "100000");
    let two = Limits { cpus: 2, ..l };
    assert_eq!(v1::cpu_quota_us(&two), 200_000);

    let dirs = vec![(
        vec![Controller::Memory, Controller::Pids, Controller::Cpu],
        dir.clone(),
    )];
    let e = v1::verify(&dirs, &l, false);
    assert!(e.complete(), "{e:?}");
    assert_eq!(
        e.get(Limit::Swap),
        Hold::Enforced("cgroup v1 memory.memsw.limit_in_bytes".into())
    );
    // Another request's values do not pass as this one's.
    let e = v1::verify(&dirs, &Limits { pids: 10, ..l }, false);
    let Hold::Missing(why) = e.get(Limit::Processes) else {
        panic!("{e:?}")
    };
    assert!(why.contains("reads 4096, not 10"), "{why}");
}

#[test]
fn v1_without_swap_accounting() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("cg");
    fake_v1_dir(&dir, false);
    v1::write_limits(Controller::Memory, &dir, &limits()).unwrap();
    assert_eq!(read(dir.join("memory.swappiness")), "0", "the best effort");
    let dirs = vec![(vec![Controller::Memory], dir)];
    let e = v1::verify(&dirs, &limits(), false);
    assert!(e.get(Limit::Memory).is_enforced());
    let Hold::Missing(why) = e.get(Limit::Swap) else {
        panic!("{e:?}")
    };
    assert!(why.contains("swapaccount=1"), "{why}");
    // A host without swap needs none.
    let e = v1::verify(&dirs, &limits(), true);
    assert_eq!(
        e.get(Limit::Swap),
        Hold::Enforced("the host has no swap".into())
    );
    // Hierarchies that took no cgroup.
    let Hold::Missing(why) = e.get(Limit::Cpu) else {
        panic!()
    };
    assert!(why.contains("no cgroup v1 cpu hierarchy"), "{why}");
}

#[test]
fn v1_create_makes_one_directory_per_hierarchy_and_clears_stale_ones() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    // cpu and cpuacct co-mounted; pids not writable (absent here).
    let memory = root.join("memory/own");
    let cpu = root.join("cpu,cpuacct");
    fs::create_dir_all(&memory).unwrap();
    fs::create_dir_all(&cpu).unwrap();
    // A dead helper's cgroup (pid above any pid_max) with a session child,
    // a live helper's (ours) and an unrelated directory.
    let stale = memory.join("cowork-sandbox-999999999-3");
    fs::create_dir_all(stale.join("proc-1-0")).unwrap();
    let mine = memory.join(format!("cowork-sandbox-{}-9", std::process::id()));
    fs::create_dir_all(&mine).unwrap();
    fs::create_dir_all(memory.join("unrelated")).unwrap();

    let own: BTreeMap<Controller, PathBuf> = [
        (Controller::Memory, memory.clone()),
        (Controller::Pids, root.join("pids/missing")),
        (Controller::Cpu, cpu.clone()),
        (Controller::Cpuacct, cpu.clone()),
    ]
    .into();
    let facts = HostFacts {
        pid: std::process::id(),
        ..HostFacts::default()
    };
    let (cg, e) = v1::create(&own, "cowork-sandbox-1-0", &limits(), &facts).expect("created");
    assert!(!stale.exists(), "the dead helper's cgroup is removed");
    assert!(mine.exists() && memory.join("unrelated").exists());
    assert_eq!(
        cg.dir(Controller::Memory),
        Some(memory.join("cowork-sandbox-1-0").as_path())
    );
    assert_eq!(cg.dir(Controller::Cpu), cg.dir(Controller::Cpuacct));
    assert_eq!(cg.dir(Controller::Pids), None);
    let Hold::Missing(why) = e.get(Limit::Processes) else {
        panic!("{e:?}")
    };
    assert!(why.contains("cannot create the cgroup"), "{why}");
    // The fake tree has no control files: nothing could be written, and
    // that is what the report says.
    let Hold::Missing(why) = e.get(Limit::Memory) else {
        panic!("{e:?}")
    };
    assert!(why.contains("memory.limit_in_bytes"), "{why}");

    let spec = cg.init_spec();
    assert_eq!(spec.join.len(), 2, "{spec:?}");
    assert!(spec
        .join
        .iter()
        .all(|p| p.ends_with("/cowork-sandbox-1-0/cgroup.procs")));
    assert_eq!(
        spec.agent_root.as_deref(),
        Some(memory.join("cowork-sandbox-1-0").to_str().unwrap())
    );
    assert_eq!(spec.leaf_under_own, None);
    assert!(cg.command_prefix().is_none());

    cg.remove().expect("removed");
    assert!(!memory.join("cowork-sandbox-1-0").exists());
    assert!(!cpu.join("cowork-sandbox-1-0").exists());

    // No hierarchy takes it: an error.
    let none: BTreeMap<Controller, PathBuf> = [(Controller::Memory, root.join("nope"))].into();
    let err = v1::create(&none, "cowork-sandbox-1-1", &limits(), &facts).unwrap_err();
    assert!(matches!(err, CgroupError::Unavailable(_)), "{err}");
    assert!(
        err.to_string().contains("cannot create the cgroup"),
        "{err}"
    );
}

// ------------------------------------------------------------------ v2

#[test]
fn v2_values_are_checked() {
    let l = limits();
    let good = Values {
        dir: "/sys/fs/cgroup/x".into(),
        memory_max: Some("536870912".into()),
        swap_max: Some("0".into()),
        pids_max: Some("4096".into()),
        cpu_max: Some("100000 100000".into()),
    };
    let e = v2::verify(&good, &l, false, "cgroup v2 /x");
    assert!(e.complete(), "{e:?}");
    assert_eq!(
        e.get(Limit::Cpu),
        Hold::Enforced("cgroup v2 /x cpu.max".into())
    );
    assert_eq!(v2::cpu_max(&Limits { cpus: 3, ..l }), "300000 100000");

    // No cpu controller delegated, no swap accounting, memory unlimited.
    let partial = Values {
        cpu_max: None,
        swap_max: None,
        memory_max: Some("max".into()),
        ..good.clone()
    };
    let e = v2::verify(&partial, &l, false, "x");
    let Hold::Missing(why) = e.get(Limit::Cpu) else {
        panic!()
    };
    assert!(why.contains("cpu controller is not enabled"), "{why}");
    let Hold::Missing(why) = e.get(Limit::Memory) else {
        panic!()
    };
    assert!(why.contains("reads \"max\""), "{why}");
    let Hold::Missing(why) = e.get(Limit::Swap) else {
        panic!()
    };
    assert!(why.contains("no swap accounting"), "{why}");
    assert!(e.get(Limit::Processes).is_enforced());
    // Without swap on the host, no swap accounting is needed.
    let e = v2::verify(&partial, &l, true, "x");
    assert!(e.get(Limit::Swap).is_enforced());
}

#[test]
fn v2_create_enables_controllers_and_makes_the_init_leaf() {
    let t = tempfile::tempdir().unwrap();
    let own = t.path().join("own");
    files(
        &own,
        &[
            ("cgroup.controllers", "cpuset cpu io memory pids"),
            ("cgroup.subtree_control", ""),
            ("cgroup.procs", ""),
        ],
    );
    fs::create_dir_all(own.join("cowork-sandbox-999999999-0/init")).unwrap();
    let facts = HostFacts {
        pid: std::process::id(),
        ..HostFacts::default()
    };
    let (cg, e) =
        v2::create(&own, "/own", "cowork-sandbox-5-0", &limits(), &facts).expect("created");
    assert_eq!(
        read(own.join("cgroup.subtree_control")),
        "+memory +pids +cpu"
    );
    assert!(!own.join("cowork-sandbox-999999999-0").exists(), "stale");
    let dir = own.join("cowork-sandbox-5-0");
    assert!(dir.join(INIT_LEAF).is_dir());
    // The fake cgroup has no control files: every limit is reported.
    assert!(!e.get(Limit::Memory).is_enforced());
    let spec = cg.init_spec();
    assert_eq!(
        spec.join,
        vec![dir.join("init/cgroup.procs").to_string_lossy().into_owned()]
    );
    assert_eq!(spec.agent_root.as_deref(), Some(dir.to_str().unwrap()));
    assert!(cg.describe().starts_with("cgroup v2 "));
    cg.remove().unwrap();
    assert!(!dir.exists());

    // Already enabled: nothing is written.
    fs::write(own.join("cgroup.subtree_control"), "cpu memory pids").unwrap();
    let (cg, _) = v2::create(&own, "/own", "cowork-sandbox-5-1", &limits(), &facts).unwrap();
    assert_eq!(read(own.join("cgroup.subtree_control")), "cpu memory pids");
    cg.remove().unwrap();

    // A cgroup that offers no limiting controller is refused.
    fs::write(own.join("cgroup.controllers"), "cpuset io").unwrap();
    let err = v2::create(&own, "/own", "cowork-sandbox-5-2", &limits(), &facts).unwrap_err();
    assert!(err.to_string().contains("offers none"), "{err}");

    // Only the cpu controller missing: that limit says why.
    fs::write(own.join("cgroup.controllers"), "memory pids").unwrap();
    let (cg, e) = v2::create(&own, "/own", "cowork-sandbox-5-3", &limits(), &facts).unwrap();
    let Hold::Missing(why) = e.get(Limit::Cpu) else {
        panic!()
    };
    assert!(why.contains("does not offer the cpu controller"), "{why}");
    cg.remove().unwrap();
}

#[test]
fn the_helper_moves_into_a_leaf_only_when_alone() {
    let t = tempfile::tempdir().unwrap();
    let own = t.path().join("svc");
    files(&own, &[("cgroup.procs", "4242\n")]);
    files(&own.join(HELPER_LEAF), &[("cgroup.procs", "")]);
    v2::move_into_leaf(&own, 4242).expect("alone");
    assert_eq!(read(own.join(HELPER_LEAF).join("cgroup.procs")), "4242");

    fs::write(own.join("cgroup.procs"), "4242\n17\n18\n").unwrap();
    let err = v2::move_into_leaf(&own, 4242).unwrap_err();
    assert!(matches!(err, CgroupError::Shared { .. }), "{err}");
    assert!(err.to_string().contains("pids 17, 18"), "{err}");
}

// ------------------------------------------------------------------ systemd

#[test]
fn systemd_run_is_asked_for_the_limits() {
    assert_eq!(
        systemd::parse_version("systemd 252 (252.38-1~deb12u1)\n+PAM +AUDIT"),
        Some(252)
    );
    assert_eq!(systemd::parse_version("garbage"), None);
    let l = Limits {
        cpus: 2,
        ..limits()
    };
    let c = systemd::command(
        Path::new("/usr/bin/systemd-run"),
        true,
        Some(252),
        &l,
        "cowork-sandbox-1-0",
    );
    let text = c.join(" ");
    assert!(
        text.starts_with("/usr/bin/systemd-run --user --scope --quiet --collect"),
        "{text}"
    );
    for want in [
        "--unit=cowork-sandbox-1-0",
        "-p MemoryMax=536870912",
        "-p MemorySwapMax=0",
        "-p TasksMax=4096",
        "-p CPUQuota=200%",
        "-p Delegate=yes",
    ] {
        assert!(text.contains(want), "{want} missing: {text}");
    }
    assert!(
        !text.contains("OOMPolicy"),
        "systemd 252 scopes do not know it"
    );
    assert_eq!(c.last().map(String::as_str), Some("--"));
    let c = systemd::command(Path::new("systemd-run"), false, Some(253), &l, "u");
    let text = c.join(" ");
    assert!(text.contains("-p OOMPolicy=continue"), "{text}");
    assert!(!text.contains("--user"), "{text}");

    let manager = systemd::Manager::from_facts(&HostFacts {
        systemd_run: Some("/usr/bin/systemd-run".into()),
        manager: Some(true),
        ..HostFacts::default()
    });
    assert_eq!(
        manager,
        Some(systemd::Manager {
            program: "/usr/bin/systemd-run".into(),
            user: true
        })
    );
    assert!(systemd::Manager::from_facts(&HostFacts {
        systemd_run: Some("/usr/bin/systemd-run".into()),
        ..HostFacts::default()
    })
    .is_none());
}

#[test]
fn a_scope_is_joined_by_the_init_itself() {
    let cg = SandboxCgroup {
        origin: Origin::Systemd {
            command: vec!["systemd-run".into(), "--".into()],
            mount: "/sys/fs/cgroup".into(),
        },
        dirs: Vec::new(),
    };
    let spec = cg.init_spec();
    assert!(spec.join.is_empty());
    assert_eq!(spec.leaf_under_own.as_deref(), Some("/sys/fs/cgroup"));
    assert_eq!(spec.agent_root, None, "the init finds its scope");
    assert_eq!(cg.command_prefix().map(<[String]>::len), Some(2));
    assert!(cg.remove().is_ok(), "systemd removes the scope");
    let e = cg.verify(&limits(), false);
    assert!(!e.get(Limit::Memory).is_enforced(), "scope not found yet");
}

// ------------------------------------------------------------------ placement

#[test]
fn without_a_cgroup_rlimits_stand_in() {
    let facts = HostFacts {
        disabled: Some(disabled_by_hook()),
        euid: 1000,
        swap_total_kib: Some(1024),
        ..HostFacts::default()
    };
    let p = place(&limits(), &facts, Path::new("/h"));
    assert!(p.cgroup.is_none());
    assert_eq!(p.rlimits.data, Some(512 * MIB));
    assert_eq!(p.rlimits.nproc, Some(4096));
    let Hold::StandIn { how, why } = p.enforcement.get(Limit::Memory) else {
        panic!("{:?}", p.enforcement)
    };
    assert_eq!(how, "RLIMIT_DATA 512 MiB per process");
    assert!(why.contains(DISABLE_ENV), "{why}");
    assert!(matches!(
        p.enforcement.get(Limit::Processes),
        Hold::StandIn { .. }
    ));
    assert!(matches!(p.enforcement.get(Limit::Cpu), Hold::Missing(_)));
    assert!(matches!(p.enforcement.get(Limit::Swap), Hold::Missing(_)));
    assert_eq!(p.enforcement.shortfalls().len(), 4);

    // Root: RLIMIT_NPROC would not bind; a host without swap needs none.
    let root = HostFacts {
        euid: 0,
        swap_total_kib: Some(0),
        ..facts
    };
    let p = place(&limits(), &root, Path::new("/h"));
    assert_eq!(p.rlimits.nproc, None);
    let Hold::Missing(why) = p.enforcement.get(Limit::Processes) else {
        panic!()
    };
    assert!(why.contains("does not apply it to root"), "{why}");
    assert!(p.enforcement.get(Limit::Swap).is_enforced());
}

#[test]
fn placement_on_a_fake_v1_host() {
    let t = tempfile::tempdir().unwrap();
    let base = t.path();
    for d in ["memory/job", "pids", "cpu", "cpuacct"] {
        fs::create_dir_all(base.join(d)).unwrap();
    }
    let mi = format!(
        "35 31 0:32 / {b}/memory rw - cgroup cgroup rw,memory\n\
         39 31 0:36 / {b}/pids rw - cgroup cgroup rw,pids\n\
         32 31 0:29 / {b}/cpu rw - cgroup cgroup rw,cpu\n\
         33 31 0:30 / {b}/cpuacct rw - cgroup cgroup rw,cpuacct\n",
        b = base.display()
    );
    let facts = HostFacts {
        mountinfo: mi,
        proc_cgroup: "8:pids:/\n4:memory:/job\n2:cpuacct:/\n1:cpu:/\n0::/\n".into(),
        pid: std::process::id(),
        euid: 0,
        swap_total_kib: Some(0),
        ..HostFacts::default()
    };
    let p = place(&limits(), &facts, Path::new("/h"));
    let cg = p.cgroup.expect("a cgroup");
    assert_eq!(*cg.origin(), Origin::V1);
    let mem = cg.dir(Controller::Memory).unwrap().to_path_buf();
    assert!(
        mem.starts_with(base.join("memory/job")),
        "{}",
        mem.display()
    );
    assert!(mem.is_dir());
    for c in [Controller::Pids, Controller::Cpu, Controller::Cpuacct] {
        assert!(cg.dir(c).unwrap().is_dir(), "{c:?}");
    }
    // Nothing could be written in the fake tree: stand-ins, except the
    // process count for root.
    assert_eq!(p.rlimits.data, Some(512 * MIB));
    assert_eq!(p.rlimits.nproc, None);
    cg.remove().unwrap();
    assert!(!mem.exists());
}

#[test]
fn removal_goes_children_first_and_tolerates_gone_directories() {
    let t = tempfile::tempdir().unwrap();
    let cg = t.path().join("cowork-sandbox-1-0");
    fs::create_dir_all(cg.join("init")).unwrap();
    fs::create_dir_all(cg.join("proc-7-0")).unwrap();
    remove_tree(&cg, Instant::now()).unwrap();
    assert!(!cg.exists());
    remove_tree(&cg, Instant::now()).expect("already gone is fine");
    // A directory that cannot be removed (holds a file) is an error.
    fs::create_dir_all(&cg).unwrap();
    fs::write(cg.join("x"), "").unwrap();
    assert!(matches!(
        remove_tree(&cg, Instant::now()),
        Err(CgroupError::Remove { .. })
    ));
}
