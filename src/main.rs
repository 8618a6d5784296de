//! Binary entry: hidden re-exec entries first (they must run before any
//! runtime or logger exists), then the command line.

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        // The namespace sandbox's init, re-executed by the sandbox backend.
        Some("__sandbox-init") => {
            std::process::exit(cowork_helper::backend::sandbox::init_main(args))
        }
        // The systemd probe scope's report of its limits (see sandbox::cgroup).
        Some("__cgroup-probe") => {
            std::process::exit(cowork_helper::backend::sandbox::cgroup_probe_main())
        }
        // The guest agent, run inside the sandbox from this same executable.
        Some("__agent") => {
            let rest = std::iter::once(args[0].clone())
                .chain(args.into_iter().skip(2))
                .collect();
            std::process::exit(guest_agent::agent::main_with_args(rest))
        }
        _ => std::process::exit(cowork_helper::cli::main(args)),
    }
}
