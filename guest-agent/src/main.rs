fn main() {
    eprintln!("cowork-guest-agent: not built yet");
    std::process::exit(2);
}
