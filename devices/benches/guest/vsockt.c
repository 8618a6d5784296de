/*
 * vsockt: guest side of the vsock proof and benchmark (see
 * devices/examples/vsock-vhost-user.rs for the host side and the protocol).
 * Built with `gcc -O2 -static`; runs in the test initramfs.
 *
 *   vsockt ping PORT N            N x (connect to CID 2, "P", wait "p", close)
 *   vsockt g2h PORT BYTES VERIFY  send BYTES, host answers their hash
 *   vsockt h2g PORT BYTES VERIFY  host sends BYTES of the pattern
 *   vsockt back PORT LPORT BYTES  listen on LPORT, ask the host to dial it and
 *                                 send BYTES; echo them back
 *
 * Each prints one "RESULT ..." line; exit status 0 on success.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/vm_sockets.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define HOST_CID 2
#define CHUNK (64 * 1024)
#define FNV_OFFSET 0xcbf29ce484222325ULL
#define FNV_PRIME 0x00000100000001b3ULL

static uint8_t pattern(uint64_t i) { return (uint8_t)((i * 2654435761ULL) >> 13); }

static uint64_t fnv(uint64_t h, const uint8_t *p, size_t n) {
	for (size_t i = 0; i < n; i++) {
		h ^= p[i];
		h *= FNV_PRIME;
	}
	return h;
}

static double now(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void die(const char *what) {
	printf("RESULT FAIL %s: %s\n", what, strerror(errno));
	fflush(stdout);
	exit(1);
}

static int dial(unsigned port) {
	int fd = socket(AF_VSOCK, SOCK_STREAM, 0);
	if (fd < 0)
		die("socket");
	struct sockaddr_vm a = {.svm_family = AF_VSOCK, .svm_cid = HOST_CID, .svm_port = port};
	if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0)
		die("connect");
	return fd;
}

static void write_all(int fd, const void *p, size_t n) {
	const uint8_t *b = p;
	while (n) {
		ssize_t w = write(fd, b, n);
		if (w < 0) {
			if (errno == EINTR)
				continue;
			die("write");
		}
		b += w;
		n -= (size_t)w;
	}
}

static size_t read_line(int fd, char *buf, size_t cap) {
	size_t n = 0;
	while (n + 1 < cap) {
		ssize_t r = read(fd, buf + n, 1);
		if (r <= 0 || buf[n] == '\n')
			break;
		n++;
	}
	buf[n] = 0;
	return n;
}

static int ping(unsigned port, int n) {
	double t0 = now();
	for (int i = 0; i < n; i++) {
		int fd = dial(port);
		char c[2];
		write_all(fd, "P\n", 2);
		if (read(fd, c, 2) != 2 || c[0] != 'p')
			die("ping answer");
		close(fd);
	}
	double dt = now() - t0;
	printf("RESULT ping n=%d avg_us=%.0f\n", n, dt / n * 1e6);
	return 0;
}

static int g2h(unsigned port, uint64_t bytes, int verify) {
	static uint8_t buf[CHUNK];
	char line[128];
	uint64_t h = FNV_OFFSET;
	double t0 = now();
	int fd = dial(port);
	snprintf(line, sizeof line, "S %llu\n", (unsigned long long)bytes);
	write_all(fd, line, strlen(line));
	for (uint64_t sent = 0; sent < bytes;) {
		size_t k = bytes - sent < CHUNK ? (size_t)(bytes - sent) : CHUNK;
		if (verify) {
			for (size_t j = 0; j < k; j++)
				buf[j] = pattern(sent + j);
			h = fnv(h, buf, k);
		}
		write_all(fd, buf, k);
		sent += k;
	}
	read_line(fd, line, sizeof line);
	double dt = now() - t0;
	close(fd);
	char want[64];
	snprintf(want, sizeof want, "OK %016llx", (unsigned long long)h);
	int ok = strncmp(line, "OK ", 3) == 0 && (!verify || strcmp(line, want) == 0);
	printf("RESULT g2h bytes=%llu secs=%.3f MBps=%.1f check=%s\n", (unsigned long long)bytes, dt,
	       bytes / dt / 1e6, !ok ? "FAIL" : verify ? "ok" : "skipped");
	return ok ? 0 : 1;
}

static int h2g(unsigned port, uint64_t bytes, int verify) {
	static uint8_t buf[CHUNK];
	char line[128];
	uint64_t h = FNV_OFFSET, want = FNV_OFFSET, got = 0;
	double t0 = now();
	int fd = dial(port);
	snprintf(line, sizeof line, "R %llu\n", (unsigned long long)bytes);
	write_all(fd, line, strlen(line));
	for (;;) {
		ssize_t r = read(fd, buf, sizeof buf);
		if (r < 0) {
			if (errno == EINTR)
				continue;
			die("read");
		}
		if (r == 0)
			break;
		if (verify) {
			h = fnv(h, buf, (size_t)r);
			for (ssize_t j = 0; j < r; j++)
				buf[j] = pattern(got + (uint64_t)j);
			want = fnv(want, buf, (size_t)r);
		}
		got += (uint64_t)r;
	}
	double dt = now() - t0;
	close(fd);
	int ok = got == bytes && h == want;
	printf("RESULT h2g bytes=%llu secs=%.3f MBps=%.1f check=%s\n", (unsigned long long)got, dt,
	       got / dt / 1e6, !ok ? "FAIL" : verify ? "ok" : "skipped");
	return ok ? 0 : 1;
}

static void *echo_server(void *arg) {
	int lfd = (int)(intptr_t)arg;
	static uint8_t buf[CHUNK];
	int fd = accept(lfd, NULL, NULL);
	if (fd < 0)
		die("accept");
	for (;;) {
		ssize_t r = read(fd, buf, sizeof buf);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			break;
		write_all(fd, buf, (size_t)r);
	}
	shutdown(fd, SHUT_WR);
	close(fd);
	return NULL;
}

static int back(unsigned port, unsigned lport, uint64_t bytes) {
	int lfd = socket(AF_VSOCK, SOCK_STREAM, 0);
	if (lfd < 0)
		die("socket");
	struct sockaddr_vm a = {.svm_family = AF_VSOCK, .svm_cid = VMADDR_CID_ANY, .svm_port = lport};
	if (bind(lfd, (struct sockaddr *)&a, sizeof a) < 0 || listen(lfd, 4) < 0)
		die("bind/listen");
	pthread_t t;
	pthread_create(&t, NULL, echo_server, (void *)(intptr_t)lfd);
	char line[128];
	int fd = dial(port);
	snprintf(line, sizeof line, "C %u %llu\n", lport, (unsigned long long)bytes);
	write_all(fd, line, strlen(line));
	read_line(fd, line, sizeof line);
	close(fd);
	pthread_join(t, NULL);
	int ok = strncmp(line, "OK ", 3) == 0;
	printf("RESULT back bytes=%llu host_says=\"%s\" check=%s\n", (unsigned long long)bytes, line,
	       ok ? "ok" : "FAIL");
	return ok ? 0 : 1;
}

int main(int argc, char **argv) {
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc == 4 && !strcmp(argv[1], "ping"))
		return ping((unsigned)atoi(argv[2]), atoi(argv[3]));
	if (argc == 5 && !strcmp(argv[1], "g2h"))
		return g2h((unsigned)atoi(argv[2]), strtoull(argv[3], 0, 0), atoi(argv[4]));
	if (argc == 5 && !strcmp(argv[1], "h2g"))
		return h2g((unsigned)atoi(argv[2]), strtoull(argv[3], 0, 0), atoi(argv[4]));
	if (argc == 5 && !strcmp(argv[1], "back"))
		return back((unsigned)atoi(argv[2]), (unsigned)atoi(argv[3]), strtoull(argv[4], 0, 0));
	fprintf(stderr, "usage: vsockt ping PORT N | g2h PORT BYTES VERIFY | h2g PORT BYTES VERIFY | back PORT LPORT BYTES\n");
	return 2;
}
