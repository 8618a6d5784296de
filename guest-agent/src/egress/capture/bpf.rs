//! The `sk_lookup` BPF program that steers every TCP connection to a
//! non-loopback IPv4 address to one listening socket, loaded with raw
//! `bpf(2)` calls (no libbpf, no compiler: the program is ten-odd
//! instructions assembled below).
//!
//! When the kernel looks for a listening socket for an incoming SYN, it
//! first runs the `BPF_PROG_TYPE_SK_LOOKUP` programs attached to the network
//! namespace (Linux 5.9+). Ours, for TCP over IPv4 whose destination is not
//! in `127.0.0.0/8`, takes the listener out of a one-entry `SOCKMAP` and
//! selects it with `bpf_sk_assign`, whatever address and port the listener
//! is bound to; everything else continues with the normal lookup. The
//! accepted socket's local address is the address the client dialled.
//!
//! Steps: `BPF_MAP_CREATE` (the sockmap), `BPF_MAP_UPDATE_ELEM` (the
//! listener at key 0), `BPF_PROG_LOAD` (the verifier log is captured on
//! failure), `BPF_LINK_CREATE` on the namespace (`/proc/thread-self/ns/net`).
//! Closing the link's descriptor (dropping [`SkLookup`]) detaches it.
//!
//! Constants and structures come from the kernel's uapi headers; libc has
//! none of them, so each is defined here with the header field it mirrors.
//! Limits: needs `CAP_BPF` and `CAP_NET_ADMIN` in the initial user
//! namespace (a sandbox's user namespace gets `EPERM`).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// `enum bpf_cmd` `BPF_MAP_CREATE` (`linux/bpf.h`).
const BPF_MAP_CREATE: libc::c_long = 0;
/// `enum bpf_cmd` `BPF_MAP_UPDATE_ELEM`.
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
/// `enum bpf_cmd` `BPF_PROG_LOAD`.
const BPF_PROG_LOAD: libc::c_long = 5;
/// `enum bpf_cmd` `BPF_LINK_CREATE`.
const BPF_LINK_CREATE: libc::c_long = 28;

/// `enum bpf_map_type` `BPF_MAP_TYPE_SOCKMAP`: an array of sockets.
const BPF_MAP_TYPE_SOCKMAP: u32 = 15;
/// `enum bpf_prog_type` `BPF_PROG_TYPE_SK_LOOKUP`.
const BPF_PROG_TYPE_SK_LOOKUP: u32 = 30;
/// `enum bpf_attach_type` `BPF_SK_LOOKUP`: the program's expected attach
/// type and the link's attach type.
const BPF_SK_LOOKUP: u32 = 36;

/// `BPF_FUNC_map_lookup_elem` (`enum bpf_func_id`): on a sockmap, in an
/// `sk_lookup` program, returns a referenced socket or NULL.
const FUNC_MAP_LOOKUP_ELEM: i32 = 1;
/// `BPF_FUNC_sk_release`: drops the reference the lookup took.
const FUNC_SK_RELEASE: i32 = 86;
/// `BPF_FUNC_sk_assign`: selects the socket for this lookup.
const FUNC_SK_ASSIGN: i32 = 124;

/// `enum sk_action` `SK_PASS`: continue (with the socket we selected, if
/// any).
const SK_PASS: i32 = 1;

/// `offsetof(struct bpf_sk_lookup, family)`.
const CTX_FAMILY: i16 = 8;
/// `offsetof(struct bpf_sk_lookup, protocol)`.
const CTX_PROTOCOL: i16 = 12;
/// `offsetof(struct bpf_sk_lookup, local_ip4)` (network byte order).
const CTX_LOCAL_IP4: i16 = 40;

/// Instruction class `BPF_LD` (`linux/bpf_common.h`).
const BPF_LD: u8 = 0x00;
/// Instruction class `BPF_LDX`.
const BPF_LDX: u8 = 0x01;
/// Instruction class `BPF_ST`.
const BPF_ST: u8 = 0x02;
/// Instruction class `BPF_ALU` (32-bit).
const BPF_ALU: u8 = 0x04;
/// Instruction class `BPF_JMP`.
const BPF_JMP: u8 = 0x05;
/// Instruction class `BPF_ALU64` (`linux/bpf.h`).
const BPF_ALU64: u8 = 0x07;
/// Size `BPF_W` (32 bits).
const BPF_W: u8 = 0x00;
/// Size `BPF_DW` (64 bits, `linux/bpf.h`).
const BPF_DW: u8 = 0x18;
/// Mode `BPF_IMM`.
const BPF_IMM: u8 = 0x00;
/// Mode `BPF_MEM`.
const BPF_MEM: u8 = 0x60;
/// Source `BPF_K`: the immediate.
const BPF_K: u8 = 0x00;
/// Source `BPF_X`: the source register.
const BPF_X: u8 = 0x08;
/// ALU op `BPF_ADD`.
const BPF_ADD: u8 = 0x00;
/// ALU op `BPF_AND`.
const BPF_AND: u8 = 0x50;
/// ALU op `BPF_MOV` (`linux/bpf.h`).
const BPF_MOV: u8 = 0xb0;
/// Jump op `BPF_JEQ`.
const BPF_JEQ: u8 = 0x10;
/// Jump op `BPF_JNE` (`linux/bpf.h`).
const BPF_JNE: u8 = 0x50;
/// Jump op `BPF_CALL` (`linux/bpf.h`).
const BPF_CALL: u8 = 0x80;
/// Jump op `BPF_EXIT` (`linux/bpf.h`).
const BPF_EXIT: u8 = 0x90;
/// `BPF_PSEUDO_MAP_FD`: the `src_reg` of a 64-bit immediate load whose
/// immediate is a map descriptor (the verifier swaps in the map).
const BPF_PSEUDO_MAP_FD: u8 = 1;

/// Registers: r0 return value, r1-r5 arguments (clobbered by calls), r6-r9
/// callee-saved, r10 frame pointer.
const R0: u8 = 0;
const R1: u8 = 1;
const R2: u8 = 2;
const R3: u8 = 3;
const R6: u8 = 6;
const R7: u8 = 7;
const R10: u8 = 10;

/// `AF_INET` as the context's `family` holds it.
const AF_INET: i32 = libc::AF_INET;
/// `IPPROTO_TCP` as the context's `protocol` holds it.
const IPPROTO_TCP: i32 = libc::IPPROTO_TCP;

/// The verifier log buffer for a failed load (the program is tiny; its log
/// at level 1 is a few KiB).
const LOG_SIZE: usize = 64 * 1024;
/// Verifier log level 1: the instructions and the failing state.
const LOG_LEVEL: u32 = 1;
/// How much of the verifier log's end an error keeps (the reason is last).
const LOG_TAIL: usize = 600;

/// License string of the program: it calls no GPL-only helper.
const LICENSE: &std::ffi::CStr = c"Apache-2.0";
/// Name shown by `bpftool` for the program and the map (at most 15 bytes).
const OBJ_NAME: &[u8] = b"cowork_capture";
/// Sockmap key of the listener.
const LISTENER_KEY: u32 = 0;

/// `struct bpf_insn` (`linux/bpf.h`): opcode, `dst_reg:4`/`src_reg:4`,
/// offset, immediate.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

impl Insn {
    fn new(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
        // The bit-field order follows the byte order.
        #[cfg(target_endian = "little")]
        let regs = (src << 4) | (dst & 0xf);
        #[cfg(target_endian = "big")]
        let regs = (dst << 4) | (src & 0xf);
        Insn {
            code,
            regs,
            off,
            imm,
        }
    }
}

/// The program; `map_fd` is the sockmap holding the listener.
fn program(map_fd: i32) -> Vec<Insn> {
    // local_ip4 is in network byte order in memory; a 32-bit load gives a
    // native-endian number, whose first octet these pick.
    let first_octet_mask = u32::from_ne_bytes([0xff, 0, 0, 0]) as i32;
    let loopback_octet = u32::from_ne_bytes([127, 0, 0, 0]) as i32;
    let mut p = Vec::new();
    let mut to_pass = Vec::new();
    let jump = |p: &mut Vec<Insn>, to_pass: &mut Vec<usize>, op: u8, reg: u8, imm: i32| {
        to_pass.push(p.len());
        p.push(Insn::new(BPF_JMP | op | BPF_K, reg, 0, 0, imm));
    };
    // r6 = ctx
    p.push(Insn::new(BPF_ALU64 | BPF_MOV | BPF_X, R6, R1, 0, 0));
    // if ctx->protocol != TCP: pass
    p.push(Insn::new(
        BPF_LDX | BPF_MEM | BPF_W,
        R2,
        R6,
        CTX_PROTOCOL,
        0,
    ));
    jump(&mut p, &mut to_pass, BPF_JNE, R2, IPPROTO_TCP);
    // if ctx->family != AF_INET: pass
    p.push(Insn::new(BPF_LDX | BPF_MEM | BPF_W, R2, R6, CTX_FAMILY, 0));
    jump(&mut p, &mut to_pass, BPF_JNE, R2, AF_INET);
    // if first octet of ctx->local_ip4 == 127: pass
    p.push(Insn::new(
        BPF_LDX | BPF_MEM | BPF_W,
        R2,
        R6,
        CTX_LOCAL_IP4,
        0,
    ));
    p.push(Insn::new(
        BPF_ALU | BPF_AND | BPF_K,
        R2,
        0,
        0,
        first_octet_mask,
    ));
    jump(&mut p, &mut to_pass, BPF_JEQ, R2, loopback_octet);
    // key = 0 on the stack; r0 = map_lookup_elem(map, &key)
    p.push(Insn::new(
        BPF_ST | BPF_MEM | BPF_W,
        R10,
        0,
        -4,
        LISTENER_KEY as i32,
    ));
    p.push(Insn::new(
        BPF_LD | BPF_DW | BPF_IMM,
        R1,
        BPF_PSEUDO_MAP_FD,
        0,
        map_fd,
    ));
    p.push(Insn::new(0, 0, 0, 0, 0));
    p.push(Insn::new(BPF_ALU64 | BPF_MOV | BPF_X, R2, R10, 0, 0));
    p.push(Insn::new(BPF_ALU64 | BPF_ADD | BPF_K, R2, 0, 0, -4));
    p.push(Insn::new(BPF_JMP | BPF_CALL, 0, 0, 0, FUNC_MAP_LOOKUP_ELEM));
    // if !sk: pass
    jump(&mut p, &mut to_pass, BPF_JEQ, R0, 0);
    // r7 = sk; sk_assign(ctx, sk, 0); sk_release(sk)
    p.push(Insn::new(BPF_ALU64 | BPF_MOV | BPF_X, R7, R0, 0, 0));
    p.push(Insn::new(BPF_ALU64 | BPF_MOV | BPF_X, R1, R6, 0, 0));
    p.push(Insn::new(BPF_ALU64 | BPF_MOV | BPF_X, R2, R7, 0, 0));
    p.push(Insn::new(BPF_ALU64 | BPF_MOV | BPF_K, R3, 0, 0, 0));
    p.push(Insn::new(BPF_JMP | BPF_CALL, 0, 0, 0, FUNC_SK_ASSIGN));
    p.push(Insn::new(BPF_ALU64 | BPF_MOV | BPF_X, R1, R7, 0, 0));
    p.push(Insn::new(BPF_JMP | BPF_CALL, 0, 0, 0, FUNC_SK_RELEASE));
    // pass: return SK_PASS
    let pass = p.len();
    p.push(Insn::new(BPF_ALU64 | BPF_MOV | BPF_K, R0, 0, 0, SK_PASS));
    p.push(Insn::new(BPF_JMP | BPF_EXIT, 0, 0, 0, 0));
    for at in to_pass {
        // Offsets count from the instruction after the jump; the program
        // is far shorter than i16::MAX.
        p[at].off = (pass - at - 1) as i16;
    }
    p
}

/// `union bpf_attr` for `BPF_MAP_CREATE` (leading fields).
#[repr(C)]
#[derive(Default)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
}

/// `union bpf_attr` for `BPF_MAP_UPDATE_ELEM`.
#[repr(C)]
#[derive(Default)]
struct MapUpdateAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// `union bpf_attr` for `BPF_PROG_LOAD` (up to `expected_attach_type`).
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// `union bpf_attr` for `BPF_LINK_CREATE` (leading fields).
#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
}

/// A failed step: which, the errno, and the verifier's explanation when the
/// program was refused.
#[derive(Debug)]
pub(super) struct BpfFailure {
    pub(super) step: &'static str,
    pub(super) source: io::Error,
    pub(super) log: String,
}

/// `bpf(cmd, attr, sizeof attr)`, returning the new descriptor (or 0).
fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: attr is a valid, initialised bpf_attr prefix of the given
    // size; the kernel zero-extends shorter attributes.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            (attr as *mut T).cast::<libc::c_void>(),
            std::mem::size_of::<T>(),
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// A descriptor returned by `bpf(2)`, owned.
fn owned(fd: libc::c_long) -> io::Result<OwnedFd> {
    let fd = i32::try_from(fd).map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: bpf(2) just returned this new descriptor, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn name() -> [u8; 16] {
    let mut n = [0u8; 16];
    n[..OBJ_NAME.len()].copy_from_slice(OBJ_NAME);
    n
}

/// The kernel objects that keep the steering alive; dropping them detaches
/// the program.
#[derive(Debug)]
pub(super) struct SkLookup {
    _link: OwnedFd,
    _prog: OwnedFd,
    _map: OwnedFd,
}

/// Steers new IPv4 TCP connections to non-loopback addresses in this
/// thread's network namespace to `listener` (a listening TCP socket).
pub(super) fn attach(listener: BorrowedFd<'_>) -> Result<SkLookup, BpfFailure> {
    let fail = |step, source| BpfFailure {
        step,
        source,
        log: String::new(),
    };
    let mut create = MapCreateAttr {
        map_type: BPF_MAP_TYPE_SOCKMAP,
        key_size: 4,
        value_size: 4,
        max_entries: 1,
        map_name: name(),
        ..Default::default()
    };
    let map = bpf(BPF_MAP_CREATE, &mut create)
        .and_then(owned)
        .map_err(|e| fail("map create (sockmap)", e))?;

    let key = LISTENER_KEY;
    let value = listener.as_raw_fd() as u32;
    let mut update = MapUpdateAttr {
        map_fd: map.as_raw_fd() as u32,
        key: &key as *const u32 as u64,
        value: &value as *const u32 as u64,
        ..Default::default()
    };
    bpf(BPF_MAP_UPDATE_ELEM, &mut update).map_err(|e| fail("map update (add the listener)", e))?;

    let insns = program(map.as_raw_fd());
    let load = |log: &mut [u8]| {
        let mut attr = ProgLoadAttr {
            prog_type: BPF_PROG_TYPE_SK_LOOKUP,
            insn_cnt: insns.len() as u32,
            insns: insns.as_ptr() as u64,
            license: LICENSE.as_ptr() as u64,
            prog_name: name(),
            expected_attach_type: BPF_SK_LOOKUP,
            ..Default::default()
        };
        if !log.is_empty() {
            attr.log_level = LOG_LEVEL;
            attr.log_size = log.len() as u32;
            attr.log_buf = log.as_mut_ptr() as u64;
        }
        bpf(BPF_PROG_LOAD, &mut attr).and_then(owned)
    };
    let prog = match load(&mut []) {
        Ok(p) => p,
        Err(source) => {
            // Again with the verifier's log, to say why.
            let mut log = vec![0u8; LOG_SIZE];
            let _ = load(&mut log);
            return Err(BpfFailure {
                step: "program load",
                source,
                log: log_tail(&log),
            });
        }
    };

    let netns = std::fs::File::open("/proc/thread-self/ns/net")
        .map_err(|e| fail("open /proc/thread-self/ns/net", e))?;
    let mut link = LinkCreateAttr {
        prog_fd: prog.as_raw_fd() as u32,
        target_fd: netns.as_raw_fd() as u32,
        attach_type: BPF_SK_LOOKUP,
        flags: 0,
    };
    let link = bpf(BPF_LINK_CREATE, &mut link)
        .and_then(owned)
        .map_err(|e| fail("link create (attach to the network namespace)", e))?;
    Ok(SkLookup {
        _link: link,
        _prog: prog,
        _map: map,
    })
}

/// The end of a NUL-terminated verifier log, on one line.
fn log_tail(log: &[u8]) -> String {
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    let text = String::from_utf8_lossy(&log[..end]);
    let text = text.trim();
    let start = text
        .char_indices()
        .map(|(i, _)| i)
        .find(|&i| text.len() - i <= LOG_TAIL)
        .unwrap_or(text.len());
    text[start..].split('\n').collect::<Vec<_>>().join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_program_jumps_to_its_pass_exit() {
        let p = program(42);
        let pass = p.len() - 2;
        assert_eq!(
            p[pass],
            Insn::new(BPF_ALU64 | BPF_MOV | BPF_K, R0, 0, 0, SK_PASS)
        );
        assert_eq!(p[pass + 1].code, BPF_JMP | BPF_EXIT);
        let mut jumps = 0;
        for (i, insn) in p.iter().enumerate() {
            let op = insn.code & 0xf0;
            if insn.code & 0x07 == BPF_JMP && (op == BPF_JEQ || op == BPF_JNE) {
                assert_eq!(i as i64 + 1 + i64::from(insn.off), pass as i64, "insn {i}");
                jumps += 1;
            }
        }
        assert_eq!(jumps, 4);
        // The map descriptor is in the 64-bit load, marked as such.
        let ld = p
            .iter()
            .find(|i| i.code == BPF_LD | BPF_DW | BPF_IMM)
            .unwrap();
        assert_eq!(ld.imm, 42);
        #[cfg(target_endian = "little")]
        assert_eq!(ld.regs, (BPF_PSEUDO_MAP_FD << 4) | R1);
        assert_eq!(std::mem::size_of::<Insn>(), 8);
    }

    #[test]
    fn attribute_layouts_match_the_uapi_offsets() {
        assert_eq!(std::mem::size_of::<ProgLoadAttr>(), 72);
        assert_eq!(std::mem::offset_of!(ProgLoadAttr, log_buf), 32);
        assert_eq!(std::mem::offset_of!(ProgLoadAttr, prog_name), 48);
        assert_eq!(std::mem::offset_of!(ProgLoadAttr, expected_attach_type), 68);
        assert_eq!(std::mem::offset_of!(MapCreateAttr, map_name), 28);
        assert_eq!(std::mem::offset_of!(MapUpdateAttr, key), 8);
        assert_eq!(std::mem::offset_of!(MapUpdateAttr, flags), 24);
        assert_eq!(std::mem::offset_of!(LinkCreateAttr, attach_type), 8);
    }

    #[test]
    fn the_log_tail_is_one_line_and_bounded() {
        let mut log = b"0: (bf) r6 = r1\n1: R2 invalid mem access\n".to_vec();
        log.extend_from_slice(&[0; 10]);
        assert_eq!(log_tail(&log), "0: (bf) r6 = r1 | 1: R2 invalid mem access");
        let long = "é".repeat(2000);
        let tail = log_tail(long.as_bytes());
        assert!(tail.len() <= LOG_TAIL && !tail.is_empty());
        assert_eq!(log_tail(b""), "");
    }
}
