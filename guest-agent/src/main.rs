//! `cowork-guest-agent`: the guest agent as a standalone binary (the guest
//! image's `/init`). All logic lives in [`guest_agent::agent`].

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(guest_agent::agent::main_with_args(args));
}
