//! What the daemon and the sandbox init tell each other.
//!
//! The daemon passes an [`InitSpec`] as one JSON argument of
//! `__sandbox-init`. The init answers on its status pipe (fd
//! [`super::STATUS_FD`]) with [`Report`]s, one JSON object per line: the host
//! pid of the sandbox's PID 1, then either `exec` (the agent is about to be
//! executed; the pipe then closes through close-on-exec) or `failed` with the
//! step, the errno and a description. End of file without `exec` means the
//! init died before it got there. Lines are far below `PIPE_BUF`, so each
//! write is atomic.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::limits::Rlimits;

/// Largest status report the daemon reads; a longer one is a bug.
pub const MAX_REPORT_BYTES: u64 = 64 * 1024;

/// The init's instructions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitSpec {
    /// Host directory bound read-write at `/sessions`.
    pub sessions_dir: String,
    /// What PID 1 executes once the root is built.
    pub exec: ExecSpec,
    /// The daemon's pid: if the init's parent is no longer this process when
    /// its parent-death signal is armed, the daemon is gone already.
    pub parent_pid: i32,
    /// Host directory holding the egress proxy's socket, bound at
    /// [`super::EGRESS_DIR`] for the agent alone; none: no way out at all.
    #[serde(default)]
    pub egress_dir: Option<String>,
    /// The sandbox's cgroup, joined before anything else; none: the
    /// helper's own.
    #[serde(default)]
    pub cgroup: Option<CgroupSpec>,
    /// Stand-ins for limits no cgroup holds, set inside the user namespace.
    #[serde(default)]
    pub rlimits: Rlimits,
    /// `oom_score_adj` the agent gives the processes it spawns.
    #[serde(default)]
    pub session_oom_score_adj: Option<i32>,
    /// The helper's log filter (`--log`, `COWORK_LOG`): the init's own, and
    /// the agent's `COWORK_LOG`; none: their defaults. The init reads no
    /// environment variable: this spec is its whole input.
    #[serde(default)]
    pub log: Option<String>,
}

/// How the init gets into the sandbox's cgroup.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CgroupSpec {
    /// `cgroup.procs` files (host paths) the init writes its pid into, one
    /// per hierarchy.
    #[serde(default)]
    pub join: Vec<String>,
    /// A systemd scope (which the init already is in): the unified
    /// hierarchy's mount point. The init moves into the leaf
    /// [`super::cgroup::INIT_LEAF`] of its cgroup, whose directory becomes
    /// the agent's cgroup root.
    #[serde(default)]
    pub leaf_under_own: Option<String>,
    /// Host directory under which the agent gives each session a cgroup.
    #[serde(default)]
    pub agent_root: Option<String>,
}

/// The program PID 1 of the sandbox becomes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ExecSpec {
    /// The guest agent: the init's own executable run as `__agent`.
    Agent {
        /// `argv[0]` to show (the helper's path).
        argv0: String,
        /// Extra arguments appended after the fixed ones.
        args: Vec<String>,
    },
    /// Any program, by its absolute path inside the sandbox (tests).
    Command { argv: Vec<String> },
}

/// Where in the setup a failure happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Reading the arguments and descriptors given by the daemon.
    Arguments,
    /// Joining the sandbox's cgroup and setting its resource limits.
    Limits,
    /// `unshare(CLONE_NEWUSER)`.
    UserNamespace,
    /// Writing `setgroups`, `uid_map`, `gid_map`.
    IdMap,
    /// The mount, pid, ipc and uts namespaces, hostname, propagation.
    Namespaces,
    /// The network namespace and its loopback interface.
    Network,
    /// Forking PID 1.
    Fork,
    /// Building the root file system and pivoting into it.
    Root,
    /// Capabilities and executing the agent.
    Exec,
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stage::Arguments => "reading the init arguments",
            Stage::Limits => "applying the sandbox's resource limits",
            Stage::UserNamespace => "creating the user namespace",
            Stage::IdMap => "mapping the user and group ids",
            Stage::Namespaces => "creating the mount/pid/ipc/uts namespaces",
            Stage::Network => "creating the network namespace",
            Stage::Fork => "starting the sandbox's PID 1",
            Stage::Root => "building the sandbox root",
            Stage::Exec => "executing the agent",
        })
    }
}

/// One failed setup step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    pub stage: Stage,
    /// The operation, with its paths (`bind /usr read-only`).
    pub what: String,
    /// The errno, when a system call failed.
    pub errno: Option<i32>,
}

impl Failure {
    pub fn new(stage: Stage, what: impl Into<String>, err: &std::io::Error) -> Self {
        Self {
            stage,
            what: what.into(),
            errno: err.raw_os_error(),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.what)?;
        if let Some(errno) = self.errno {
            write!(f, ": {}", std::io::Error::from_raw_os_error(errno))?;
        }
        Ok(())
    }
}

/// Attaches a setup stage and a description to an I/O error.
pub trait Context<T> {
    fn context(self, stage: Stage, what: impl FnOnce() -> String) -> Result<T, Failure>;
}

impl<T> Context<T> for std::io::Result<T> {
    fn context(self, stage: Stage, what: impl FnOnce() -> String) -> Result<T, Failure> {
        self.map_err(|e| Failure::new(stage, what(), &e))
    }
}

/// One line on the status pipe.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Report {
    /// PID 1 of the sandbox exists; this is its pid in the daemon's view.
    Forked { pid: i32 },
    /// The agent is about to be executed.
    Exec,
    /// Setup failed; the init exits.
    Failed(Failure),
}

impl Report {
    /// The line written to the pipe (newline included).
    pub fn to_line(&self) -> Vec<u8> {
        // Plain enums of strings and integers always serialize.
        let mut line = serde_json::to_vec(self).unwrap_or_default();
        line.push(b'\n');
        line
    }
}

/// What a complete status stream said.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reports {
    pub forked: Option<i32>,
    pub exec: bool,
    pub failure: Option<Failure>,
    /// Lines that did not parse (kept for the error message).
    pub garbage: Vec<String>,
}

impl Reports {
    pub fn parse(bytes: &[u8]) -> Self {
        let mut out = Reports::default();
        for line in bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            match serde_json::from_slice::<Report>(line) {
                Ok(Report::Forked { pid }) => out.forked = Some(pid),
                Ok(Report::Exec) => out.exec = true,
                // The first failure is the cause; later ones are consequences.
                Ok(Report::Failed(f)) => {
                    out.failure.get_or_insert(f);
                }
                Err(_) => out.garbage.push(String::from_utf8_lossy(line).into_owned()),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_round_trips() {
        let spec = InitSpec {
            sessions_dir: "/var/lib/x y".into(),
            exec: ExecSpec::Agent {
                argv0: "/usr/bin/cowork-helper".into(),
                args: vec!["-v".into()],
            },
            parent_pid: 42,
            egress_dir: Some("/run/user/1000/cowork-sandbox-1-0".into()),
            cgroup: Some(CgroupSpec {
                join: vec!["/sys/fs/cgroup/memory/x/cgroup.procs".into()],
                leaf_under_own: None,
                agent_root: Some("/sys/fs/cgroup/memory/x".into()),
            }),
            rlimits: Rlimits {
                nproc: Some(4096),
                data: None,
            },
            session_oom_score_adj: Some(500),
            log: None,
        };
        let json = serde_json::to_string(&spec).expect("serialize");
        assert_eq!(
            serde_json::from_str::<InitSpec>(&json).expect("parse"),
            spec
        );
        let cmd = ExecSpec::Command {
            argv: vec!["/bin/sh".into()],
        };
        let json = serde_json::to_string(&cmd).expect("serialize");
        assert!(json.contains("\"kind\":\"command\""), "{json}");
    }

    #[test]
    fn reports_parse_in_any_order() {
        let fail = Failure {
            stage: Stage::Root,
            what: "bind /usr".into(),
            errno: Some(libc::EPERM),
        };
        let mut bytes = Report::Failed(fail.clone()).to_line();
        bytes.extend(Report::Forked { pid: 77 }.to_line());
        bytes.extend(
            Report::Failed(Failure {
                errno: None,
                ..fail.clone()
            })
            .to_line(),
        );
        bytes.extend(b"not json\n");
        let r = Reports::parse(&bytes);
        assert_eq!(r.forked, Some(77));
        assert!(!r.exec);
        assert_eq!(r.failure, Some(fail));
        assert_eq!(r.garbage, vec!["not json".to_string()]);
    }

    #[test]
    fn success_is_forked_then_exec() {
        let mut bytes = Report::Forked { pid: 5 }.to_line();
        bytes.extend(Report::Exec.to_line());
        let r = Reports::parse(&bytes);
        assert_eq!((r.forked, r.exec, r.failure), (Some(5), true, None));
    }

    #[test]
    fn failure_text_names_errno() {
        let f = Failure {
            stage: Stage::UserNamespace,
            what: "unshare(CLONE_NEWUSER)".into(),
            errno: Some(libc::ENOSPC),
        };
        let text = f.to_string();
        assert!(text.starts_with("unshare(CLONE_NEWUSER): "), "{text}");
        assert!(text.contains("No space left on device"), "{text}");
    }
}
