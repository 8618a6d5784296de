//! Signal names and numbers as the client spells them (`SIGTERM`, `TERM`,
//! `sigkill`, `9`, `"15"`), and the names reported in exit events.

/// Signal numbers of x86_64 Linux with their names, in number order.
const SIGNALS: [(i32, &str); 31] = [
    (1, "SIGHUP"),
    (2, "SIGINT"),
    (3, "SIGQUIT"),
    (4, "SIGILL"),
    (5, "SIGTRAP"),
    (6, "SIGABRT"),
    (7, "SIGBUS"),
    (8, "SIGFPE"),
    (9, "SIGKILL"),
    (10, "SIGUSR1"),
    (11, "SIGSEGV"),
    (12, "SIGUSR2"),
    (13, "SIGPIPE"),
    (14, "SIGALRM"),
    (15, "SIGTERM"),
    (16, "SIGSTKFLT"),
    (17, "SIGCHLD"),
    (18, "SIGCONT"),
    (19, "SIGSTOP"),
    (20, "SIGTSTP"),
    (21, "SIGTTIN"),
    (22, "SIGTTOU"),
    (23, "SIGURG"),
    (24, "SIGXCPU"),
    (25, "SIGXFSZ"),
    (26, "SIGVTALRM"),
    (27, "SIGPROF"),
    (28, "SIGWINCH"),
    (29, "SIGIO"),
    (30, "SIGPWR"),
    (31, "SIGSYS"),
];

/// The default signal of `kill` when the client names none.
pub const DEFAULT: i32 = 15;

/// Parses `SIGTERM`, `TERM`, `sigterm`, `15` (1..=64; real-time numbers pass).
pub fn parse(s: &str) -> Option<i32> {
    let t = s.trim();
    if let Ok(n) = t.parse::<i32>() {
        return (1..=64).contains(&n).then_some(n);
    }
    let upper = t.to_ascii_uppercase();
    let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
    SIGNALS
        .iter()
        .find(|(_, name)| &name[3..] == bare)
        .map(|(n, _)| *n)
        .or(match bare {
            "IOT" => Some(6),
            "POLL" => Some(29),
            _ => None,
        })
}

/// The conventional name of signal `n` (`SIGRTMIN+k` style for real-time ones).
pub fn name(n: i32) -> String {
    match SIGNALS.iter().find(|(num, _)| *num == n) {
        Some((_, name)) => (*name).to_string(),
        None if (34..=64).contains(&n) => format!("SIGRTMIN+{}", n - 34),
        None => format!("SIG{n}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_client_spellings() {
        for s in ["SIGTERM", "TERM", "sigterm", "term", "15", " 15 "] {
            assert_eq!(parse(s), Some(15), "{s}");
        }
        assert_eq!(parse("sigkill"), Some(9));
        assert_eq!(parse("SIGINT"), Some(2));
        assert_eq!(parse("0"), None);
        assert_eq!(parse("65"), None);
        assert_eq!(parse("SIGNOPE"), None);
        assert_eq!(parse(""), None);
    }

    #[test]
    fn names() {
        assert_eq!(name(9), "SIGKILL");
        assert_eq!(name(15), "SIGTERM");
        assert_eq!(name(35), "SIGRTMIN+1");
    }
}
