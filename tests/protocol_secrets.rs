//! OAuth tokens: how they reach the process environment (as placeholders
//! of their shape, never the real value: the egress proxy swaps them back on
//! the way to the API hosts), that the session trusts the proxy's CA, and
//! that none of them ever appears in the helper's log, read in full after
//! the helper exited (debug logging on from the start and switched on again
//! at runtime).

mod support;

use serde_json::{json, Value};
use support::daemon::*;

/// Prints a variable's value as hex (so its plain text never travels in
/// arguments or output), or `unset`.
fn hex_of(var: &str) -> String {
    format!(
        "if [ \"${{{var}+set}}\" = set ]; then printf %s \"${var}\" | od -An -tx1 | tr -d ' \\n'; else printf unset; fi"
    )
}

fn unhex(h: &str) -> String {
    let bytes: Vec<u8> = (0..h.len() / 2)
        .map(|i| u8::from_str_radix(&h[2 * i..2 * i + 2], 16).expect("hex"))
        .collect();
    String::from_utf8(bytes).expect("utf-8")
}

/// Asserts `seen` is a placeholder of `real`: its `sk-ant-<kind>-` prefix
/// (`default_prefix` when it has none), at least its length, nothing of it.
fn assert_placeholder(seen: &str, real: &str, default_prefix: &str) {
    let prefix = if real.starts_with("sk-ant-") {
        &real[..13]
    } else {
        default_prefix
    };
    assert!(seen.starts_with(prefix), "{seen:?} lacks {prefix}");
    assert_eq!(seen.len(), real.len().max(prefix.len() + 32), "{seen:?}");
    assert_ne!(seen, real, "the real value reached the session");
    let piece = &real[real.len() - 8..];
    assert!(
        !seen.contains(piece),
        "{seen:?} carries part of the real value"
    );
}

#[tokio::test]
async fn oauth_tokens_reach_the_env_as_placeholders_and_never_the_log() {
    let mut d = Daemon::start();
    let p = Profile::new(&d, "oauth");
    let pipe = p.pipe(&d).await;
    pipe.call("setDebugLogging", json!({"enabled": true}))
        .await
        .unwrap();
    start_vm(&d, &pipe, json!({})).await;
    let mut sub = p.subscribe(&d).await;
    let n = std::process::id();
    let spawn_tok = format!("sk-ant-oat01-SPAWNTOKEN{n}x");
    let env_api = format!("sk-ant-api03-ENVAPIKEY{n}x");
    let env_oauth = format!("sk-ant-oat01-ENVOAUTH{n}x");
    let env_auth = format!("ENVAUTHTOKEN{n}x");
    let approved = format!("sk-ant-oat01-APPROVED{n}x");

    let case = |id: &str, script: String, env: Value, token: Option<&str>| {
        let mut s = sh(id, "tok", &script);
        s["env"] = env;
        if let Some(t) = token {
            s["oauthToken"] = json!(t);
        }
        s
    };
    // The spawn token becomes CLAUDE_CODE_OAUTH_TOKEN, as a placeholder;
    // the session trusts the egress CA through NODE_EXTRA_CA_CERTS.
    let out = run(
        &pipe,
        &mut sub,
        case(
            "t1",
            format!(
                "{}; echo; echo \"$NODE_EXTRA_CA_CERTS\"; head -n1 \"$NODE_EXTRA_CA_CERTS\"",
                hex_of("CLAUDE_CODE_OAUTH_TOKEN")
            ),
            json!({"PATH": "/usr/bin:/bin"}),
            Some(&spawn_tok),
        ),
    )
    .await;
    let text = out.stdout_str();
    let lines: Vec<&str> = text.lines().collect();
    assert_placeholder(&unhex(lines[0]), &spawn_tok, "sk-ant-oat01-");
    assert_eq!(
        lines[1..],
        ["/run/cowork/egress-ca.pem", "-----BEGIN CERTIFICATE-----"]
    );
    // A second spawn of the same token gets another placeholder; the
    // system bundle holds the CA once (bound over the host's read-only
    // file, which stays as it was).
    let out = run(
        &pipe,
        &mut sub,
        case(
            "t1b",
            format!(
                "{}; echo; grep -c 'BEGIN cowork-helper egress CA' /etc/ssl/certs/ca-certificates.crt",
                hex_of("CLAUDE_CODE_OAUTH_TOKEN")
            ),
            json!({}),
            Some(&spawn_tok),
        ),
    )
    .await;
    let text = out.stdout_str();
    let (second, marks) = text.split_once('\n').expect("two lines");
    assert_placeholder(&unhex(second), &spawn_tok, "sk-ant-oat01-");
    assert_ne!(unhex(second), unhex(lines[0]), "placeholders are per spawn");
    assert_eq!(marks.trim(), "1", "{text}");
    let host_bundle =
        std::fs::read_to_string("/etc/ssl/certs/ca-certificates.crt").unwrap_or_default();
    assert!(
        !host_bundle.contains("cowork-helper egress CA"),
        "the host's bundle was written"
    );
    // A credential already in env wins; the token is not injected.
    let out = run(
        &pipe,
        &mut sub,
        case(
            "t2",
            format!(
                "{}; echo; {}",
                hex_of("CLAUDE_CODE_OAUTH_TOKEN"),
                hex_of("ANTHROPIC_API_KEY")
            ),
            json!({"ANTHROPIC_API_KEY": env_api}),
            Some(&spawn_tok),
        ),
    )
    .await;
    let text = out.stdout_str();
    let (first, api) = text.split_once('\n').expect("two lines");
    assert_eq!(first, "unset");
    assert_placeholder(&unhex(api), &env_api, "sk-ant-api03-");
    let out = run(
        &pipe,
        &mut sub,
        case(
            "t3",
            hex_of("CLAUDE_CODE_OAUTH_TOKEN"),
            json!({"CLAUDE_CODE_OAUTH_TOKEN": env_oauth}),
            Some(&spawn_tok),
        ),
    )
    .await;
    assert_placeholder(&unhex(&out.stdout_str()), &env_oauth, "sk-ant-oat01-");
    let out = run(
        &pipe,
        &mut sub,
        case(
            "t4",
            format!(
                "{}; echo; {}",
                hex_of("CLAUDE_CODE_OAUTH_TOKEN"),
                hex_of("ANTHROPIC_AUTH_TOKEN")
            ),
            json!({"ANTHROPIC_AUTH_TOKEN": env_auth}),
            Some(&spawn_tok),
        ),
    )
    .await;
    let text = out.stdout_str();
    let (first, auth) = text.split_once('\n').expect("two lines");
    assert_eq!(first, "unset");
    assert_placeholder(&unhex(auth), &env_auth, "sk-ant-oat01-");
    // No token anywhere: nothing injected.
    let out = run(
        &pipe,
        &mut sub,
        case("t5", hex_of("CLAUDE_CODE_OAUTH_TOKEN"), json!({}), None),
    )
    .await;
    assert_eq!(out.stdout_str(), "unset");

    // An approved token is used by a spawn that carries none.
    pipe.call("addApprovedOauthToken", json!({"token": approved}))
        .await
        .expect("addApprovedOauthToken");
    let out = run(
        &pipe,
        &mut sub,
        case(
            "t6",
            format!(
                "test -n \"$CLAUDE_CODE_OAUTH_TOKEN\" && echo set; {}",
                hex_of("CLAUDE_CODE_OAUTH_TOKEN")
            ),
            json!({}),
            None,
        ),
    )
    .await;
    let text = out.stdout_str();
    let (first, tok) = text.split_once('\n').expect("two lines");
    assert_eq!(first, "set");
    assert_placeholder(&unhex(tok), &approved, "sk-ant-oat01-");

    // The full log, after a clean exit.
    pipe.call("stopVM", Value::Null).await.unwrap();
    d.signal(libc::SIGTERM);
    assert_eq!(d.wait_exit(T).and_then(|s| s.code()), Some(0));
    assert!(d.wait_log_closed(T), "helper log still open after exit");
    let log = d.log();
    assert!(
        log.lines().count() >= 5 && log.contains("DEBUG"),
        "expected a debug log to check:\n{log}"
    );
    for (what, secret) in [
        ("spawn.oauthToken", &spawn_tok),
        ("env ANTHROPIC_API_KEY", &env_api),
        ("env CLAUDE_CODE_OAUTH_TOKEN", &env_oauth),
        ("env ANTHROPIC_AUTH_TOKEN", &env_auth),
        ("addApprovedOauthToken", &approved),
    ] {
        // Also a distinctive piece of it, in case it was cut or quoted.
        let piece = &secret[secret.len() - 12..];
        assert!(
            !log.contains(secret.as_str()) && !log.contains(piece),
            "{what} token leaked into the log:\n{}",
            log.lines()
                .filter(|l| l.contains(piece))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}
