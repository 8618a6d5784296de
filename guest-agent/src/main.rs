//! `cowork-guest-agent`: the guest agent as a standalone binary (the guest
//! image's `/init`). All logic lives in [`guest_agent::agent`].
//!
//! Multi-call: run under the name `cowork-egress-connect` (the copy the
//! agent installs for ssh), or as `cowork-guest-agent egress-connect`, it
//! is ssh's `ProxyCommand` through the egress relay
//! ([`guest_agent::egress::connect_tool`]).

use guest_agent::egress::connect_tool;

fn main() {
    let mut argv = std::env::args_os();
    let name = argv
        .next()
        .map(std::path::PathBuf::from)
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_default();
    let args: Vec<String> = argv.map(|a| a.to_string_lossy().into_owned()).collect();
    if name == connect_tool::TOOL_NAME {
        std::process::exit(connect_tool::main_with_args(&args));
    }
    if args.first().map(String::as_str) == Some(connect_tool::SUBCOMMAND) {
        std::process::exit(connect_tool::main_with_args(&args[1..]));
    }
    std::process::exit(guest_agent::agent::main_with_args(args));
}
