/*
 * virtio_driver.c - a tiny freestanding x86-64 guest that drives the
 * virtio-mmio test device (vmm::virtio::testdev::PatternDevice) the way a
 * real driver would, for the KVM test in vmm/tests/virtio_kvm.rs.
 *
 * Entered through the 64-bit Linux boot protocol (long mode, identity map of
 * the low 4 GiB, %rsi = boot_params, interrupts off). Steps:
 *   1. find the device from the last "virtio_mmio.device=<size>@<base>:<irq>"
 *      parameter the VMM puts on the command line (boot_params.cmd_line_ptr),
 *   2. probe it: MagicValue, Version, DeviceID, feature pages,
 *   3. check that acking a feature the device did not offer makes it refuse
 *      FEATURES_OK, then reset and negotiate VERSION_1 + the pattern feature,
 *   4. set up virtqueue 0 (8 entries) in its own memory, write the seed to
 *      config space, set DRIVER_OK,
 *   5. route the device's IOAPIC pin to vector 0x40 on this CPU's LAPIC (the
 *      8259 PICs are masked), post one 64-byte device-writable buffer, kick
 *      QueueNotify (the VMM serves that write with an ioeventfd), and HLT
 *      with interrupts on until the interrupt handler ran (the VMM raises it
 *      through an irqfd); the handler reads and acks InterruptStatus,
 *   6. check the used ring (id 0, length 64) and the buffer contents
 *      (byte i == seed + i),
 *   7. post a buffer outside guest RAM and kick: the device must answer with
 *      DEVICE_NEEDS_RESET and a configuration-change interrupt; reset it,
 * and reports one line on COM1:
 *   "virtio-guest: OK magic=... version=... device=... irq=... vector=...
 *    interrupts=... isr=... used_len=... refused_unknown=1 bad_isr=...
 *    bad_status=... reset_status=0x0"
 * or "virtio-guest: FAIL <what>", then resets the machine through the i8042.
 * The host test asserts the line. If no interrupt ever arrives the guest
 * stays halted and the host test's timeout stops the VM.
 *
 * Loop mode (command line starting with "loop", for the snapshot test in
 * vmm/tests/snapshot_kvm.rs): after step 6 it posts buffer after buffer
 * forever instead, each on the next ring slot, halting until its interrupt
 * brought the used index forward, checks each (slot, length, pattern) and
 * prints "virtio-loop n=<hex>" for it; a check that fails prints
 * "virtio-guest: FAIL ..." and resets.
 *
 * Build (done by the test): gcc -O2 -ffreestanding -fno-pic -mno-red-zone
 * -mgeneral-regs-only -fno-tree-loop-distribute-patterns -nostdlib -static
 * -T virtio_driver.ld (see build_guest in virtio_kvm.rs).
 */

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long u64;

/* virtio-mmio v2 registers (virtio 1.2, 4.2.2). */
#define MMIO_MAGIC 0x000
#define MMIO_VERSION 0x004
#define MMIO_DEVICE_ID 0x008
#define MMIO_DEVICE_FEATURES 0x010
#define MMIO_DEVICE_FEATURES_SEL 0x014
#define MMIO_DRIVER_FEATURES 0x020
#define MMIO_DRIVER_FEATURES_SEL 0x024
#define MMIO_QUEUE_SEL 0x030
#define MMIO_QUEUE_NUM_MAX 0x034
#define MMIO_QUEUE_NUM 0x038
#define MMIO_QUEUE_READY 0x044
#define MMIO_QUEUE_NOTIFY 0x050
#define MMIO_INTERRUPT_STATUS 0x060
#define MMIO_INTERRUPT_ACK 0x064
#define MMIO_STATUS 0x070
#define MMIO_QUEUE_DESC_LOW 0x080
#define MMIO_QUEUE_DESC_HIGH 0x084
#define MMIO_QUEUE_DRIVER_LOW 0x090
#define MMIO_QUEUE_DRIVER_HIGH 0x094
#define MMIO_QUEUE_DEVICE_LOW 0x0a0
#define MMIO_QUEUE_DEVICE_HIGH 0x0a4
#define MMIO_CONFIG 0x100

#define ST_ACK 1
#define ST_DRIVER 2
#define ST_DRIVER_OK 4
#define ST_FEATURES_OK 8
#define ST_NEEDS_RESET 0x40

#define TEST_DEVICE_ID 0xc0de
#define TEST_F_PATTERN 1u     /* feature bit 0, page 0 */
#define F_VERSION_1_PAGE1 1u  /* feature bit 32 = bit 0 of page 1 */
#define SEED 0x5a
#define QSIZE 8
#define BUFLEN 64
#define VECTOR 0x40

#define VRING_DESC_F_WRITE 2

#define LAPIC 0xfee00000ul
#define LAPIC_ID 0x20
#define LAPIC_EOI 0xb0
#define LAPIC_SVR 0xf0
#define LAPIC_TPR 0x80
#define IOAPIC 0xfec00000ul

struct desc {
	u64 addr;
	u32 len;
	u16 flags;
	u16 next;
};

struct avail {
	u16 flags;
	u16 idx;
	u16 ring[QSIZE];
	u16 used_event;
};

struct used_elem {
	u32 id;
	u32 len;
};

struct used {
	u16 flags;
	u16 idx;
	struct used_elem ring[QSIZE];
	u16 avail_event;
};

struct idt_gate {
	u16 off0;
	u16 sel;
	u8 ist;
	u8 type;
	u16 off1;
	u32 off2;
	u32 zero;
};

static struct desc descs[QSIZE] __attribute__((aligned(16)));
static struct avail avail __attribute__((aligned(2)));
static struct used used __attribute__((aligned(4)));
static u8 buffer[BUFLEN] __attribute__((aligned(64)));
static struct idt_gate idt[256] __attribute__((aligned(16)));
/* Referenced only from the entry code below. */
__attribute__((used, aligned(16))) u8 guest_stack[16384];

static u64 dev; /* MMIO base of the device */
static volatile u32 interrupts;
static volatile u32 isr_seen;

#define barrier() __asm__ volatile("" ::: "memory")
#define mb() __asm__ volatile("mfence" ::: "memory")

/* gcc may emit calls to these even in freestanding code. */
void *memset(void *d, int c, u64 n)
{
	void *r = d;
	__asm__ volatile("rep stosb" : "+D"(d), "+c"(n) : "a"(c) : "memory");
	return r;
}

void *memcpy(void *d, const void *s, u64 n)
{
	void *r = d;
	__asm__ volatile("rep movsb" : "+D"(d), "+S"(s), "+c"(n) : : "memory");
	return r;
}

static inline void outb(u16 port, u8 v)
{
	__asm__ volatile("outb %0, %1" : : "a"(v), "Nd"(port));
}

static inline u8 inb(u16 port)
{
	u8 v;
	__asm__ volatile("inb %1, %0" : "=a"(v) : "Nd"(port));
	return v;
}

static inline u32 rd(u64 addr)
{
	return *(volatile u32 *)addr;
}

static inline void wr(u64 addr, u32 v)
{
	*(volatile u32 *)addr = v;
}

static inline u32 vr(u32 off) { return rd(dev + off); }
static inline void vw(u32 off, u32 v) { wr(dev + off, v); }

static void putc(char c)
{
	/* Wait for THR empty (LSR bit 5), bounded. */
	for (int i = 0; i < 100000 && !(inb(0x3fd) & 0x20); i++)
		;
	outb(0x3f8, (u8)c);
}

static void puts(const char *s)
{
	while (*s)
		putc(*s++);
}

static void puthex(u64 v)
{
	char b[17];
	int n = 0;
	do {
		b[n++] = "0123456789abcdef"[v & 15];
		v >>= 4;
	} while (v && n < 16);
	puts("0x");
	while (n)
		putc(b[--n]);
}

static void field(const char *name, u64 v)
{
	putc(' ');
	puts(name);
	putc('=');
	puthex(v);
}

static void __attribute__((noreturn)) finish(void)
{
	/* i8042 "pulse reset line": the VMM ends the run with a reset. */
	outb(0x64, 0xfe);
	for (;;)
		__asm__ volatile("cli; hlt");
}

static void __attribute__((noreturn)) fail(const char *what, u64 v);

/* Loop mode: buffer n (from 1) goes in descriptor and ring slot n % QSIZE. */
static void __attribute__((noreturn)) run_loop(void)
{
	for (u32 n = 1;; n++) {
		u16 slot = (u16)(n % QSIZE);
		for (int i = 0; i < BUFLEN; i++)
			buffer[i] = 0xee;
		descs[slot].addr = (u64)buffer;
		descs[slot].len = BUFLEN;
		descs[slot].flags = VRING_DESC_F_WRITE;
		descs[slot].next = 0;
		avail.ring[slot] = slot;
		barrier();
		*(volatile u16 *)&avail.idx = (u16)(n + 1);
		mb();
		vw(MMIO_QUEUE_NOTIFY, 0);
		while (*(volatile u16 *)&used.idx != (u16)(n + 1))
			__asm__ volatile("sti; hlt; cli" ::: "memory");
		if (used.ring[slot].id != slot)
			fail("loop used id", used.ring[slot].id);
		if (used.ring[slot].len != BUFLEN)
			fail("loop used len", used.ring[slot].len);
		for (int i = 0; i < BUFLEN; i++)
			if (buffer[i] != (u8)(SEED + i))
				fail("loop pattern byte", ((u64)i << 8) | buffer[i]);
		puts("virtio-loop n=");
		puthex(n);
		putc('\n');
	}
}

static void __attribute__((noreturn)) fail(const char *what, u64 v)
{
	puts("virtio-guest: FAIL ");
	puts(what);
	field("value", v);
	if (dev)
		field("status", vr(MMIO_STATUS));
	putc('\n');
	finish();
}

/* --- command line: virtio_mmio.device=<size>@<base>:<irq> ----------------- */

static const char *find(const char *s, const char *pat)
{
	for (; *s; s++) {
		const char *a = s, *b = pat;
		while (*a && *b && *a == *b)
			a++, b++;
		if (!*b)
			return a;
	}
	return 0;
}

static int hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

static const char *parse_num(const char *s, u64 *out)
{
	u64 v = 0;
	int base = 10;
	if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
		base = 16;
		s += 2;
	}
	const char *start = s;
	for (int d; (d = hexval(*s)) >= 0 && d < base; s++)
		v = v * base + d;
	*out = v;
	return s == start ? 0 : s;
}

/* --- interrupts ------------------------------------------------------------ */

struct frame;

__attribute__((interrupt)) static void virtio_isr(struct frame *f)
{
	(void)f;
	u32 isr = vr(MMIO_INTERRUPT_STATUS);
	vw(MMIO_INTERRUPT_ACK, isr);
	isr_seen |= isr;
	interrupts++;
	wr(LAPIC + LAPIC_EOI, 0);
}

__attribute__((interrupt)) static void stray_isr(struct frame *f)
{
	(void)f;
	wr(LAPIC + LAPIC_EOI, 0);
	fail("unexpected interrupt", 0);
}

/* LAPIC spurious vector: no EOI. */
__attribute__((interrupt)) static void spurious_isr(struct frame *f)
{
	(void)f;
}

static void set_gate(int vec, void (*fn)(struct frame *))
{
	u64 a = (u64)fn;
	u16 cs;
	__asm__ volatile("mov %%cs, %0" : "=r"(cs));
	idt[vec].off0 = (u16)a;
	idt[vec].sel = cs;
	idt[vec].ist = 0;
	idt[vec].type = 0x8e; /* present, DPL 0, 64-bit interrupt gate */
	idt[vec].off1 = (u16)(a >> 16);
	idt[vec].off2 = (u32)(a >> 32);
	idt[vec].zero = 0;
}

static void ioapic_write(u32 reg, u32 v)
{
	wr(IOAPIC, reg);
	wr(IOAPIC + 0x10, v);
}

static void setup_interrupts(u32 pin)
{
	struct {
		u16 limit;
		u64 base;
	} __attribute__((packed)) idtr = { sizeof(idt) - 1, (u64)idt };

	for (int v = 32; v < 256; v++)
		set_gate(v, stray_isr);
	set_gate(VECTOR, virtio_isr);
	__asm__ volatile("lidt %0" : : "m"(idtr));

	/* Mask both 8259s: the device's GSI also reaches the PIC. */
	outb(0x21, 0xff);
	outb(0xa1, 0xff);

	/* LAPIC: software-enable, spurious vector 0xff, accept all priorities. */
	wr(LAPIC + LAPIC_TPR, 0);
	wr(LAPIC + LAPIC_SVR, 0x1ff);
	set_gate(0xff, spurious_isr);

	/* IOAPIC redirection entry: fixed delivery, physical destination =
	 * our APIC ID, active high, edge triggered, unmasked. */
	u32 apic_id = rd(LAPIC + LAPIC_ID) >> 24;
	ioapic_write(0x11 + 2 * pin, apic_id << 24);
	ioapic_write(0x10 + 2 * pin, VECTOR);
}

/* --- the driver ------------------------------------------------------------ */

static void negotiate(u32 page0, u32 page1)
{
	vw(MMIO_STATUS, 0);
	vw(MMIO_STATUS, ST_ACK);
	vw(MMIO_STATUS, ST_ACK | ST_DRIVER);
	vw(MMIO_DRIVER_FEATURES_SEL, 0);
	vw(MMIO_DRIVER_FEATURES, page0);
	vw(MMIO_DRIVER_FEATURES_SEL, 1);
	vw(MMIO_DRIVER_FEATURES, page1);
	vw(MMIO_STATUS, ST_ACK | ST_DRIVER | ST_FEATURES_OK);
}

void guest_main(u64 boot_params)
{
	puts("virtio-guest: start\n");

	/* boot_params.hdr.cmd_line_ptr is at offset 0x228. */
	const char *cmdline = (const char *)(u64)*(volatile u32 *)(boot_params + 0x228);
	if (!cmdline)
		fail("no command line", 0);
	/* The test device is the last virtio-mmio slot. */
	const char *p = 0;
	for (const char *q = cmdline; (q = find(q, "virtio_mmio.device="));)
		p = q;
	if (!p)
		fail("no virtio_mmio.device= on the command line", 0);
	u64 size, base, irq;
	p = parse_num(p, &size);
	if (!p)
		fail("bad virtio_mmio.device size", 0);
	while (*p && *p != '@')
		p++;
	if (*p != '@' || !(p = parse_num(p + 1, &base)) || *p != ':' ||
	    !parse_num(p + 1, &irq) || irq > 23)
		fail("bad virtio_mmio.device= syntax", 0);
	dev = base;

	u32 magic = vr(MMIO_MAGIC), version = vr(MMIO_VERSION), id = vr(MMIO_DEVICE_ID);
	if (magic != 0x74726976)
		fail("bad magic", magic);
	if (version != 2)
		fail("bad version", version);
	if (id != TEST_DEVICE_ID)
		fail("not the test device", id);

	vw(MMIO_DEVICE_FEATURES_SEL, 0);
	u32 f0 = vr(MMIO_DEVICE_FEATURES);
	vw(MMIO_DEVICE_FEATURES_SEL, 1);
	u32 f1 = vr(MMIO_DEVICE_FEATURES);
	if (!(f0 & TEST_F_PATTERN) || !(f1 & F_VERSION_1_PAGE1))
		fail("features not offered", ((u64)f1 << 32) | f0);

	/* An unoffered feature (bit 23) must make the device refuse. */
	negotiate(TEST_F_PATTERN | (1u << 23), F_VERSION_1_PAGE1);
	u32 refused = !(vr(MMIO_STATUS) & ST_FEATURES_OK);
	if (!refused)
		fail("FEATURES_OK accepted with an unoffered feature", vr(MMIO_STATUS));

	negotiate(TEST_F_PATTERN, F_VERSION_1_PAGE1);
	if (!(vr(MMIO_STATUS) & ST_FEATURES_OK))
		fail("FEATURES_OK refused", vr(MMIO_STATUS));

	vw(MMIO_QUEUE_SEL, 0);
	u32 max = vr(MMIO_QUEUE_NUM_MAX);
	if (max < QSIZE)
		fail("queue 0 too small", max);
	if (vr(MMIO_QUEUE_READY))
		fail("queue 0 ready before setup", 1);
	vw(MMIO_QUEUE_NUM, QSIZE);
	vw(MMIO_QUEUE_DESC_LOW, (u32)(u64)descs);
	vw(MMIO_QUEUE_DESC_HIGH, (u32)((u64)descs >> 32));
	vw(MMIO_QUEUE_DRIVER_LOW, (u32)(u64)&avail);
	vw(MMIO_QUEUE_DRIVER_HIGH, (u32)((u64)&avail >> 32));
	vw(MMIO_QUEUE_DEVICE_LOW, (u32)(u64)&used);
	vw(MMIO_QUEUE_DEVICE_HIGH, (u32)((u64)&used >> 32));
	vw(MMIO_QUEUE_READY, 1);
	if (vr(MMIO_QUEUE_READY) != 1)
		fail("queue 0 not ready", vr(MMIO_QUEUE_READY));

	vw(MMIO_CONFIG, SEED);
	if (vr(MMIO_CONFIG) != SEED)
		fail("config seed did not stick", vr(MMIO_CONFIG));

	setup_interrupts((u32)irq);

	vw(MMIO_STATUS, ST_ACK | ST_DRIVER | ST_FEATURES_OK | ST_DRIVER_OK);
	u32 st = vr(MMIO_STATUS);
	if (st & ST_NEEDS_RESET || !(st & ST_DRIVER_OK))
		fail("device did not accept DRIVER_OK", st);

	for (int i = 0; i < BUFLEN; i++)
		buffer[i] = 0xee;
	descs[0].addr = (u64)buffer;
	descs[0].len = BUFLEN;
	descs[0].flags = VRING_DESC_F_WRITE;
	descs[0].next = 0;
	avail.ring[0] = 0;
	barrier();
	*(volatile u16 *)&avail.idx = 1;
	mb();
	vw(MMIO_QUEUE_NOTIFY, 0);

	/* Wait for the interrupt: HLT with interrupts enabled returns after the
	 * handler ran. */
	while (!interrupts)
		__asm__ volatile("sti; hlt; cli" ::: "memory");

	if (*(volatile u16 *)&used.idx != 1)
		fail("used idx", *(volatile u16 *)&used.idx);
	if (used.ring[0].id != 0)
		fail("used id", used.ring[0].id);
	if (used.ring[0].len != BUFLEN)
		fail("used len", used.ring[0].len);
	for (int i = 0; i < BUFLEN; i++)
		if (buffer[i] != (u8)(SEED + i))
			fail("pattern byte", ((u64)i << 8) | buffer[i]);
	if (vr(MMIO_CONFIG + 4) != 1)
		fail("completed counter", vr(MMIO_CONFIG + 4));
	if (cmdline[0] == 'l' && cmdline[1] == 'o' && cmdline[2] == 'o' && cmdline[3] == 'p')
		run_loop();

	/* Phase 2: a buffer outside guest RAM (the VMM gives us 64 MiB) must
	 * make the device report DEVICE_NEEDS_RESET with a config interrupt,
	 * and a reset must bring it back. */
	u32 isr_before = isr_seen;
	isr_seen = 0;
	descs[1].addr = 0x80000000ul;
	descs[1].len = BUFLEN;
	descs[1].flags = VRING_DESC_F_WRITE;
	avail.ring[1] = 1;
	barrier();
	*(volatile u16 *)&avail.idx = 2;
	mb();
	vw(MMIO_QUEUE_NOTIFY, 0);
	while (interrupts < 2)
		__asm__ volatile("sti; hlt; cli" ::: "memory");
	u32 bad_isr = isr_seen;
	u32 bad_status = vr(MMIO_STATUS);
	if (!(bad_status & ST_NEEDS_RESET))
		fail("no NEEDS_RESET after a bad buffer", bad_status);
	if (*(volatile u16 *)&used.idx != 1)
		fail("bad buffer was used", *(volatile u16 *)&used.idx);
	vw(MMIO_STATUS, 0);
	u32 reset_status = vr(MMIO_STATUS);
	if (reset_status != 0)
		fail("status after reset", reset_status);

	puts("virtio-guest: OK");
	field("magic", magic);
	field("version", version);
	field("device", id);
	field("irq", irq);
	field("vector", VECTOR);
	field("interrupts", interrupts);
	field("isr", isr_before);
	field("used_len", used.ring[0].len);
	field("refused_unknown", refused);
	field("bad_isr", bad_isr);
	field("bad_status", bad_status);
	field("reset_status", reset_status);
	putc('\n');
	finish();
}

/* Entry: 64-bit mode, %rsi = boot_params. Clear .bss (keeping %rsi), switch
 * to our stack, call main. */
__asm__(".section .text.start, \"ax\"\n"
	".globl _start\n"
	"_start:\n"
	"  cli\n"
	"  mov %rsi, %r12\n"
	"  lea __bss_start(%rip), %rdi\n"
	"  lea __bss_end(%rip), %rcx\n"
	"  sub %rdi, %rcx\n"
	"  xor %eax, %eax\n"
	"  cld\n"
	"  rep stosb\n"
	"  lea guest_stack+16384(%rip), %rsp\n"
	"  mov %r12, %rdi\n"
	"  call guest_main\n"
	"1: cli\n"
	"  hlt\n"
	"  jmp 1b\n"
	".text\n");
