//! Command-line options of the agent (hand-rolled to keep the static binary
//! small). Options take `--name VALUE` or `--name=VALUE`.

use std::path::PathBuf;

use crate::proto;

/// Usage text printed by `--help`.
pub const USAGE: &str = "\
usage: cowork-guest-agent [options]

  --connect fd:N | unix:/path | vsock:CID:PORT
                        how to reach the host (default vsock:2:51234)
  --sessions-root DIR   where session directories live (default /sessions)
  --private-path PATH   hide PATH from spawned processes (repeatable)
  --drop-caps           spawned processes run without any capability
  --cgroup-root DIR     give each process its own cgroup below DIR (cgroup2, or
                        a cgroup v1 memory hierarchy)
  --oom-score-adj N     spawned processes get this OOM score adjustment
                        (raising it needs no privilege: the OOM killer then
                        picks them before the agent)
  --init-mounts         mount proc, sysfs, devtmpfs, cgroup2, devpts and tmpfs if missing
  --init                run as the VM's init (PID 1 only): mounts, kernel modules,
                        clock, loopback; power off when done. Implied for PID 1
                        started without arguments (by the kernel).
  --sdk-target PATH     where InstallSdk puts the CLI (default /usr/local/bin/claude)
  --help, --version

Logging: COWORK_LOG (e.g. `debug`, `info,guest_agent=trace`), default info.
";

/// Default sessions root.
pub const DEFAULT_SESSIONS_ROOT: &str = "/sessions";

/// Default install location of the CLI binary.
pub const DEFAULT_SDK_TARGET: &str = "/usr/local/bin/claude";

/// The kernel's range of `oom_score_adj`.
const OOM_SCORE_ADJ_MIN: i32 = -1000;
const OOM_SCORE_ADJ_MAX: i32 = 1000;

/// Errors of option parsing.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum CliError {
    #[error("unknown option {0}")]
    Unknown(String),
    #[error("option {0} needs a value")]
    MissingValue(String),
    #[error("option {0} takes no value")]
    UnexpectedValue(String),
    #[error("invalid --connect {0:?}: expected fd:N, unix:/path or vsock:CID:PORT")]
    Connect(String),
    #[error("invalid --oom-score-adj {0:?}: expected a whole number from -1000 to 1000")]
    OomScoreAdj(String),
}

/// Where the host is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConnectTarget {
    /// An inherited, already connected socket.
    Fd(i32),
    /// A Unix stream socket path.
    Unix(PathBuf),
    /// An AF_VSOCK address.
    Vsock { cid: u32, port: u32 },
}

impl ConnectTarget {
    /// Parses `fd:N`, `unix:/path` or `vsock:CID:PORT`.
    pub fn parse(s: &str) -> Result<Self, CliError> {
        let bad = || CliError::Connect(s.to_string());
        if let Some(n) = s.strip_prefix("fd:") {
            let fd: i32 = n.parse().map_err(|_| bad())?;
            return if fd >= 0 {
                Ok(Self::Fd(fd))
            } else {
                Err(bad())
            };
        }
        if let Some(p) = s.strip_prefix("unix:") {
            return if p.is_empty() {
                Err(bad())
            } else {
                Ok(Self::Unix(p.into()))
            };
        }
        if let Some(rest) = s.strip_prefix("vsock:") {
            let (cid, port) = rest.split_once(':').ok_or_else(bad)?;
            return Ok(Self::Vsock {
                cid: cid.parse().map_err(|_| bad())?,
                port: port.parse().map_err(|_| bad())?,
            });
        }
        Err(bad())
    }
}

impl std::fmt::Display for ConnectTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Fd(n) => write!(f, "fd:{n}"),
            Self::Unix(p) => write!(f, "unix:{}", p.display()),
            Self::Vsock { cid, port } => write!(f, "vsock:{cid}:{port}"),
        }
    }
}

/// Everything the agent is told from outside.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub connect: ConnectTarget,
    pub sessions_root: PathBuf,
    pub private_paths: Vec<PathBuf>,
    pub drop_caps: bool,
    pub cgroup_root: Option<PathBuf>,
    /// `oom_score_adj` of spawned processes.
    pub oom_score_adj: Option<i32>,
    pub init_mounts: bool,
    /// Act as the VM's init (see [`crate::agent::init::run_machine_init`]).
    pub init: bool,
    pub sdk_target: PathBuf,
    /// The root below which `TrustCa` writes (`/`; tests move it).
    pub trust_root: PathBuf,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            connect: ConnectTarget::Vsock {
                cid: proto::HOST_CID,
                port: proto::AGENT_PORT,
            },
            sessions_root: DEFAULT_SESSIONS_ROOT.into(),
            private_paths: Vec::new(),
            drop_caps: false,
            cgroup_root: None,
            oom_score_adj: None,
            init_mounts: false,
            init: false,
            sdk_target: DEFAULT_SDK_TARGET.into(),
            trust_root: "/".into(),
        }
    }
}

/// What the command line asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Command {
    Run(Config),
    Help,
    Version,
}

/// Parses the options. `args` are the options alone; a leading word that is
/// not an option (a program or subcommand name) is skipped.
pub fn parse(args: &[String]) -> Result<Command, CliError> {
    let mut cfg = Config::default();
    let mut it = args.iter().peekable();
    if it.peek().is_some_and(|a| !a.starts_with('-')) {
        it.next();
    }
    while let Some(arg) = it.next() {
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n, Some(v.to_string())),
            _ => (arg.as_str(), None),
        };
        let value = |it: &mut std::iter::Peekable<std::slice::Iter<'_, String>>| {
            inline
                .clone()
                .or_else(|| it.next().cloned())
                .ok_or_else(|| CliError::MissingValue(name.to_string()))
        };
        let flag = |inline: &Option<String>| match inline {
            Some(_) => Err(CliError::UnexpectedValue(name.to_string())),
            None => Ok(true),
        };
        match name {
            "--connect" => cfg.connect = ConnectTarget::parse(&value(&mut it)?)?,
            "--sessions-root" => cfg.sessions_root = value(&mut it)?.into(),
            "--private-path" => cfg.private_paths.push(value(&mut it)?.into()),
            "--cgroup-root" => cfg.cgroup_root = Some(value(&mut it)?.into()),
            "--oom-score-adj" => {
                let v = value(&mut it)?;
                cfg.oom_score_adj = Some(
                    v.parse::<i32>()
                        .ok()
                        .filter(|n| (OOM_SCORE_ADJ_MIN..=OOM_SCORE_ADJ_MAX).contains(n))
                        .ok_or(CliError::OomScoreAdj(v))?,
                );
            }
            "--sdk-target" => cfg.sdk_target = value(&mut it)?.into(),
            "--trust-root" => cfg.trust_root = value(&mut it)?.into(),
            "--drop-caps" => cfg.drop_caps = flag(&inline)?,
            "--init-mounts" => cfg.init_mounts = flag(&inline)?,
            "--init" => cfg.init = flag(&inline)?,
            "--help" | "-h" => return Ok(Command::Help),
            "--version" | "-V" => return Ok(Command::Version),
            other => return Err(CliError::Unknown(other.to_string())),
        }
    }
    Ok(Command::Run(cfg))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &[&str]) -> Vec<String> {
        s.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn defaults() {
        let Command::Run(cfg) = parse(&[]).unwrap() else {
            panic!()
        };
        assert_eq!(cfg, Config::default());
        assert_eq!(
            cfg.connect,
            ConnectTarget::Vsock {
                cid: 2,
                port: 51234
            }
        );
        assert_eq!(cfg.sessions_root, PathBuf::from("/sessions"));
    }

    #[test]
    fn all_options() {
        let a = args(&[
            "guest-agent",
            "--connect=unix:/run/a.sock",
            "--sessions-root",
            "/s",
            "--private-path",
            "/a",
            "--private-path=/b",
            "--drop-caps",
            "--cgroup-root",
            "/sys/fs/cgroup/x",
            "--oom-score-adj=500",
            "--init-mounts",
            "--init",
            "--sdk-target",
            "/opt/claude",
        ]);
        let Command::Run(cfg) = parse(&a).unwrap() else {
            panic!()
        };
        assert_eq!(cfg.connect, ConnectTarget::Unix("/run/a.sock".into()));
        assert_eq!(cfg.sessions_root, PathBuf::from("/s"));
        assert_eq!(
            cfg.private_paths,
            [PathBuf::from("/a"), PathBuf::from("/b")]
        );
        assert!(cfg.drop_caps && cfg.init_mounts && cfg.init);
        assert_eq!(cfg.cgroup_root, Some("/sys/fs/cgroup/x".into()));
        assert_eq!(cfg.oom_score_adj, Some(500));
        assert_eq!(cfg.sdk_target, PathBuf::from("/opt/claude"));
        for bad in ["1001", "-1001", "x", ""] {
            assert_eq!(
                parse(&args(&["--oom-score-adj", bad])),
                Err(CliError::OomScoreAdj(bad.to_string()))
            );
        }
    }

    #[test]
    fn connect_forms_and_errors() {
        assert_eq!(ConnectTarget::parse("fd:3").unwrap(), ConnectTarget::Fd(3));
        assert_eq!(
            ConnectTarget::parse("vsock:3:1024").unwrap(),
            ConnectTarget::Vsock { cid: 3, port: 1024 }
        );
        for bad in ["fd:", "fd:-1", "unix:", "vsock:2", "vsock:a:1", "tcp:1"] {
            assert!(ConnectTarget::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse(&args(&["--bogus"])),
            Err(CliError::Unknown("--bogus".into()))
        );
        assert_eq!(
            parse(&args(&["--connect"])),
            Err(CliError::MissingValue("--connect".into()))
        );
        assert_eq!(
            parse(&args(&["--drop-caps=1"])),
            Err(CliError::UnexpectedValue("--drop-caps".into()))
        );
        assert_eq!(parse(&args(&["--help"])), Ok(Command::Help));
    }
}
