/*
 * Guest side of devices/benches/bench-fs.sh: filesystem figures measured inside the guest,
 * printed as "RESULT <kind> key=value ..." lines on stdout.
 *
 *   fsbench write FILE MIB     sequential write of MIB MiB in 1 MiB writes (MiBps), then fsync
 *                              (fsync_MiBps: the same including the fsync, i.e. the host disk)
 *   fsbench read FILE          drop the page cache, then read FILE sequentially in 1 MiB reads
 *   fsbench meta DIR N         create (with 100 bytes of content), stat, unlink N files in DIR,
 *                              each phase timed on its own
 *
 * Times are CLOCK_MONOTONIC in the guest. Exit status 1 on any failed call (with a FAIL line).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Size of one read or write call. */
#define CHUNK (1 << 20)
/* Content written to each small file of the metadata test. */
#define SMALL_LEN 100

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int fail(const char *what, const char *path)
{
	printf("RESULT FAIL %s %s: %s\n", what, path, strerror(errno));
	fflush(stdout);
	return 1;
}

static void fill(char *buf, size_t len, unsigned seed)
{
	for (size_t i = 0; i < len; i++)
		buf[i] = (char)((i * 2654435761u + seed) >> 13);
}

static int do_write(const char *path, long mib)
{
	char *buf = malloc(CHUNK);
	if (!buf)
		return fail("malloc", path);
	fill(buf, CHUNK, 7);
	int fd = open(path, O_CREAT | O_TRUNC | O_WRONLY, 0644);
	if (fd < 0)
		return fail("open", path);
	double t0 = now();
	for (long i = 0; i < mib; i++) {
		size_t done = 0;
		while (done < CHUNK) {
			ssize_t n = write(fd, buf + done, CHUNK - done);
			if (n <= 0)
				return fail("write", path);
			done += (size_t)n;
		}
	}
	/* The writes reached the server (FUSE writes through); fsync adds the host disk. */
	double t1 = now();
	if (fsync(fd) != 0)
		return fail("fsync", path);
	if (close(fd) != 0)
		return fail("close", path);
	double t2 = now();
	printf("RESULT write MiBps=%.1f fsync_MiBps=%.1f mib=%ld secs=%.3f fsync_secs=%.3f\n",
	       (double)mib / (t1 - t0), (double)mib / (t2 - t0), mib, t1 - t0, t2 - t1);
	free(buf);
	return 0;
}

static void drop_caches(void)
{
	sync();
	int fd = open("/proc/sys/vm/drop_caches", O_WRONLY);
	if (fd >= 0) {
		if (write(fd, "3\n", 2) != 2)
			printf("NOTE drop_caches failed: %s\n", strerror(errno));
		close(fd);
	}
}

static int do_read(const char *path)
{
	char *buf = malloc(CHUNK);
	if (!buf)
		return fail("malloc", path);
	drop_caches();
	int fd = open(path, O_RDONLY);
	if (fd < 0)
		return fail("open", path);
	double t0 = now();
	long long total = 0;
	for (;;) {
		ssize_t n = read(fd, buf, CHUNK);
		if (n < 0)
			return fail("read", path);
		if (n == 0)
			break;
		total += n;
	}
	double dt = now() - t0;
	close(fd);
	double mib = (double)total / (1 << 20);
	printf("RESULT read MiBps=%.1f mib=%.0f secs=%.3f\n", mib / dt, mib, dt);
	free(buf);
	return 0;
}

static int do_meta(const char *dir, long n)
{
	char path[4096];
	char small[SMALL_LEN];
	struct stat st;
	fill(small, sizeof small, 3);
	double t0 = now();
	for (long i = 0; i < n; i++) {
		snprintf(path, sizeof path, "%s/f%06ld", dir, i);
		int fd = open(path, O_CREAT | O_EXCL | O_WRONLY, 0644);
		if (fd < 0)
			return fail("create", path);
		if (write(fd, small, sizeof small) != (ssize_t)sizeof small)
			return fail("write", path);
		if (close(fd) != 0)
			return fail("close", path);
	}
	double t1 = now();
	/* Attributes may be cached from the creation: drop them so stat asks the server. */
	drop_caches();
	double t2 = now();
	for (long i = 0; i < n; i++) {
		snprintf(path, sizeof path, "%s/f%06ld", dir, i);
		if (stat(path, &st) != 0)
			return fail("stat", path);
		if (st.st_size != SMALL_LEN) {
			errno = EIO;
			return fail("stat size", path);
		}
	}
	double t3 = now();
	for (long i = 0; i < n; i++) {
		snprintf(path, sizeof path, "%s/f%06ld", dir, i);
		if (unlink(path) != 0)
			return fail("unlink", path);
	}
	double t4 = now();
	double busy = (t1 - t0) + (t3 - t2) + (t4 - t3);
	printf("RESULT meta files=%ld create_ops=%.0f stat_ops=%.0f unlink_ops=%.0f all_ops=%.0f\n", n,
	       n / (t1 - t0), n / (t3 - t2), n / (t4 - t3), 3.0 * n / busy);
	return 0;
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc == 4 && strcmp(argv[1], "write") == 0)
		return do_write(argv[2], atol(argv[3]));
	if (argc == 3 && strcmp(argv[1], "read") == 0)
		return do_read(argv[2]);
	if (argc == 4 && strcmp(argv[1], "meta") == 0)
		return do_meta(argv[2], atol(argv[3]));
	fprintf(stderr, "usage: fsbench write FILE MIB | read FILE | meta DIR N\n");
	return 2;
}
