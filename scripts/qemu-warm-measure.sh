#!/usr/bin/env bash
# qemu-warm-measure.sh - measure whether a QEMU (TCG) warm start could beat
# the cold boot of the guest (issue 24, item 3). Measurement only; touches
# no product code and needs no helper: the guest boots the image's kernel and
# initramfs with an extra init script (/measure-init, appended as a second
# cpio archive) that loads the image's virtio modules, prints markers with
# its uptime on the serial console and reports every virtio device a driver
# binds to (and mounts a hot-plugged virtio-fs share).
#
# Usage:
#   scripts/qemu-warm-measure.sh [-n RUNS] [-m MEM_MIB] [-c CPUS] [-g GUEST_IMAGE_DIR]
#                                [-a "EXTRA KERNEL WORDS"]
#     -n RUNS   repetitions of every timed step (default 5, at least 3)
#     -m MIB    guest RAM (default 1024, as the qemu backend)
#     -c CPUS   vCPUs (default 2)
#     -g DIR    guest image directory with vmlinuz, initramfs and rootfs.img
#               (default /work/wt-warmstart/target/guest-image)
#     -a WORDS  appended to the guest kernel command line (e.g. acpi=noirq,
#               which skips the ACPI interrupt-link evaluation that costs
#               most of a hot-plug under TCG)
#   Environment: QEMU (default qemu-system-x86_64), VIRTIOFSD (default
#   /usr/lib/qemu/virtiofsd), QSD (default qemu-storage-daemon), KEEP=1
#   keeps the work directory. Needs python3 and cpio. Takes ~2 minutes
#   with -n 5 on 2 cores.
#
# What it does (all with -accel tcg -cpu max -M pc, -nodefaults, the
# product's boot-time kernel words, serial console on a pipe):
#   1. cold boot: process start -> "MARK-INIT" (init runs) and "MARK-BOOTED"
#      (virtio modules loaded) on the serial console;
#   2. process start -> QMP greeting + qmp_capabilities answered, with -S
#      (memfd RAM as the product, and file RAM as the warm-start design);
#   3. snapshots: boot, settle, `stop`, `migrate exec:cat > FILE`, either
#      (A) memfd share=on RAM copied through the migration stream, or
#      (B) memory-backend-file share=on RAM in /dev/shm with the
#          x-ignore-shared capability (RAM stays in the file, the stream
#          holds device state only);
#   4. restores: per-start copy of the RAM file (B only, cp --sparse=always),
#      process start with `-incoming defer` -> QMP ready -> (B: set
#      x-ignore-shared) -> `migrate-incoming exec:cat FILE` -> `cont` ->
#      query-status "running"; then hot-plug `virtio-rng-pci` (lower bound)
#      and a real vhost-user device (`vhost-user-fs-pci` served by virtiofsd;
#      Debian's QEMU 7.2 ships no vhost-user-vsock daemon) one after the
#      other and time until the guest's driver has bound (and the share is
#      mounted); in B also a batch of four at once (2x vhost-user-blk-pci
#      from qemu-storage-daemon, virtio-rng-pci, vhost-user-fs-pci);
#   5. refusals: `migrate` of a VM with vhost-user-fs, and
#      `device_add vhost-user-vsock-pci` with no backend, QEMU's errors kept
#      verbatim;
#   6. (C) vhost-user-blk migrates: snapshot a VM with a vhost-user-blk root
#      disk (B's way), restore it against a fresh qemu-storage-daemon and
#      time start -> running and a guest read of an uncached disk block.
# Prints a table (step, min/median ms, n) and the errors; writes nothing
# outside its temporary directory under /dev/shm, which it removes (with
# every QEMU and virtiofsd process it started) on exit.
set -euo pipefail

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }

RUNS=5 MEM=1024 CPUS=2 GUEST=/work/wt-warmstart/target/guest-image EXTRA=
while getopts "n:m:c:g:a:h" o; do
  case "$o" in
    n) RUNS=$OPTARG ;; m) MEM=$OPTARG ;; c) CPUS=$OPTARG ;; g) GUEST=$OPTARG ;; a) EXTRA=$OPTARG ;;
    h) usage; exit 0 ;; *) usage >&2; exit 2 ;;
  esac
done
[ "$RUNS" -ge 3 ] || { echo "-n must be at least 3" >&2; exit 2; }
QEMU=${QEMU:-qemu-system-x86_64}
VIRTIOFSD=${VIRTIOFSD:-/usr/lib/qemu/virtiofsd}
QSD=${QSD:-qemu-storage-daemon}
for f in "$GUEST/vmlinuz" "$GUEST/initramfs" "$GUEST/rootfs.img"; do
  [ -r "$f" ] || { echo "missing $f" >&2; exit 1; }
done
command -v "$QEMU" >/dev/null || { echo "no $QEMU" >&2; exit 1; }
command -v python3 >/dev/null || { echo "needs python3" >&2; exit 1; }
command -v cpio >/dev/null || { echo "needs cpio" >&2; exit 1; }
[ -x "$VIRTIOFSD" ] || { echo "no $VIRTIOFSD" >&2; exit 1; }
command -v "$QSD" >/dev/null || { echo "no $QSD" >&2; exit 1; }

WORK=$(mktemp -d /dev/shm/qemu-warm-measure.XXXXXX)
cleanup() {
  # Only the processes this run started (their pids are in $WORK/pids).
  if [ -f "$WORK/pids" ]; then
    while read -r p; do kill "$p" 2>/dev/null || true; done <"$WORK/pids"
  fi
  if [ "${KEEP:-0}" = 1 ]; then echo "kept $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The guest's extra init: the image's initramfs plus /measure-init.
mkdir -p "$WORK/ov" "$WORK/share"
cat >"$WORK/ov/measure-init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
echo "MARK-INIT $(cat /proc/uptime)"
K=/lib/modules/$(uname -r)
for m in $(cat /lib/modules/load-order); do insmod $K/$m 2>/dev/null; done
echo "MARK-BOOTED $(cat /proc/uptime)"
seen=" "
k=1000
while :; do
  for d in /sys/bus/virtio/devices/*; do
    [ -e "$d/driver" ] || continue
    n=${d##*/}
    case "$seen" in *" $n "*) continue;; esac
    seen="$seen$n "
    drv=$(basename $(readlink $d/driver))
    echo "MARK-BOUND $n $drv $(cat /proc/uptime)"
    # A disk that was in the snapshot still answers (uncached block k).
    if [ -b /dev/vda ]; then
      k=$((k + 1))
      echo "MARK-VDA block $k $(dd if=/dev/vda bs=4096 count=1 skip=$k 2>/dev/null | md5sum)"
    fi
    if [ "$drv" = virtiofs ]; then
      mount -t virtiofs hot /mnt && echo "MARK-MOUNTED $(ls /mnt | wc -l) $(cat /proc/uptime)"
    fi
  done
  sleep 0.02
done
EOF
chmod +x "$WORK/ov/measure-init"
(cd "$WORK/ov" && echo measure-init | cpio -o -H newc -R 0:0 2>/dev/null) >"$WORK/ov.cpio"
cat "$GUEST/initramfs" "$WORK/ov.cpio" >"$WORK/initrd"
echo "hot-plugged share" >"$WORK/share/hello"

echo "# $(date -Is) $(uptime)"
echo "# $("$QEMU" --version | head -1); runs=$RUNS mem=${MEM}M cpus=$CPUS guest=$GUEST extra-cmdline='$EXTRA'"

cat >"$WORK/drive.py" <<'EOF'
import json, os, shutil, signal, socket, statistics, subprocess, sys, threading, time

WORK, QEMU, VIRTIOFSD, KERNEL = sys.argv[1:5]
RUNS, MEM, CPUS = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
QSD, ROOTFS, EXTRA = sys.argv[8:11]
INITRD = f"{WORK}/initrd"
CMDLINE = ("console=ttyS0 panic=-1 quiet 8250.nr_uarts=1 i8042.noaux cryptomgr.notests "
           "initcall_blacklist=crypto_kdf108_init,init_encrypted,trace_eval_init,tracer_init_tracefs "
           "apparmor=0 rdinit=/measure-init " + EXTRA).strip()
procs = []
results = {}   # step -> [ms]
notes = []

def record(step, ms):
    results.setdefault(step, []).append(ms)

def track(p):
    procs.append(p)
    with open(f"{WORK}/pids", "a") as f:
        f.write(f"{p.pid}\n")

def kill_all():
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()

def now():
    return time.monotonic()

class Serial:
    """Lines of the guest's serial console (QEMU's stdout), with host times."""
    def __init__(self, stream):
        self.lines = []
        self.cv = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()
    def _read(self, stream):
        for raw in stream:
            line = raw.decode(errors="replace").rstrip("\r\n")
            with self.cv:
                self.lines.append((now(), line))
                self.cv.notify_all()
        with self.cv:
            self.lines.append((now(), None))
            self.cv.notify_all()
    def mark(self):
        with self.cv:
            return len(self.lines)
    def wait(self, text, start=0, timeout=60):
        end = now() + timeout
        i = start
        with self.cv:
            while True:
                while i < len(self.lines):
                    t, l = self.lines[i]
                    if l is None:
                        raise RuntimeError(f"QEMU exited waiting for {text!r}: {self.tail()}")
                    if text in l:
                        return t, l
                    i += 1
                left = end - now()
                if left <= 0:
                    raise RuntimeError(f"timeout waiting for {text!r}: {self.tail()}")
                self.cv.wait(left)
    def wait_n(self, text, n, start=0, timeout=60):
        t, i = None, start
        for _ in range(n):
            t, _ = self.wait(text, start=i, timeout=timeout)
            with self.cv:
                i = next(k for k in range(i, len(self.lines))
                         if self.lines[k][1] and text in self.lines[k][1]) + 1
        return t
    def tail(self):
        return " | ".join(l for _, l in self.lines[-8:] if l)

class Qmp:
    def __init__(self, path, deadline=30):
        end = now() + deadline
        while True:
            try:
                s = socket.socket(socket.AF_UNIX)
                s.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
                if now() > end:
                    raise
                time.sleep(0.001)
        self.f = s.makefile("rwb", buffering=0)
        self.events = []
        json.loads(self.f.readline())          # greeting
        self.cmd("qmp_capabilities")
    def cmd(self, name, **args):
        msg = {"execute": name}
        if args:
            msg["arguments"] = args
        self.f.write(json.dumps(msg).encode() + b"\n")
        while True:
            r = json.loads(self.f.readline())
            if "event" in r:
                self.events.append(r)
                continue
            return r
    def ok(self, name, **args):
        r = self.cmd(name, **args)
        if "error" in r:
            raise RuntimeError(f"{name}: {r['error']['desc']}")
        return r["return"]
    def hmp(self, line):
        return self.ok("human-monitor-command", **{"command-line": line})

def mem_args(kind, path=None):
    if kind == "memfd":
        obj = f"memory-backend-memfd,id=mem,size={MEM}M,share=on"
    else:
        obj = f"memory-backend-file,id=mem,size={MEM}M,mem-path={path},share=on"
    return ["-object", obj, "-numa", "node,memdev=mem"]

def start_qemu(name, mem, extra=()):
    qmp = f"{WORK}/{name}.qmp"
    if os.path.exists(qmp):
        os.unlink(qmp)
    args = [QEMU, "-name", name, "-nodefaults", "-nographic", "-no-user-config",
            "-no-reboot", "-accel", "tcg", "-cpu", "max", "-M", "pc",
            "-smp", str(CPUS), "-m", f"{MEM}M", *mem, "-serial", "stdio",
            "-qmp", f"unix:{qmp},server=on,wait=off",
            "-device", "virtio-balloon-pci,free-page-reporting=on",
            "-kernel", KERNEL, "-initrd", INITRD, "-append", CMDLINE, *extra]
    t0 = now()
    p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    track(p)
    return t0, p, Serial(p.stdout), qmp

def stop_qemu(p):
    if p.poll() is None:
        p.kill()
    p.wait()

def ms(a, b):
    return (b - a) * 1000.0

def start_virtiofsd(tag):
    sock = f"{WORK}/{tag}.vfs.sock"
    if os.path.exists(sock):
        os.unlink(sock)
    p = subprocess.Popen([VIRTIOFSD, f"--socket-path={sock}", "-o", f"source={WORK}/share",
                          "-o", "cache=none"], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=open(f"{WORK}/{tag}.vfs.log", "w"))
    track(p)
    for _ in range(2000):
        if os.path.exists(sock):
            return p, sock
        time.sleep(0.001)
    raise RuntimeError("virtiofsd did not create its socket")

# 1. cold boot
for i in range(RUNS):
    t0, p, ser, _ = start_qemu("cold", mem_args("memfd"))
    t1, _ = ser.wait("MARK-INIT")
    t2, _ = ser.wait("MARK-BOOTED")
    record("cold: start -> guest init runs (MARK-INIT)", ms(t0, t1))
    record("cold: start -> virtio modules loaded (MARK-BOOTED)", ms(t0, t2))
    stop_qemu(p)

# 2. process start -> paused with QMP ready
for kind in ("memfd", "file"):
    for i in range(RUNS):
        ram = f"{WORK}/ram-probe"
        t0, p, ser, qp = start_qemu("probe", mem_args(kind, ram), ["-S"])
        q = Qmp(qp)
        t1 = now()
        assert q.ok("query-status")["status"] == "prelaunch"
        record(f"process start -> -S paused, QMP ready ({kind} RAM)", ms(t0, t1))
        stop_qemu(p)
        if os.path.exists(ram):
            os.unlink(ram)

def start_qsd(tag):
    """qemu-storage-daemon serving vhost-user-blk: the image's rootfs.img
    read-only (a root disk) and a 64 MiB null-co disk (the session disk)."""
    socks = [f"{WORK}/{tag}.root.sock", f"{WORK}/{tag}.sess.sock"]
    for x in socks:
        if os.path.exists(x):
            os.unlink(x)
    p = subprocess.Popen([QSD,
        "--blockdev", f"driver=file,node-name=root,filename={ROOTFS},read-only=on",
        "--blockdev", "driver=null-co,node-name=sess,size=67108864",
        "--export", f"type=vhost-user-blk,id=e1,node-name=root,addr.type=unix,addr.path={socks[0]},writable=off",
        "--export", f"type=vhost-user-blk,id=e2,node-name=sess,addr.type=unix,addr.path={socks[1]},writable=on"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=open(f"{WORK}/{tag}.qsd.log", "w"))
    track(p)
    for _ in range(5000):
        if all(os.path.exists(x) for x in socks):
            return p, socks
        time.sleep(0.001)
    raise RuntimeError("qemu-storage-daemon did not create its sockets: "
                       + open(f"{WORK}/{tag}.qsd.log").read())

# 3. snapshots
def snapshot(mode):
    ram = f"{WORK}/snap-{mode}.ram"
    state = f"{WORK}/snap-{mode}.state"
    mem = mem_args("memfd") if mode == "A" else mem_args("file", ram)
    t0, p, ser, qp = start_qemu(f"snap{mode}", mem)
    q = Qmp(qp)
    ser.wait("MARK-BOOTED")
    time.sleep(2)                       # settle
    ts = now()
    q.ok("stop")
    if mode == "B":
        q.ok("migrate-set-capabilities",
             capabilities=[{"capability": "x-ignore-shared", "state": True}])
    q.ok("migrate", uri=f"exec:cat > {state}")
    while True:
        st = q.ok("query-migrate")
        if st.get("status") == "completed":
            break
        if st.get("status") == "failed":
            raise RuntimeError(f"migrate failed: {st}")
        time.sleep(0.002)
    te = now()
    stop_qemu(p)
    size = os.path.getsize(state)
    alloc = os.stat(ram).st_blocks * 512 if mode == "B" else 0
    notes.append(f"snapshot {mode}: stop+migrate {ms(ts, te):.0f} ms, state file {size/1e6:.1f} MB"
                 + (f", RAM file {MEM} MiB apparent / {alloc/1e6:.1f} MB allocated" if mode == "B" else ""))
    return ram, state

# 4. restores and hot-plugs
def restore(mode, ram, state, i, batch=False):
    tag = f"r{mode}{i}{'b' if batch else ''}"
    if mode == "B":
        per = f"{WORK}/{tag}.ram"
        tc = now()
        subprocess.run(["cp", "--sparse=always", ram, per], check=True)
        record("B: per-start copy of the RAM file (cp --sparse=always, tmpfs)", ms(tc, now()))
        mem = mem_args("file", per)
    else:
        mem = mem_args("memfd")
    t0, p, ser, qp = start_qemu(tag, mem, ["-incoming", "defer"])
    q = Qmp(qp)
    t1 = now()
    if mode == "B":
        q.ok("migrate-set-capabilities",
             capabilities=[{"capability": "x-ignore-shared", "state": True}])
    mark = ser.mark()
    q.ok("migrate-incoming", uri=f"exec:cat {state}")
    while True:
        s = q.ok("query-status")["status"]
        if s != "inmigrate":
            break
        time.sleep(0.001)
    t2 = now()
    if s != "running":
        q.ok("cont")
    while q.ok("query-status")["status"] != "running":
        time.sleep(0.001)
    t3 = now()
    label = {"A": "A (RAM in stream, memfd)", "B": "B (RAM file + x-ignore-shared)"}[mode]
    record(f"{label}: start -> QMP ready (-incoming defer)", ms(t0, t1))
    record(f"{label}: migrate-incoming -> loaded (state {s})", ms(t1, t2))
    record(f"{label}: start -> running", ms(t0, t3))
    if batch:
        plug_batch(label, q, ser, mark, tag, t0)
        stop_qemu(p)
        if mode == "B":
            os.unlink(per)
        return
    # The guest runs on: its loop binds the hot-plugged devices.
    tp = now()
    q.ok("device_add", driver="virtio-rng-pci", id="hrng")
    ta = now()
    tb, line = ser.wait("virtio_rng", start=mark, timeout=30)
    record(f"{label}: device_add virtio-rng-pci (QMP return)", ms(tp, ta))
    record(f"{label}: device_add virtio-rng-pci -> guest driver bound", ms(tp, tb))
    fsd, sock = start_virtiofsd(tag)
    tp = now()
    q.ok("chardev-add", id="vfs", backend={"type": "socket", "data": {
        "addr": {"type": "unix", "data": {"path": sock}}, "server": False}})
    q.ok("device_add", driver="vhost-user-fs-pci", id="hfs", chardev="vfs", tag="hot")
    ta = now()
    tb, _ = ser.wait("virtiofs", start=mark, timeout=30)
    tm, mline = ser.wait("MARK-MOUNTED", start=mark, timeout=30)
    record(f"{label}: chardev-add+device_add vhost-user-fs-pci (QMP return)", ms(tp, ta))
    record(f"{label}: vhost-user-fs hot-plug -> guest driver bound", ms(tp, tb))
    record(f"{label}: vhost-user-fs hot-plug -> share mounted in guest", ms(tp, tm))
    record(f"{label}: start -> running + both hot-plugs done (share mounted)", ms(t0, tm))
    if i == 0:
        notes.append(f"{label} guest console after restore: "
                     + " | ".join(l for _, l in ser.lines[mark:] if l and "MARK" in l))
    stop_qemu(p)
    stop_qemu(fsd)
    if mode == "B":
        os.unlink(per)

def plug_batch(label, q, ser, mark, tag, t0):
    """Four devices at once, three of them real vhost-user: vhost-user-fs
    (virtiofsd), two vhost-user-blk (qemu-storage-daemon: rootfs.img
    read-only and a session disk) and virtio-rng standing in for the rng
    (vsock has no backend here). Backends are started before the clock."""
    fsd, sock = start_virtiofsd(tag)
    qsd, bsocks = start_qsd(tag)
    tp = now()
    for n, bs in zip(("root", "sess"), bsocks):
        q.ok("chardev-add", id="c" + n, backend={"type": "socket", "data": {
            "addr": {"type": "unix", "data": {"path": bs}}, "server": False}})
        q.ok("device_add", driver="vhost-user-blk-pci", id="d" + n, chardev="c" + n,
             **{"num-queues": 1})
    q.ok("device_add", driver="virtio-rng-pci", id="hrng")
    q.ok("chardev-add", id="vfs", backend={"type": "socket", "data": {
        "addr": {"type": "unix", "data": {"path": sock}}, "server": False}})
    q.ok("device_add", driver="vhost-user-fs-pci", id="hfs", chardev="vfs", tag="hot")
    ta = now()
    tb = ser.wait_n("MARK-BOUND", 4, start=mark, timeout=30)
    tm, _ = ser.wait("MARK-MOUNTED", start=mark, timeout=30)
    record(f"{label}: batch of 4 hot-plugs, QMP commands return", ms(tp, ta))
    record(f"{label}: batch of 4 hot-plugs -> all 4 drivers bound", ms(tp, tb))
    record(f"{label}: batch of 4 hot-plugs -> share mounted", ms(tp, tm))
    record(f"{label}: start -> running + batch hot-plug done", ms(t0, max(tb, tm)))
    if not any("batch console" in n for n in notes):
        notes.append(f"{label} batch console: "
                     + " | ".join(l for _, l in ser.lines[mark:] if l and "MARK" in l))
    stop_qemu(fsd)
    stop_qemu(qsd)

# 5. what QEMU refuses
def refusals():
    fsd, sock = start_virtiofsd("refuse")
    t0, p, ser, qp = start_qemu("refuse", mem_args("memfd"), [
        "-chardev", f"socket,id=vfs,path={sock}",
        "-device", "vhost-user-fs-pci,chardev=vfs,tag=hot"])
    q = Qmp(qp)
    ser.wait("MARK-BOOTED")
    q.ok("stop")
    r = q.cmd("migrate", uri=f"exec:cat > {WORK}/refused.state")
    if "error" in r:
        notes.append(f"migrate with vhost-user-fs-pci -> error: {r['error']['desc']}")
    else:
        time.sleep(1)
        notes.append(f"migrate with vhost-user-fs-pci -> {q.ok('query-migrate')}")
    r = q.cmd("migrate-set-capabilities",
              capabilities=[{"capability": "x-ignore-shared", "state": True}])
    r = q.cmd("migrate", uri=f"exec:cat > {WORK}/refused.state")
    notes.append("migrate with vhost-user-fs-pci and x-ignore-shared -> "
                 + (f"error: {r['error']['desc']}" if "error" in r else str(r)))
    # vhost-user-vsock-pci: no backend daemon in Debian's QEMU 7.2.
    q.ok("cont")
    r = q.cmd("chardev-add", id="vsock", backend={"type": "socket", "data": {
        "addr": {"type": "unix", "data": {"path": f"{WORK}/nobody.sock"}}, "server": False}})
    notes.append("chardev-add (client) of a vhost-user-vsock socket nobody serves -> "
                 + (f"error: {r['error']['desc']}" if "error" in r else "ok"))
    q.ok("chardev-add", id="vsock2", backend={"type": "socket", "data": {
        "addr": {"type": "unix", "data": {"path": f"{WORK}/vsock-server.sock"}},
        "server": True, "wait": False}})
    r = q.cmd("device_add", driver="vhost-user-vsock-pci", id="hvsock", chardev="vsock2")
    notes.append("device_add vhost-user-vsock-pci on a chardev with no backend connected -> "
                 + (f"error: {r['error']['desc']}" if "error" in r else "ok"))
    stop_qemu(p)
    stop_qemu(fsd)

def blk_snapshot():
    """vhost-user-blk is migratable: snapshot a VM with a vhost-user-blk
    root disk (RAM file + x-ignore-shared), then restore it with a fresh
    qemu-storage-daemon, hot-plug virtio-rng and read the disk in the guest."""
    qsd, bsocks = start_qsd("blksnap")
    ram = f"{WORK}/blksnap.ram"
    dev = ["-chardev", f"socket,id=root,path={bsocks[0]}",
           "-device", "vhost-user-blk-pci,chardev=root,num-queues=1"]
    t0, p, ser, qp = start_qemu("blksnap", mem_args("file", ram), dev)
    q = Qmp(qp)
    ser.wait("MARK-BOOTED")
    time.sleep(2)
    q.ok("stop")
    q.ok("migrate-set-capabilities",
         capabilities=[{"capability": "x-ignore-shared", "state": True}])
    r = q.cmd("migrate", uri=f"exec:cat > {WORK}/blksnap.state")
    if "error" in r:
        notes.append(f"migrate with vhost-user-blk-pci (x-ignore-shared) -> error: {r['error']['desc']}")
        stop_qemu(p); stop_qemu(qsd)
        return
    while q.ok("query-migrate").get("status") not in ("completed", "failed"):
        time.sleep(0.005)
    notes.append(f"migrate with vhost-user-blk-pci (x-ignore-shared) -> {q.ok('query-migrate')['status']}")
    stop_qemu(p)
    stop_qemu(qsd)
    label = "C (B + vhost-user-blk root disk in the snapshot)"
    for i in range(RUNS):
        tag = f"blkr{i}"
        qsd, bsocks = start_qsd(tag)      # backend up before the clock
        per = f"{WORK}/{tag}.ram"
        subprocess.run(["cp", "--sparse=always", ram, per], check=True)
        dev = ["-chardev", f"socket,id=root,path={bsocks[0]}",
               "-device", "vhost-user-blk-pci,chardev=root,num-queues=1"]
        t0, p, ser, qp = start_qemu(tag, mem_args("file", per), dev + ["-incoming", "defer"])
        q = Qmp(qp)
        q.ok("migrate-set-capabilities",
             capabilities=[{"capability": "x-ignore-shared", "state": True}])
        mark = ser.mark()
        q.ok("migrate-incoming", uri=f"exec:cat {WORK}/blksnap.state")
        while q.ok("query-status")["status"] == "inmigrate":
            time.sleep(0.001)
        if q.ok("query-status")["status"] != "running":
            q.ok("cont")
        while q.ok("query-status")["status"] != "running":
            time.sleep(0.001)
        t1 = now()
        record(f"{label}: start -> running", ms(t0, t1))
        q.ok("device_add", driver="virtio-rng-pci", id="hrng")
        tv, line = ser.wait("MARK-VDA", start=mark, timeout=30)
        record(f"{label}: virtio-rng hot-plug -> guest read of the disk done", ms(t1, tv))
        if i == 0:
            notes.append(f"{label} console: "
                         + " | ".join(l for _, l in ser.lines[mark:] if l and "MARK" in l))
        stop_qemu(p)
        stop_qemu(qsd)
        os.unlink(per)

try:
    for mode in ("A", "B"):
        ram, state = snapshot(mode)
        for i in range(RUNS):
            restore(mode, ram, state, i)
        if mode == "B":
            for i in range(RUNS):
                restore(mode, ram, state, i, batch=True)
    refusals()
    blk_snapshot()
finally:
    kill_all()

print(f"{'step':<78} {'min ms':>8} {'median':>8} {'n':>3}")
for step, v in results.items():
    print(f"{step:<78} {min(v):8.0f} {statistics.median(v):8.0f} {len(v):3d}")
print()
for n in notes:
    print("# " + n)
EOF

# In the background, so that a signal reaches the trap at once; the driver's
# pid goes first into the list the cleanup kills.
python3 "$WORK/drive.py" "$WORK" "$QEMU" "$VIRTIOFSD" "$GUEST/vmlinuz" "$RUNS" "$MEM" "$CPUS" \
  "$QSD" "$GUEST/rootfs.img" "$EXTRA" &
echo $! >>"$WORK/pids"
wait $!
echo "# $(date -Is) $(uptime)"
