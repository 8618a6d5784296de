//! Stand-alone `vm run` for trying the VMM without the daemon binary:
//! `cargo run -p vmm --example vm_run -- --kernel PATH [--initrd PATH]
//! [--cmdline STR] [--mem MIB] [--cpus N] [--allow-unsuitable-kvm]`.
//! Same behaviour and exit status as `cowork-helper vm run`.

use vmm::cli::{vm_run, VmRunArgs};

fn usage() -> ! {
    eprintln!("usage: vm_run --kernel PATH [--initrd PATH] [--cmdline STR] [--mem MIB] [--cpus N] [--allow-unsuitable-kvm]");
    std::process::exit(2);
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut kernel = None;
    let mut a = VmRunArgs::new("");
    while let Some(flag) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| usage());
        match flag.as_str() {
            "--kernel" => kernel = Some(val()),
            "--initrd" => a.initrd = Some(val().into()),
            "--cmdline" => a.cmdline = Some(val()),
            "--mem" => a.mem_mib = val().parse().unwrap_or_else(|_| usage()),
            "--cpus" => a.cpus = val().parse().unwrap_or_else(|_| usage()),
            "--allow-unsuitable-kvm" => a.allow_unsuitable_kvm = true,
            _ => usage(),
        }
    }
    a.kernel = kernel.unwrap_or_else(|| usage()).into();
    std::process::exit(vm_run(a));
}
