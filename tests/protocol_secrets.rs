//! OAuth tokens: how they reach the process environment, and that none of
//! them ever appears in the helper's log, read in full after the helper
//! exited (debug logging on from the start and switched on again at runtime).

mod common;

use common::*;
use serde_json::{json, Value};

/// Prints a variable's value as hex (so its plain text never travels in
/// arguments or output), or `unset`.
fn hex_of(var: &str) -> String {
    format!(
        "if [ \"${{{var}+set}}\" = set ]; then printf %s \"${var}\" | od -An -tx1 | tr -d ' \\n'; else printf unset; fi"
    )
}

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn oauth_tokens_reach_the_env_and_never_the_log() {
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
    // The spawn token becomes CLAUDE_CODE_OAUTH_TOKEN.
    let out = run(
        &pipe,
        &mut sub,
        case(
            "t1",
            hex_of("CLAUDE_CODE_OAUTH_TOKEN"),
            json!({"PATH": "/usr/bin:/bin"}),
            Some(&spawn_tok),
        ),
    )
    .await;
    assert_eq!(
        out.stdout_str(),
        hex(&spawn_tok),
        "oauthToken → CLAUDE_CODE_OAUTH_TOKEN"
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
    assert_eq!(out.stdout_str(), format!("unset\n{}", hex(&env_api)));
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
    assert_eq!(out.stdout_str(), hex(&env_oauth));
    let out = run(
        &pipe,
        &mut sub,
        case(
            "t4",
            hex_of("CLAUDE_CODE_OAUTH_TOKEN"),
            json!({"ANTHROPIC_AUTH_TOKEN": env_auth}),
            Some(&spawn_tok),
        ),
    )
    .await;
    assert_eq!(out.stdout_str(), "unset");
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
    assert_eq!(out.stdout_str(), format!("set\n{}", hex(&approved)));

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
