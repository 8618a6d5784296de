//! Credentials stay on the host, end to end: the real Claude Code CLI in a
//! session of the real helper completes a turn against a mock Anthropic API
//! (`support::mock_api`, TLS from a test CA the helper trusts through
//! `SSL_CERT_FILE`), under the sandbox, QEMU and (nested) kvm backends.
//!
//! The client hands the token as the desktop client does
//! (`addApprovedOauthToken`, then `spawn.oauthToken`). Then:
//!
//! - the CLI's turn succeeds and the mock saw the **real** token on every
//!   credentialed request to the API host (the mock answers anything else
//!   with 401, so a turn with a placeholder would fail);
//! - the session's environment, its home and its processes' environments
//!   and command lines hold only the placeholder (their bytes are sent back
//!   and searched on the host: the real token never enters the guest, not
//!   even in this test's scripts);
//! - the placeholder sent to another allowed host (`other.example`) stays a
//!   placeholder; an attacker's own key on the API host gets the helper's
//!   local 401 and never reaches the mock;
//! - the helper's whole log never shows the token.
//!
//! Nothing leaves the machine: the helper runs in a network namespace of
//! the test's, the mock in a second one behind a veth pair, and the names
//! live in a bind-mounted `/etc/hosts` (`support::netns`).
//!
//! Gate: root with `unshare`, `ip`, `nsenter` (else a loud skip); the CLI
//! from npm (`support::claude_cli`); QEMU and the guest image with its
//! userland for the qemu case (`COWORK_QEMU_TESTS=1` makes them
//! mandatory); the nested harness for kvm (`COWORK_NESTED_TESTS`).

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::json;
use support::claude_cli;
use support::gate::{qemu_gate, qemu_missing};
use support::mock_api::{MockApi, API_HOST, HTTPS_PORT};
use support::nested;
use support::netns::{self, ServerNamespace, S_V4};
use support::session::{self, bash, rel, run};
use support::vm_helper::{self, built_helper, VmHelper};

/// Printed by the inner run when all its assertions passed.
const INNER_OK: &str = "CREDENTIALS-E2E-INNER-CHECKS-PASSED";
/// Which backend the inner run drives.
const BACKEND_ENV: &str = "COWORK_CREDENTIALS_E2E_BACKEND";
/// The CLI binary and its version, for the inner run.
const CLI_ENV: &str = "COWORK_CREDENTIALS_E2E_CLI";
const CLI_VERSION_ENV: &str = "COWORK_CREDENTIALS_E2E_CLI_VERSION";
/// The second allowed host, served by the mock too.
const OTHER_HOST: &str = "other.example";
/// What the mock's assistant says; the CLI's output must show it.
const MARKER: &str = "credentials-e2e-marker-7f3a";
/// Limit for startVM.
const START_LIMIT: Duration = Duration::from_secs(240);
/// Limit for the session's script (the CLI reads its 400 MB binary over
/// virtio-fs under TCG).
const SCRIPT_LIMIT: Duration = Duration::from_secs(900);
/// The session.
const SESSION: &str = "cred";

fn hosts() -> String {
    format!("127.0.0.1 localhost\n::1 localhost\n{S_V4} {API_HOST} {OTHER_HOST}\n")
}

/// Why the namespace part cannot run here, if it cannot.
fn missing() -> Option<String> {
    netns::missing_tools()
}

/// The CLI's env for the inner run, or `None` (a loud skip) without it.
fn cli_env() -> Option<Vec<(&'static str, String)>> {
    let cli = claude_cli::fetch_or_skip("the credentials end-to-end test")?;
    Some(vec![
        (CLI_ENV, cli.path.display().to_string()),
        (CLI_VERSION_ENV, cli.version),
    ])
}

fn rerun(backend: &str) {
    let Some(mut env) = cli_env() else { return };
    env.push((BACKEND_ENV, backend.to_string()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let out = netns::rerun_in_namespaces("inner_credentials", &env, INNER_OK);
    for l in out.lines().filter(|l| l.contains("CREDENTIALS ")) {
        eprintln!("{}", l.trim());
    }
}

#[test]
fn credentials_stay_on_the_host_sandbox() {
    if let Some(why) = missing() {
        eprintln!("skipped: {why}");
        return;
    }
    rerun("sandbox");
}

#[test]
fn credentials_stay_on_the_host_qemu() {
    const TEST: &str = "credentials_stay_on_the_host_qemu";
    let no_rootfs = vm_helper::userland_image_missing(&built_helper());
    if !qemu_gate(TEST, TEST, [qemu_missing(), no_rootfs, missing()]) {
        return;
    }
    rerun("qemu");
}

/// Set (to 1) on the re-run inside the nested harness.
const KVM_INSIDE_ENV: &str = "COWORK_CREDENTIALS_KVM_INSIDE";
/// Prints the nested run's whole output when set.
const KVM_VERBOSE_ENV: &str = "COWORK_CREDENTIALS_KVM_VERBOSE";

#[test]
fn credentials_stay_on_the_host_kvm() {
    nested::run_on_linux_kvm(
        &nested::Rerun {
            test: "credentials_stay_on_the_host_kvm",
            inside_env: KVM_INSIDE_ENV,
            ok_marker: INNER_OK,
            report_prefix: "CREDENTIALS ",
            verbose_env: KVM_VERBOSE_ENV,
            inner_timeout: Duration::from_secs(1800),
            harness_timeout: Duration::from_secs(1900),
            attempts: 2,
        },
        || missing().or_else(|| vm_helper::userland_image_missing(&built_helper())),
        || {
            rerun("kvm");
            println!("{INNER_OK}");
        },
    );
}

/// A token of the real shape (108 characters), random per run.
fn real_token() -> String {
    let mut bytes = [0u8; 72];
    getrandom::getrandom(&mut bytes).expect("random");
    let tail = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    format!("sk-ant-oat01-{}", &tail[..95])
}

/// The session's script: the CLI's turn, then what the session holds (its
/// environment, home, and its processes' environments and command lines,
/// base64 so the host can search the bytes), the placeholder sent to the
/// other allowed host, and an attacker's own key sent to the API host.
fn script(other_ca_pem: &str) -> String {
    format!(
        r#"set -u
cd "$HOME"
ca=$(mktemp); cat > "$ca" <<'PEM'
{other_ca_pem}PEM
t0=$(date +%s%N)
out=$(claude -p "Say the marker." 2>&1 < /dev/null); rc=$?
t1=$(date +%s%N)
echo "CREDENTIALS cli_rc=$rc cli_ms=$(( (t1 - t0) / 1000000 ))"
printf 'CLI_OUT=%s\n' "$(printf %s "$out" | tr '\n' ' ' | head -c 3000)"
printf 'PLACEHOLDER=%s\n' "${{CLAUDE_CODE_OAUTH_TOKEN:-unset}}"
dump=$( (env; for p in /proc/[0-9]*; do [ -r "$p/environ" ] || continue; tr '\0' '\n' < "$p/environ" 2>/dev/null; tr '\0' ' ' < "$p/cmdline" 2>/dev/null; echo; done; find "$HOME" -xdev -type f -size -4M -exec cat {{}} + 2>/dev/null) | base64 -w0)
printf 'DUMP=%s\n' "$dump"
code=$(curl -sS --max-time 60 --cacert "$ca" -o /dev/null -w '%{{http_code}}' -H "Authorization: Bearer $CLAUDE_CODE_OAUTH_TOKEN" https://{OTHER_HOST}/other-host-check)
echo "OTHER=$code"
hdrs=$(curl -sS --max-time 60 -o /dev/null -D - -H "Authorization: Bearer sk-ant-api03-attackers-own-key-0123456789" -H 'content-type: application/json' -d '{{}}' https://{API_HOST}/v1/files 2>&1 | tr '\r\n' '  ')
echo "ATTACKER=$hdrs"
"#
    )
}

/// `KEY=value` of the script's output; empty when the script printed no
/// such line (`check` reports a missing report first, with the process's
/// exit, stderr and the helper's log).
fn value<'a>(out: &'a str, key: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .unwrap_or_default()
}

#[test]
#[ignore = "run by the credentials_stay_on_the_host_* tests inside their namespaces"]
fn inner_credentials() {
    let backend = std::env::var(BACKEND_ENV).expect("backend");
    let cli = PathBuf::from(std::env::var(CLI_ENV).expect("the CLI"));
    let version = std::env::var(CLI_VERSION_ENV).expect("the CLI's version");
    let servers = ServerNamespace::create();
    let _hosts = netns::bind_hosts(&hosts());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let real = real_token();
        let mock = MockApi::builder()
            .name(OTHER_HOST)
            .reply_text(MARKER)
            .require_token(&real)
            .start(
                &servers,
                &[SocketAddr::new(S_V4.parse().expect("S_V4"), HTTPS_PORT)],
            );
        // The helper verifies the API upstream against the test CA only.
        std::env::set_var("SSL_CERT_FILE", mock.ca_pem_path());
        let mut helper = VmHelper::start_temp(
            &built_helper(),
            "credentials-e2e-",
            &nested::helper_base_dir(),
            &backend,
            Duration::from_secs(15),
        );
        let (pipe, mut sub) =
            session::client(&helper, "credentials", "/tmp/credentials-profile", START_LIMIT).await;
        let t0 = Instant::now();
        session::start_vm(&pipe, &helper, json!({"memoryGB": 2, "cpuCount": 2}), START_LIMIT, "startVM").await;
        eprintln!("CREDENTIALS startVM_ms={}", t0.elapsed().as_millis());
        install_cli(&pipe, &helper.dir, &cli, &version).await;
        pipe.call("addApprovedOauthToken", json!({"token": real}))
            .await
            .expect("addApprovedOauthToken");

        let mut spawn = bash("cred-turn", SESSION, &script(mock.ca_pem()));
        spawn["oauthToken"] = json!(real);
        spawn["allowedDomains"] = json!([API_HOST, OTHER_HOST]);
        spawn["env"] = json!({"CLAUDE_CODE_MAX_RETRIES": "0", "API_TIMEOUT_MS": "60000"});
        let out = run(&pipe, &mut sub, spawn, SCRIPT_LIMIT).await;
        let stdout = out.stdout_str();
        let report: Vec<&str> = stdout.lines().filter(|l| l.starts_with("CREDENTIALS ")).collect();
        let _ = pipe.call("stopVM", json!({})).await;
        let status = helper.stop();
        let log = helper.log_text();
        let requests = mock.requests();
        let mut failures = check(&real, &stdout, &mock, &log);
        if out.exit_code() != Some(0) {
            failures.insert(0, format!("the session's script did not exit 0: {}", out.exit));
        }
        for l in &report {
            println!("{l} backend={backend}");
        }
        if !failures.is_empty() {
            panic!(
                "{} credential check(s) failed under --backend {backend}:\n{}\n--- session stdout (DUMP cut) ---\n{}\n--- stderr ---\n{}\n--- mock ---\n{}\n--- helper log ---\n{log}",
                failures.len(),
                failures.join("\n"),
                stdout.lines().filter(|l| !l.starts_with("DUMP=")).collect::<Vec<_>>().join("\n"),
                out.stderr_str(),
                mock.describe(),
            );
        }
        assert!(status.is_some_and(|s| s.success()), "helper exit: {status:?}");
        eprintln!("CREDENTIALS mock_requests={}", requests.len());
    });
    println!("{INNER_OK}");
}

/// `installSdk` of the CLI, laid out as the client does.
async fn install_cli(pipe: &cowork_helper::client::Pipe, dir: &Path, cli: &Path, version: &str) {
    let sdk = dir.join("sdk");
    let vdir = sdk.join(version);
    std::fs::create_dir_all(&vdir).expect("sdk dir");
    if std::fs::hard_link(cli, vdir.join("claude")).is_err() {
        std::fs::copy(cli, vdir.join("claude")).expect("copy the CLI");
    }
    pipe.call(
        "installSdk",
        json!({"sdkSubpath": rel(&sdk), "version": version}),
    )
    .await
    .expect("installSdk");
}

/// Every check of the module doc; the failures, each in words.
fn check(real: &str, stdout: &str, mock: &MockApi, log: &str) -> Vec<String> {
    let mut failures = Vec::new();
    let mut want = |ok: bool, what: String| {
        if !ok {
            failures.push(what);
        }
    };
    let report = stdout
        .lines()
        .find(|l| l.starts_with("CREDENTIALS cli_rc="))
        .unwrap_or("");
    if report.is_empty() {
        // Nothing below can be judged without the script's report.
        return vec!["the session's script printed no report (see its exit and stderr)".into()];
    }
    want(
        report.contains("cli_rc=0 "),
        format!("the CLI's turn failed: {report}"),
    );
    want(
        value(stdout, "CLI_OUT").contains(MARKER),
        format!(
            "the CLI did not print the mock's answer: {}",
            value(stdout, "CLI_OUT")
        ),
    );

    let placeholder = value(stdout, "PLACEHOLDER");
    want(
        placeholder.starts_with("sk-ant-oat01-") && placeholder.len() == real.len() && placeholder != real,
        format!("the session's CLAUDE_CODE_OAUTH_TOKEN is not a placeholder of the token's shape: {placeholder:?}"),
    );
    let dump = base64::engine::general_purpose::STANDARD
        .decode(value(stdout, "DUMP"))
        .unwrap_or_default();
    let dump = String::from_utf8_lossy(&dump);
    let piece = &real[real.len() - 16..];
    want(
        dump.len() > 1000,
        format!(
            "the session's dump is implausibly small ({} bytes)",
            dump.len()
        ),
    );
    want(
        !dump.contains(real) && !dump.contains(piece),
        "the real token is in the session's environment, home or processes".to_string(),
    );
    want(
        dump.contains(placeholder),
        "the dump does not even hold the placeholder (did it run?)".into(),
    );

    // What the mock saw.
    let api: Vec<_> = mock
        .requests()
        .into_iter()
        .filter(|r| r.header("host").is_none_or(|h| h.starts_with(API_HOST)))
        .collect();
    let messages: Vec<_> = api
        .iter()
        .filter(|r| r.path().starts_with("/v1/messages"))
        .collect();
    want(
        !messages.is_empty(),
        "no /v1/messages request reached the API".into(),
    );
    for r in &api {
        if let Some(bearer) = r.bearer() {
            want(
                bearer == real,
                format!(
                    "{} reached the API with a bearer that is not the real token",
                    r.path()
                ),
            );
        }
        want(
            !r.header("authorization")
                .is_some_and(|v| v.contains("attackers-own-key")),
            "the attacker's key reached the API".into(),
        );
    }
    let other: Vec<_> = mock
        .requests()
        .into_iter()
        .filter(|r| r.path() == "/other-host-check")
        .collect();
    want(
        other.len() == 1 && other[0].bearer() == Some(placeholder),
        format!(
            "the other allowed host must see the placeholder unchanged: {:?}",
            other.iter().map(|r| r.bearer()).collect::<Vec<_>>()
        ),
    );
    let attacker = value(stdout, "ATTACKER");
    want(
        // After the proxy's own "200" to curl's CONNECT.
        attacker.contains("HTTP/1.1 401")
            && attacker
                .to_ascii_lowercase()
                .contains("x-proxy-error: refused-by-credential-guard"),
        format!("an attacker's key on the API host must get the helper's local 401: {attacker}"),
    );
    want(
        !log.contains(real) && !log.contains(piece),
        "the real token is in the helper's log".into(),
    );
    failures
}
