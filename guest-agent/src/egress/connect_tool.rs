//! `cowork-egress-connect <host> <port>`: ssh's `ProxyCommand` through the
//! egress relay, so `ssh`, `scp` and `git` over ssh reach allowed hosts
//! although ssh ignores the proxy variables.
//!
//! The agent binary runs as this tool when invoked under [`TOOL_NAME`]
//! (argv\[0\]) or as `cowork-guest-agent egress-connect <host> <port>`. It
//! takes the spawn's proxy URL from the environment ([`PROXY_VARS`], which
//! the host sets for every session process), connects to the proxy it
//! names (the relay, `127.0.0.1:3128`), sends
//! `CONNECT host:port HTTP/1.1` with `Proxy-Authorization: Basic`, checks
//! for a 2xx answer and then copies stdin to the tunnel and the tunnel to
//! stdout (plain blocking threads: one connection, one process).
//!
//! In a VM, [`install`] puts a copy of the agent under [`TOOL_PATH`] in the
//! session userland and an ssh client drop-in ([`SSH_DROPIN`]) that uses it
//! for every host but loopback.
//!
//! Limits: HTTP proxies only (`http://` URLs); the proxy address must be an
//! IP literal with a port (what the host hands out), else the relay's
//! address is used.

use std::fs;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, SocketAddrV4, TcpStream};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::spawns::{percent_decode, ProxyCredential};
use crate::proto;

/// The tool's name: argv\[0\] (basename) that selects it, and its file name.
pub const TOOL_NAME: &str = "cowork-egress-connect";

/// The subcommand of the agent binary that selects the tool.
pub const SUBCOMMAND: &str = "egress-connect";

/// Where [`install`] puts the tool, below the userland's root: outside
/// `PATH` (nobody runs it by hand), under the conventional place for
/// helper programs.
pub const TOOL_PATH: &str = "usr/local/libexec/cowork/cowork-egress-connect";

/// ssh's drop-in directory (Debian's and Ubuntu's `/etc/ssh/ssh_config`
/// include `ssh_config.d/*.conf` first, so it applies before the defaults).
pub const SSH_DROPIN_DIR: &str = "etc/ssh/ssh_config.d";

/// The drop-in [`install`] writes.
pub const SSH_DROPIN: &str = "etc/ssh/ssh_config.d/cowork-egress.conf";

/// The main ssh client configuration, checked for the `Include` of
/// [`SSH_DROPIN_DIR`] when that directory does not exist yet.
const SSH_CONFIG: &str = "etc/ssh/ssh_config";

/// Environment variables read for the proxy URL, in order (the host sets
/// all of them to the same URL; `ALL_PROXY` is the one meant for
/// everything that is not HTTP).
pub const PROXY_VARS: [&str; 4] = ["ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy"];

/// The proxy used when the URL names no IP address and port: the relay.
pub const DEFAULT_PROXY: SocketAddrV4 =
    SocketAddrV4::new(Ipv4Addr::LOCALHOST, proto::GUEST_PROXY_PORT);

/// How long connecting to the proxy and reading its answer may take; the
/// proxy answers a CONNECT once its own connect finished, which the host
/// bounds too.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

/// Longest proxy answer head read (real ones are a few hundred bytes).
pub const MAX_ANSWER_BYTES: usize = 16 * 1024;

/// Mode of the installed tool and its directory.
const TOOL_MODE: u32 = 0o755;

/// Mode of the ssh drop-in.
const DROPIN_MODE: u32 = 0o644;

/// Exit codes.
pub const EXIT_OK: i32 = 0;
pub const EXIT_FAILED: i32 = 1;
pub const EXIT_USAGE: i32 = 2;

/// The ssh drop-in: every host but loopback goes through the tool.
pub const SSH_DROPIN_TEXT: &str =
    "# Written by the cowork guest agent at boot: this machine reaches the\n\
# network only through the host's egress proxy (see ALL_PROXY).\n\
Host * !localhost !127.0.0.1 !::1\n\
    ProxyCommand /usr/local/libexec/cowork/cowork-egress-connect %h %p\n";

/// Errors of the tool and of its installation; none contains the URL or
/// credential.
#[derive(Debug, thiserror::Error)]
pub enum ConnectToolError {
    #[error("no proxy configured: none of {} is set", PROXY_VARS.join(", "))]
    NoProxy,
    #[error("the proxy URL in {var} is unusable: {reason}")]
    BadProxyUrl { var: &'static str, reason: String },
    #[error("invalid port {0:?}")]
    BadPort(String),
    #[error("cannot reach the egress proxy at {addr}: {source}")]
    Connect { addr: SocketAddr, source: io::Error },
    #[error("talking to the egress proxy failed: {0}")]
    Io(#[from] io::Error),
    #[error("the egress proxy closed the connection before answering")]
    NoAnswer,
    #[error("the egress proxy's answer is not HTTP: {0:?}")]
    NotHttp(String),
    #[error("the egress proxy's answer head is longer than {MAX_ANSWER_BYTES} bytes")]
    AnswerTooLong,
    #[error("the egress proxy refused {target}: {status}{detail}")]
    Refused {
        target: String,
        status: String,
        detail: String,
    },
    #[error("cannot install {path}: {source}")]
    Install { path: PathBuf, source: io::Error },
}

/// The proxy settings taken from the environment.
#[derive(Debug)]
pub struct ProxySetting {
    pub addr: SocketAddr,
    pub credential: Option<ProxyCredential>,
}

/// Reads the first set variable of [`PROXY_VARS`] through `lookup`.
pub fn proxy_from_env(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<ProxySetting, ConnectToolError> {
    let (var, url) = PROXY_VARS
        .iter()
        .find_map(|v| lookup(v).filter(|s| !s.is_empty()).map(|s| (*v, s)))
        .ok_or(ConnectToolError::NoProxy)?;
    let bad = |reason: &str| ConnectToolError::BadProxyUrl {
        var,
        reason: reason.to_string(),
    };
    let rest = match url.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") => rest,
        Some(_) => return Err(bad("only http:// proxies are supported")),
        None => url.as_str(),
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let (userinfo, hostport) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let credential = match userinfo {
        Some(u) => {
            let (user, pass) = u.split_once(':').unwrap_or((u, ""));
            Some(ProxyCredential {
                username: percent_decode(user).map_err(|e| bad(&e.to_string()))?,
                password: percent_decode(pass).map_err(|e| bad(&e.to_string()))?,
            })
        }
        None => None,
    };
    let addr = hostport
        .parse::<SocketAddr>()
        .unwrap_or(SocketAddr::V4(DEFAULT_PROXY));
    Ok(ProxySetting { addr, credential })
}

/// Standard base64 (RFC 4648 §4, with padding).
pub fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// `host:port` as a CONNECT authority (IPv6 literals in brackets).
pub fn authority(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The CONNECT request for `target`.
pub fn connect_request(target: &str, credential: Option<&ProxyCredential>) -> Vec<u8> {
    let mut req = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n").into_bytes();
    if let Some(c) = credential {
        let mut pair = c.username.clone();
        pair.push(b':');
        pair.extend_from_slice(&c.password);
        req.extend_from_slice(b"Proxy-Authorization: Basic ");
        req.extend_from_slice(base64(&pair).as_bytes());
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"\r\n");
    req
}

/// Reads the answer head byte by byte (nothing of the tunnel is consumed)
/// and checks for a 2xx status.
fn read_answer(stream: &mut TcpStream, target: &str) -> Result<(), ConnectToolError> {
    let mut head = Vec::with_capacity(256);
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() >= MAX_ANSWER_BYTES {
            return Err(ConnectToolError::AnswerTooLong);
        }
        match stream.read(&mut byte) {
            Ok(0) => return Err(ConnectToolError::NoAnswer),
            Ok(_) => head.push(byte[0]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        }
    }
    let text = String::from_utf8_lossy(&head);
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    let code = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") || code.len() != 3 {
        return Err(ConnectToolError::NotHttp(
            status_line.chars().take(80).collect(),
        ));
    }
    if code.starts_with('2') {
        return Ok(());
    }
    let detail = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("x-proxy-error"))
        .map(|(_, v)| format!(" ({})", v.trim()))
        .unwrap_or_default();
    Err(ConnectToolError::Refused {
        target: target.to_string(),
        status: status_line.chars().take(120).collect(),
        detail,
    })
}

/// Opens a tunnel to `host:port` through the proxy of `setting`.
pub fn open_tunnel(
    setting: &ProxySetting,
    host: &str,
    port: u16,
) -> Result<TcpStream, ConnectToolError> {
    let addr = setting.addr;
    let mut stream = TcpStream::connect_timeout(&addr, ANSWER_TIMEOUT)
        .map_err(|source| ConnectToolError::Connect { addr, source })?;
    let _ = stream.set_nodelay(true);
    let target = authority(host, port);
    stream.set_read_timeout(Some(ANSWER_TIMEOUT))?;
    stream.write_all(&connect_request(&target, setting.credential.as_ref()))?;
    read_answer(&mut stream, &target)?;
    stream.set_read_timeout(None)?;
    Ok(stream)
}

/// Copies `input` into the tunnel (then half-closes it) on a thread, and
/// the tunnel into `output` until the far side closes.
pub fn pump(
    tunnel: TcpStream,
    mut input: impl Read + Send + 'static,
    mut output: impl Write,
) -> io::Result<u64> {
    let mut up = tunnel.try_clone()?;
    std::thread::spawn(move || {
        let _ = io::copy(&mut input, &mut up);
        let _ = up.shutdown(Shutdown::Write);
    });
    let mut down = tunnel;
    let n = io::copy(&mut down, &mut output)?;
    output.flush()?;
    Ok(n)
}

/// The tool's entry point: `args` are the arguments after the program
/// name. Returns the exit code.
pub fn main_with_args(args: &[String]) -> i32 {
    let [host, port] = args else {
        eprintln!("usage: {TOOL_NAME} <host> <port>   (ssh ProxyCommand through the egress proxy)");
        return EXIT_USAGE;
    };
    let run = || -> Result<(), ConnectToolError> {
        let port: u16 = port
            .parse()
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| ConnectToolError::BadPort(port.clone()))?;
        let setting = proxy_from_env(|k| std::env::var(k).ok())?;
        let tunnel = open_tunnel(&setting, host, port)?;
        pump(tunnel, io::stdin(), io::stdout().lock())?;
        Ok(())
    };
    match run() {
        Ok(()) => EXIT_OK,
        Err(e) => {
            eprintln!("{TOOL_NAME}: {e}");
            EXIT_FAILED
        }
    }
}

/// What [`install`] did.
#[derive(Debug, PartialEq, Eq)]
pub struct Installed {
    pub tool: PathBuf,
    /// The ssh drop-in, when ssh is there to use it.
    pub ssh_dropin: Option<PathBuf>,
}

/// Installs the tool (a copy of `exe`, normally `/proc/self/exe`) and, when
/// the userland has an ssh client configuration that reads drop-ins, the
/// ssh drop-in, below `root` (the session userland's root: its writable
/// layer takes the files). Replaces earlier copies atomically.
pub fn install(root: &Path, exe: &Path) -> Result<Installed, ConnectToolError> {
    let tool = root.join(TOOL_PATH);
    let err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ConnectToolError::Install { path, source }
    };
    if let Some(dir) = tool.parent() {
        fs::create_dir_all(dir).map_err(err(dir))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(TOOL_MODE)).map_err(err(dir))?;
    }
    let tmp = tool.with_extension("new");
    let _ = fs::remove_file(&tmp);
    {
        let mut src = fs::File::open(exe).map_err(err(exe))?;
        let mut dst = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(TOOL_MODE)
            .open(&tmp)
            .map_err(err(&tmp))?;
        io::copy(&mut src, &mut dst).map_err(err(&tmp))?;
        dst.set_permissions(fs::Permissions::from_mode(TOOL_MODE))
            .map_err(err(&tmp))?;
    }
    fs::rename(&tmp, &tool).map_err(err(&tool))?;
    let dropin_dir = root.join(SSH_DROPIN_DIR);
    let includes_dropins = fs::read_to_string(root.join(SSH_CONFIG)).is_ok_and(|t| {
        t.lines().any(|l| {
            let l = l.trim_start();
            l.to_ascii_lowercase().starts_with("include") && l.contains("ssh_config.d")
        })
    });
    if !dropin_dir.is_dir() {
        if !includes_dropins {
            return Ok(Installed {
                tool,
                ssh_dropin: None,
            });
        }
        fs::create_dir_all(&dropin_dir).map_err(err(&dropin_dir))?;
    }
    let dropin = root.join(SSH_DROPIN);
    let tmp = dropin.with_extension("new");
    let _ = fs::remove_file(&tmp);
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(DROPIN_MODE)
        .open(&tmp)
        .and_then(|mut f| f.write_all(SSH_DROPIN_TEXT.as_bytes()))
        .map_err(err(&tmp))?;
    fs::rename(&tmp, &dropin).map_err(err(&dropin))?;
    Ok(Installed {
        tool,
        ssh_dropin: Some(dropin),
    })
}

/// [`install`] on the running machine (root `/`, this executable); logs
/// the outcome. For a VM's init after the switch to the session userland.
pub fn install_in_machine() {
    match install(Path::new("/"), Path::new("/proc/self/exe")) {
        Ok(Installed {
            tool,
            ssh_dropin: Some(d),
        }) => {
            tracing::debug!(tool = %tool.display(), dropin = %d.display(), "ssh ProxyCommand installed")
        }
        Ok(Installed { tool, .. }) => {
            tracing::debug!(tool = %tool.display(), "no ssh client configuration; ssh ProxyCommand tool installed without a drop-in")
        }
        Err(e) => tracing::warn!(error = %e, "ssh will not use the egress proxy"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::io::BufRead;
    use std::net::TcpListener;

    #[test]
    fn base64_matches_rfc_4648_vectors() {
        for (i, o) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(i.as_bytes()), o, "{i}");
        }
        assert_eq!(base64(&[0xfb, 0xff, 0xbf]), "+/+/");
    }

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn the_proxy_comes_from_the_environment_in_order() {
        let s = proxy_from_env(env(&[
            ("HTTPS_PROXY", "http://x:y@127.0.0.1:9"),
            ("all_proxy", "http://se%2Fs:p%40ss@127.0.0.1:3128"),
        ]))
        .unwrap();
        assert_eq!(s.addr, "127.0.0.1:3128".parse().unwrap());
        let c = s.credential.unwrap();
        assert_eq!(
            (c.username.as_slice(), c.password.as_slice()),
            (&b"se/s"[..], &b"p@ss"[..])
        );
        // A name instead of an address: the relay.
        let s = proxy_from_env(env(&[("ALL_PROXY", "http://localhost:3128/")])).unwrap();
        assert_eq!(s.addr, SocketAddr::V4(DEFAULT_PROXY));
        assert!(s.credential.is_none());
        assert!(matches!(
            proxy_from_env(env(&[("ALL_PROXY", "")])),
            Err(ConnectToolError::NoProxy)
        ));
        let err =
            proxy_from_env(env(&[("ALL_PROXY", "socks5://u:secret@127.0.0.1:1")])).unwrap_err();
        assert!(err.to_string().contains("ALL_PROXY") && !err.to_string().contains("secret"));
    }

    #[test]
    fn requests_carry_the_credential_and_bracket_ipv6() {
        assert_eq!(authority("::1", 22), "[::1]:22");
        assert_eq!(authority("[::1]", 22), "[::1]:22");
        assert_eq!(authority("github.com", 22), "github.com:22");
        let c = ProxyCredential {
            username: b"s".to_vec(),
            password: b"tok".to_vec(),
        };
        let req = String::from_utf8(connect_request("github.com:22", Some(&c))).unwrap();
        assert_eq!(
            req,
            "CONNECT github.com:22 HTTP/1.1\r\nHost: github.com:22\r\nProxy-Authorization: Basic czp0b2s=\r\n\r\n"
        );
    }

    /// A fake proxy: reads one request head, answers `answer`, then (on
    /// 200) echoes the tunnel upper-cased until EOF. Returns the head.
    fn fake_proxy(answer: &'static str) -> (SocketAddr, std::thread::JoinHandle<String>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let h = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut r = io::BufReader::new(s.try_clone().unwrap());
            let mut head = String::new();
            loop {
                let mut line = String::new();
                r.read_line(&mut line).unwrap();
                head.push_str(&line);
                if line == "\r\n" || line.is_empty() {
                    break;
                }
            }
            let mut w = s;
            w.write_all(answer.as_bytes()).unwrap();
            if answer.contains(" 200 ") {
                let mut rest = Vec::new();
                r.read_to_end(&mut rest).unwrap();
                w.write_all(&rest.to_ascii_uppercase()).unwrap();
            }
            head
        });
        (addr, h)
    }

    #[test]
    fn a_tunnel_is_opened_and_carries_both_directions() {
        let (addr, proxy) = fake_proxy("HTTP/1.1 200 Connection established\r\n\r\n");
        let setting = ProxySetting {
            addr,
            credential: Some(ProxyCredential {
                username: b"sess".to_vec(),
                password: b"k".to_vec(),
            }),
        };
        let tunnel = open_tunnel(&setting, "git.example.org", 22).unwrap();
        let mut out = Vec::new();
        let n = pump(tunnel, io::Cursor::new(b"ssh-2.0-hello".to_vec()), &mut out).unwrap();
        assert_eq!(out, b"SSH-2.0-HELLO");
        assert_eq!(n, 13);
        let head = proxy.join().unwrap();
        assert!(
            head.starts_with("CONNECT git.example.org:22 HTTP/1.1\r\n"),
            "{head}"
        );
        assert!(
            head.contains(&format!(
                "Proxy-Authorization: Basic {}\r\n",
                base64(b"sess:k")
            )),
            "{head}"
        );
    }

    #[test]
    fn refusals_and_non_proxies_are_clear_errors() {
        let (addr, proxy) = fake_proxy(
            "HTTP/1.1 403 Forbidden\r\nX-Proxy-Error: blocked-by-allowlist\r\nContent-Length: 0\r\n\r\n",
        );
        let setting = ProxySetting {
            addr,
            credential: None,
        };
        let err = open_tunnel(&setting, "denied.example", 22).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("denied.example:22")
                && text.contains("403")
                && text.contains("blocked-by-allowlist"),
            "{text}"
        );
        proxy.join().unwrap();
        let (addr, proxy) = fake_proxy("SSH-2.0-OpenSSH\r\n\r\n");
        let err = open_tunnel(
            &ProxySetting {
                addr,
                credential: None,
            },
            "h",
            22,
        )
        .unwrap_err();
        assert!(matches!(err, ConnectToolError::NotHttp(_)), "{err}");
        proxy.join().unwrap();
        // Nobody listening.
        let free = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let err = open_tunnel(
            &ProxySetting {
                addr: free,
                credential: None,
            },
            "h",
            22,
        )
        .unwrap_err();
        assert!(matches!(err, ConnectToolError::Connect { .. }), "{err}");
        assert_eq!(main_with_args(&["onlyhost".into()]), EXIT_USAGE);
        assert_eq!(main_with_args(&["h".into(), "0".into()]), EXIT_FAILED);
    }

    #[test]
    fn install_copies_the_tool_and_writes_the_dropin_only_for_ssh() {
        let exe = tempfile::NamedTempFile::new().unwrap();
        fs::write(exe.path(), b"\x7fELF fake agent").unwrap();
        // No ssh at all: the tool only.
        let bare = tempfile::tempdir().unwrap();
        let got = install(bare.path(), exe.path()).unwrap();
        assert_eq!(got.ssh_dropin, None);
        assert_eq!(fs::read(&got.tool).unwrap(), b"\x7fELF fake agent");
        let mode = fs::metadata(&got.tool).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o755);
        // ssh_config includes the drop-ins, the directory is missing: made.
        let root = tempfile::tempdir().unwrap();
        fs::create_dir_all(root.path().join("etc/ssh")).unwrap();
        fs::write(
            root.path().join(SSH_CONFIG),
            "# defaults\nInclude /etc/ssh/ssh_config.d/*.conf\nHost *\n",
        )
        .unwrap();
        let got = install(root.path(), exe.path()).unwrap();
        let dropin = got.ssh_dropin.unwrap();
        assert_eq!(dropin, root.path().join(SSH_DROPIN));
        assert_eq!(fs::read_to_string(&dropin).unwrap(), SSH_DROPIN_TEXT);
        assert!(SSH_DROPIN_TEXT.contains(&format!("/{TOOL_PATH} %h %p")));
        // Again (next boot on a kept upper): replaced, no leftovers.
        fs::write(exe.path(), b"new agent").unwrap();
        let got = install(root.path(), exe.path()).unwrap();
        assert_eq!(fs::read(&got.tool).unwrap(), b"new agent");
        let names: Vec<_> = fs::read_dir(got.tool.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [TOOL_NAME]);
        let missing = install(root.path(), Path::new("/nonexistent/exe")).unwrap_err();
        assert!(
            missing.to_string().contains("/nonexistent/exe"),
            "{missing}"
        );
    }
}
