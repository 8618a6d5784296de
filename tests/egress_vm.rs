//! Egress end to end: sessions of the real helper, under the sandbox and
//! QEMU backends, reach the network only through the host's egress proxy
//! and only where their spawn's `allowedDomains` says. Nothing leaves the
//! machine: the helper runs in a network namespace of the test's
//! (`support::netns`), the servers in a second one behind a veth pair, and
//! the test names live in a bind-mounted `/etc/hosts`.
//!
//! Each backend's test re-runs this binary's inner test in the namespaces.
//! The inner test starts the helper (`--backend sandbox|qemu`), starts the
//! VM and runs one bash script per session that tries every way out and
//! prints one `RESULT <check> pass|fail …` line per attempt:
//!
//! - session `alpha`, allowed `allowed.test loop.test self.test`: curl over
//!   HTTP and HTTPS (TLS end to end: the guest checks the server's own
//!   certificate), python `urllib` and node `fetch` reach `allowed.test`,
//!   and so does a raw TCP socket by name (the agent's DNS stub and
//!   capture); an unlisted name, listed names resolving to the host's
//!   loopback and to the host's own interface address, an IP literal with
//!   `--noproxy '*'`, raw TCP to an unlisted name and to an IP literal, UDP
//!   to the server's address, a proxy request without a credential and (in
//!   a VM) a vsock connection to another host port all fail;
//! - session `beta`, allowed `other.test`, reaches only that name;
//! - session `gamma`, `allowedDomains: []`, reaches nothing.
//!
//! Afterwards the set of request paths the servers saw must equal exactly
//! the allowed attempts, and decoys on the host's loopback and interface
//! address must have seen nothing.
//!
//! `egress_kvm_backend` runs the same under `--backend kvm`, directly where
//! `/dev/kvm` boots Linux and otherwise inside the nested-KVM harness
//! (`support::nested`; its gate is `COWORK_NESTED_TESTS`).
//!
//! Gate: root with `unshare`, `ip`, `nsenter`, `openssl` and `python3`
//! (else a loud skip); the QEMU test also needs QEMU and the guest image
//! with its userland (`support::gate`, failing under `COWORK_QEMU_TESTS=1`).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::TcpListener as StdTcpListener;
use std::path::Path;
use std::time::Duration;

use cowork_helper::client::{Pipe, Subscription};
use serde_json::{json, Value};
use support::gate::{qemu_gate, qemu_missing};
use support::nested;
use support::netns::{self, bind_in, paths_seen, serve_http, Log, ServerNamespace, P_V4, S_V4};
use support::session::{self, bash, run};
use support::vm_helper::{self, built_helper, VmHelper};

/// Printed by the inner run when all its assertions passed.
const INNER_OK: &str = "EGRESS-VM-INNER-CHECKS-PASSED";
/// Which backend the inner run drives.
const BACKEND_ENV: &str = "COWORK_EGRESS_VM_BACKEND";
/// Plain HTTP test server port (in S).
const HTTP_PORT: u16 = 8080;
/// HTTPS test server port (in S).
const HTTPS_PORT: u16 = 8443;
/// UDP echo server port (in S): a reply would mean UDP got out.
const UDP_PORT: u16 = 5353;
/// Limit for the python test servers to listen: seconds here, but inside
/// the nested harness (L1 itself under TCG) importing `ssl` and loading the
/// certificate takes much longer.
const SERVERS_LIMIT: Duration = Duration::from_secs(240);
/// Limit for startVM (a TCG boot takes seconds; the machine is shared).
const START_LIMIT: Duration = Duration::from_secs(180);
/// Limit for one session's whole script (python and node start slowly
/// under TCG, and each refused attempt may wait for its timeout).
const SCRIPT_LIMIT: Duration = Duration::from_secs(420);

/// The helper's /etc/hosts inside the namespaces.
const HOSTS: &str = "127.0.0.1 localhost\n::1 localhost\n\
10.203.0.2 allowed.test other.test\n\
127.0.0.1 loop.test\n\
10.203.0.1 self.test\n";

/// Runs in S: an HTTPS server (certificate from argv) that records each
/// request line in a file and answers like the plain servers, and a UDP
/// echo server.
const PY_SERVERS: &str = r#"
import http.server, socket, ssl, sys, threading
addr, https_port, udp_port, cert, key, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        with open(log, "a") as f:
            f.write(self.requestline + "\n")
        body = ("https " + self.requestline).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
def udp():
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind((addr, udp_port))
    while True:
        d, peer = u.recvfrom(2048)
        with open(log, "a") as f:
            f.write("UDP " + d.decode(errors="replace") + "\n")
        u.sendto(d, peer)
threading.Thread(target=udp, daemon=True).start()
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
srv = http.server.ThreadingHTTPServer((addr, https_port), H)
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
open(log, "a").close()
srv.serve_forever()
"#;

/// Shell functions of the session scripts: `t NAME CMD…` runs one attempt
/// and prints its RESULT line; `raw HOST PORT PATH` is a raw TCP client.
const SCRIPT_PRELUDE: &str = r#"
t() { local name=$1; shift; local out rc
  out=$("$@" 2>&1); rc=$?
  out=$(printf %s "$out" | tr '\n\r' '  ' | head -c 300)
  if [ $rc -eq 0 ]; then echo "RESULT $name pass $out"; else echo "RESULT $name fail rc=$rc $out"; fi; }
raw() { python3 -c 'import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
s.sendall(("GET %s HTTP/1.0\r\nHost: x\r\n\r\n" % sys.argv[3]).encode())
d = s.recv(4096)
print(d[:80])
sys.exit(0 if d.startswith(b"HTTP/1.1 200") else 1)' "$@"; }
"#;

/// Why the namespace part cannot run here, if it cannot.
fn missing() -> Option<String> {
    netns::missing_tools().or_else(|| {
        ["openssl", "python3"]
            .into_iter()
            .find(|t| !netns::have(t))
            .map(|t| format!("needs {t} for the test servers"))
    })
}

#[test]
fn egress_sandbox_backend() {
    if let Some(why) = missing() {
        eprintln!("skipped: {why}");
        return;
    }
    let out = netns::rerun_in_namespaces("inner_egress_vm", &[(BACKEND_ENV, "sandbox")], INNER_OK);
    report(&out);
}

#[test]
fn egress_qemu_backend() {
    const TEST: &str = "egress_qemu_backend";
    let no_rootfs = vm_helper::userland_image_missing(&built_helper());
    if !qemu_gate(TEST, TEST, [qemu_missing(), no_rootfs, missing()]) {
        return;
    }
    let out = netns::rerun_in_namespaces("inner_egress_vm", &[(BACKEND_ENV, "qemu")], INNER_OK);
    report(&out);
}

/// Set (to 1) on the re-run inside the nested harness.
const KVM_INSIDE_ENV: &str = "COWORK_EGRESS_KVM_INSIDE";
/// Prints the nested run's whole output when set.
const KVM_VERBOSE_ENV: &str = "COWORK_EGRESS_KVM_VERBOSE";

/// `--backend kvm`: directly where `/dev/kvm` boots Linux, else inside the
/// nested-KVM harness (everything at TCG speed there).
#[test]
fn egress_kvm_backend() {
    nested::run_on_linux_kvm(
        &nested::Rerun {
            test: "egress_kvm_backend",
            inside_env: KVM_INSIDE_ENV,
            ok_marker: INNER_OK,
            report_prefix: "RESULT ",
            verbose_env: KVM_VERBOSE_ENV,
            inner_timeout: Duration::from_secs(1500),
            harness_timeout: Duration::from_secs(1600),
            attempts: 3,
        },
        || missing().or_else(|| vm_helper::userland_image_missing(&built_helper())),
        || {
            let out =
                netns::rerun_in_namespaces("inner_egress_vm", &[(BACKEND_ENV, "kvm")], INNER_OK);
            report(&out);
            println!("{INNER_OK}");
        },
    );
}

/// Prints the inner run's RESULT lines (what each attempt saw).
fn report(out: &str) {
    for l in out.lines().filter(|l| l.contains("RESULT ")) {
        eprintln!("{}", l.trim());
    }
}

/// One session's script and the outcome each check must have.
struct Plan {
    session: &'static str,
    allowed: Value,
    /// Lines of `t NAME CMD…` (after the prelude).
    script: String,
    /// Check name → must pass.
    expect: Vec<(&'static str, bool)>,
}

fn plans(vm: bool, ca_pem: &str) -> Vec<Plan> {
    let ca = format!("ca=$(mktemp); cat > \"$ca\" <<'PEM'\n{}PEM\n", ca_pem);
    let mut alpha = format!(
        "{ca}\
t curl_http curl -fsS --max-time 30 http://allowed.test:{HTTP_PORT}/alpha/curl-http\n\
t curl_https curl -fsS --max-time 30 --cacert \"$ca\" https://allowed.test:{HTTPS_PORT}/alpha/curl-https\n\
t python python3 -c 'import urllib.request, sys; print(urllib.request.urlopen(sys.argv[1], timeout=30).read().decode())' http://allowed.test:{HTTP_PORT}/alpha/python\n\
t node node -e 'fetch(process.argv[1]).then(r => r.text()).then(t => console.log(t)).catch(e => {{ console.error(String(e && e.cause || e)); process.exit(1) }})' http://allowed.test:{HTTP_PORT}/alpha/node\n\
t raw_listed raw allowed.test {HTTP_PORT} /alpha/raw-listed\n\
t unlisted curl -fsS --max-time 30 http://other.test:{HTTP_PORT}/alpha/denied-unlisted\n\
t unlisted_https curl -fsS --max-time 30 --cacert \"$ca\" https://other.test:{HTTPS_PORT}/alpha/denied-unlisted-https\n\
t loopback curl -fsS --max-time 30 http://loop.test:{HTTP_PORT}/alpha/denied-loopback\n\
t host_interface curl -fsS --max-time 30 http://self.test:{HTTP_PORT}/alpha/denied-self\n\
t noproxy_literal curl -fsS --max-time 30 --noproxy '*' http://{S_V4}:{HTTP_PORT}/alpha/denied-literal\n\
t raw_unlisted raw other.test {HTTP_PORT} /alpha/denied-raw-unlisted\n\
t raw_literal raw {S_V4} {HTTP_PORT} /alpha/denied-raw-literal\n\
t udp python3 -c 'import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(5); s.sendto(b\"/alpha/denied-udp\", (\"{S_V4}\", {UDP_PORT})); print(s.recv(100))'\n\
t no_credential curl -fsS --max-time 30 -x http://127.0.0.1:3128 http://allowed.test:{HTTP_PORT}/alpha/denied-nocred\n"
    );
    let mut expect = vec![
        ("curl_http", true),
        ("curl_https", true),
        ("python", true),
        ("node", true),
        ("raw_listed", true),
        ("unlisted", false),
        ("unlisted_https", false),
        ("loopback", false),
        ("host_interface", false),
        ("noproxy_literal", false),
        ("raw_unlisted", false),
        ("raw_literal", false),
        ("udp", false),
        ("no_credential", false),
    ];
    if vm {
        alpha.push_str(
            "t vsock_other_port python3 -c 'import socket; s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM); s.settimeout(10); s.connect((2, 1234))'\n",
        );
        expect.push(("vsock_other_port", false));
    }
    let mut plans = vec![
        Plan {
            session: "alpha",
            allowed: json!(["allowed.test", "loop.test", "self.test"]),
            script: alpha,
            expect,
        },
        Plan {
            session: "beta",
            allowed: json!(["other.test"]),
            script: format!(
                "t own curl -fsS --max-time 30 http://other.test:{HTTP_PORT}/beta/ok\n\
                 t alphas curl -fsS --max-time 30 http://allowed.test:{HTTP_PORT}/beta/denied-allowed\n"
            ),
            expect: vec![("own", true), ("alphas", false)],
        },
        Plan {
            session: "gamma",
            allowed: json!([]),
            script: format!(
                "t curl curl -fsS --max-time 30 http://allowed.test:{HTTP_PORT}/gamma/denied\n\
                 t raw raw allowed.test {HTTP_PORT} /gamma/denied-raw\n"
            ),
            expect: vec![("curl", false), ("raw", false)],
        },
    ];
    if vm {
        // Guest root (the helper's COWORK_GUEST_ROOT_SESSION test hook):
        // what the host enforces does not depend on who asks in the guest.
        plans.push(Plan {
            session: ROOT_SESSION,
            allowed: json!(["allowed.test"]),
            script: format!(
                "t is_root sh -c 'test \"$(id -u)\" = 0 && grep -q \"^CapEff:.*[1-9a-f]\" /proc/self/status'\n\
                 t vsock_other_port python3 -c 'import socket; s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM); s.settimeout(10); s.connect((2, 1234))'\n\
                 t udp python3 -c 'import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(5); s.sendto(b\"/root/denied-udp\", (\"{S_V4}\", {UDP_PORT})); print(s.recv(100))'\n\
                 t udp_host python3 -c 'import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(5); s.sendto(b\"/root/denied-udp-host\", (\"{P_V4}\", {UDP_PORT})); print(s.recv(100))'\n\
                 t no_credential curl -fsS --max-time 30 -x http://127.0.0.1:3128 http://allowed.test:{HTTP_PORT}/root/denied-nocred\n\
                 t raw_literal raw {S_V4} {HTTP_PORT} /root/denied-raw-literal\n"
            ),
            expect: vec![
                ("is_root", true),
                ("vsock_other_port", false),
                ("udp", false),
                ("udp_host", false),
                ("no_credential", false),
                ("raw_literal", false),
            ],
        });
    }
    plans
}

/// The session that runs as guest root under the VM backends.
const ROOT_SESSION: &str = "rootcheck";

/// The path of startVM's `apiProbeURL`: the helper's probe goes through the
/// egress dialer, so it reaches a test server by name like a session does.
const PROBE_PATH: &str = "/api/probe";

/// The request paths the allowed attempts make.
const ALLOWED_PATHS: [&str; 7] = [
    PROBE_PATH,
    "/alpha/curl-http",
    "/alpha/curl-https",
    "/alpha/python",
    "/alpha/node",
    "/alpha/raw-listed",
    "/beta/ok",
];

/// A self-signed certificate for the test names: (cert PEM path, key path).
fn make_cert(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    netns::run(&[
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=allowed.test",
        "-addext",
        "subjectAltName=DNS:allowed.test,DNS:other.test",
        "-keyout",
        key.to_str().expect("utf-8"),
        "-out",
        cert.to_str().expect("utf-8"),
    ]);
    (cert, key)
}

/// Parses `RESULT name pass|fail …` lines.
fn results(stdout: &str) -> BTreeMap<String, (bool, String)> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("RESULT "))
        .filter_map(|r| {
            let mut w = r.splitn(3, ' ');
            let name = w.next()?.to_owned();
            let pass = w.next()? == "pass";
            Some((name, (pass, w.next().unwrap_or("").to_owned())))
        })
        .collect()
}

async fn client(helper: &VmHelper) -> (Pipe, Subscription) {
    session::client(helper, "egress", "/tmp/egress-profile", START_LIMIT).await
}

#[test]
#[ignore = "run by the egress_*_backend tests inside their namespaces"]
fn inner_egress_vm() {
    let backend = std::env::var(BACKEND_ENV).expect("backend");
    let vm = backend != "sandbox";
    let servers = ServerNamespace::create();
    let _hosts = netns::bind_hosts(HOSTS);
    let tmp = tempfile::tempdir().expect("tempdir");
    let (cert, key) = make_cert(tmp.path());
    let https_log = tmp.path().join("https.log");
    let script = tmp.path().join("servers.py");
    std::fs::write(&script, PY_SERVERS).expect("write servers.py");
    let _py = servers.spawn(&[
        "python3",
        script.to_str().expect("utf-8"),
        S_V4,
        &HTTPS_PORT.to_string(),
        &UDP_PORT.to_string(),
        cert.to_str().expect("utf-8"),
        key.to_str().expect("utf-8"),
        https_log.to_str().expect("utf-8"),
    ]);
    let http = bind_in(
        servers.pid(),
        vec![format!("{S_V4}:{HTTP_PORT}").parse().expect("addr")],
    );
    let decoys: Vec<StdTcpListener> = [
        format!("127.0.0.1:{HTTP_PORT}"),
        format!("{P_V4}:{HTTP_PORT}"),
        format!("127.0.0.1:{HTTPS_PORT}"),
    ]
    .iter()
    .map(|a| StdTcpListener::bind(a.as_str()).expect("bind decoy"))
    .collect();
    let ca_pem = std::fs::read_to_string(&cert).expect("read cert");

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let log: Log = Log::default();
        for l in http {
            serve_http(l, "http", log.clone());
        }
        for (l, label) in decoys.into_iter().zip([
            "DECOY-loopback",
            "DECOY-host-interface",
            "DECOY-loopback-tls",
        ]) {
            serve_http(l, label, log.clone());
        }
        // A UDP decoy on the host's own address: anything it gets is logged
        // as a request line ("UDP <payload>"), so it shows in the paths seen.
        {
            let udp = std::net::UdpSocket::bind((P_V4, UDP_PORT)).expect("bind udp decoy");
            let log = log.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 2048];
                while let Ok((n, peer)) = udp.recv_from(&mut buf) {
                    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                    log.lock()
                        .expect("log")
                        .push(("DECOY-udp".into(), format!("UDP {text}")));
                    let _ = udp.send_to(&buf[..n], peer);
                }
            });
        }
        // Wait for the python servers (the log file appears when they listen).
        let t0 = std::time::Instant::now();
        while !https_log.exists() {
            assert!(
                t0.elapsed() < SERVERS_LIMIT,
                "python servers did not start within {SERVERS_LIMIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        if vm {
            // Inherited by the helper, which passes it to the guest.
            std::env::set_var("COWORK_GUEST_ROOT_SESSION", ROOT_SESSION);
        }
        let mut helper = VmHelper::start_temp(
            &built_helper(),
            "egress-vm-",
            &nested::helper_base_dir(),
            &backend,
            Duration::from_secs(15),
        );
        let (pipe, mut sub) = client(&helper).await;
        session::start_vm(
            &pipe,
            &helper,
            json!({
                "memoryGB": 2,
                "cpuCount": 2,
                "apiProbeURL": format!("http://allowed.test:{HTTP_PORT}{PROBE_PATH}"),
            }),
            START_LIMIT,
            "startVM",
        )
        .await;

        let mut failures = Vec::new();
        match sub.next_of_type("apiReachability", START_LIMIT).await {
            Ok(ev) if ev["status"] == json!("reachable") => {}
            Ok(ev) => failures.push(format!("apiReachability of a reachable test server: {ev}")),
            Err(e) => failures.push(format!("no apiReachability event: {e}")),
        }
        for plan in plans(vm, &ca_pem) {
            let mut spawn = bash(
                &format!("egress-{}", plan.session),
                plan.session,
                &format!("{SCRIPT_PRELUDE}{}", plan.script),
            );
            spawn["allowedDomains"] = plan.allowed.clone();
            let out = run(&pipe, &mut sub, spawn, SCRIPT_LIMIT).await;
            let stdout = out.stdout_str();
            println!(
                "--- session {} ---\n{stdout}{}",
                plan.session,
                out.stderr_str()
            );
            let got = results(&stdout);
            for (check, want_pass) in &plan.expect {
                match got.get(*check) {
                    None => failures.push(format!("{}/{check}: no result", plan.session)),
                    Some((pass, detail)) if pass != want_pass => failures.push(format!(
                        "{}/{check}: expected {} but it {}: {detail}",
                        plan.session,
                        if *want_pass { "to pass" } else { "to fail" },
                        if *pass { "passed" } else { "failed" },
                    )),
                    Some(_) => {}
                }
            }
        }

        // Exactly the allowed requests reached a server, once each route.
        let mut seen = paths_seen(&log);
        for line in std::fs::read_to_string(&https_log)
            .unwrap_or_default()
            .lines()
        {
            if let Some(p) = line.split_whitespace().nth(1) {
                seen.insert(p.to_owned());
            }
        }
        let want: BTreeSet<String> = ALLOWED_PATHS.iter().map(|p| p.to_string()).collect();
        if seen != want {
            failures.push(format!(
                "servers saw {seen:?}, expected exactly {want:?} (https log: {:?}; decoys: {:?})",
                std::fs::read_to_string(&https_log).unwrap_or_default(),
                log.lock()
                    .expect("log")
                    .iter()
                    .filter(|(l, _)| l.starts_with("DECOY"))
                    .collect::<Vec<_>>()
            ));
        }
        let _ = pipe.call("stopVM", json!({})).await;
        let status = helper.stop();
        if !failures.is_empty() {
            panic!(
                "{} egress check(s) failed under --backend {backend}:\n{}\n--- helper log ---\n{}",
                failures.len(),
                failures.join("\n"),
                helper.log_text()
            );
        }
        assert!(
            status.is_some_and(|s| s.success()),
            "helper exit: {status:?}"
        );
    });
    println!("{INNER_OK}");
}
