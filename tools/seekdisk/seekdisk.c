/*
 * seekdisk: an emulated disk with seeks, as a FUSE file system that serves one image file.
 *
 * Every read or write of the served file costs  size / bandwidth  seconds, plus a seek
 * time when it does not start where the previous request ended (a head that has to
 * move). Requests are served one at a time (single-threaded FUSE, -s): a queue of
 * requests waits, as it does on a single spindle. The file is opened with direct_io, so
 * the kernel's page cache of the FUSE file does not hide the cost: every read of the
 * loop device placed over the file reaches this program. What the data is comes from
 * the image file (on a tmpfs, so the host's own disk adds nothing).
 *
 * It models: a fixed transfer rate, a fixed positioning cost for a non-contiguous
 * request, one request in service at a time. It does not model: rotational latency
 * depending on distance, track-to-track vs full-stroke seeks, an on-disk cache or
 * read-ahead of its own, command queueing/reordering (NCQ), or write-back caching.
 *
 *   seekdisk [--bandwidth-mbs 100] [--seek-ms 4] IMAGE MOUNTPOINT [-f] [-o opt,...]
 *
 * The image appears as MOUNTPOINT/disk. Unmount with `fusermount3 -u MOUNTPOINT` (or
 * SIGTERM to this process, which unmounts). Counters (requests, seeks, bytes) are
 * printed on exit.
 */
#define FUSE_USE_VERSION 31
#include <errno.h>
#include <fcntl.h>
#include <fuse.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const char *FILE_NAME = "disk";
static int image_fd = -1;
static off_t image_size;
static double bandwidth = 100e6;   /* bytes per second */
static double seek_s = 0.004;
static off_t last_end = -1;        /* where the previous request ended */
static double busy_until;          /* monotonic seconds: the device is free from then */
static unsigned long long n_requests, n_seeks, n_bytes;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Charge one request's service time and sleep until the device has served it. */
static void serve(off_t offset, size_t size)
{
    double cost = (double)size / bandwidth;
    if (offset != last_end) {
        cost += seek_s;
        n_seeks++;
    }
    n_requests++;
    n_bytes += size;
    last_end = offset + (off_t)size;
    double t = now_s();
    if (busy_until < t)
        busy_until = t;
    busy_until += cost;
    double wait = busy_until - now_s();
    if (wait > 0) {
        struct timespec ts = {(time_t)wait, (long)((wait - (time_t)wait) * 1e9)};
        while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
            ;
    }
}

static int sd_getattr(const char *path, struct stat *st, struct fuse_file_info *fi)
{
    (void)fi;
    memset(st, 0, sizeof(*st));
    if (strcmp(path, "/") == 0) {
        st->st_mode = S_IFDIR | 0755;
        st->st_nlink = 2;
        return 0;
    }
    if (strcmp(path + 1, FILE_NAME) == 0) {
        st->st_mode = S_IFREG | 0644;
        st->st_nlink = 1;
        st->st_size = image_size;
        st->st_blksize = 4096;
        st->st_blocks = image_size / 512;
        return 0;
    }
    return -ENOENT;
}

static int sd_readdir(const char *path, void *buf, fuse_fill_dir_t fill, off_t off,
                      struct fuse_file_info *fi, enum fuse_readdir_flags flags)
{
    (void)off;
    (void)fi;
    (void)flags;
    if (strcmp(path, "/") != 0)
        return -ENOENT;
    fill(buf, ".", NULL, 0, 0);
    fill(buf, "..", NULL, 0, 0);
    fill(buf, FILE_NAME, NULL, 0, 0);
    return 0;
}

static int sd_open(const char *path, struct fuse_file_info *fi)
{
    if (strcmp(path + 1, FILE_NAME) != 0)
        return -ENOENT;
    fi->direct_io = 1;     /* no page cache of the FUSE file: every read comes here */
    fi->keep_cache = 0;
    return 0;
}

static int sd_read(const char *path, char *buf, size_t size, off_t off,
                   struct fuse_file_info *fi)
{
    (void)path;
    (void)fi;
    if (off >= image_size)
        return 0;
    if (off + (off_t)size > image_size)
        size = image_size - off;
    serve(off, size);
    ssize_t n = pread(image_fd, buf, size, off);
    return n < 0 ? -errno : (int)n;
}

static int sd_write(const char *path, const char *buf, size_t size, off_t off,
                    struct fuse_file_info *fi)
{
    (void)path;
    (void)fi;
    if (off >= image_size)
        return -ENOSPC;
    if (off + (off_t)size > image_size)
        size = image_size - off;
    serve(off, size);
    ssize_t n = pwrite(image_fd, buf, size, off);
    return n < 0 ? -errno : (int)n;
}

static int sd_fsync(const char *path, int datasync, struct fuse_file_info *fi)
{
    (void)path;
    (void)fi;
    return datasync ? fdatasync(image_fd) : fsync(image_fd);
}

static void sd_destroy(void *data)
{
    (void)data;
    fprintf(stderr, "seekdisk: %llu requests, %llu seeks, %llu bytes\n", n_requests,
            n_seeks, n_bytes);
}

static const struct fuse_operations ops = {
    .getattr = sd_getattr,
    .readdir = sd_readdir,
    .open = sd_open,
    .read = sd_read,
    .write = sd_write,
    .fsync = sd_fsync,
    .destroy = sd_destroy,
};

static void usage(void)
{
    fprintf(stderr, "usage: seekdisk [--bandwidth-mbs MB/s] [--seek-ms MS] IMAGE "
                    "MOUNTPOINT [FUSE options]\n");
}

int main(int argc, char *argv[])
{
    int i = 1;
    while (i + 1 < argc && strncmp(argv[i], "--", 2) == 0) {
        char *end;
        double v = strtod(argv[i + 1], &end);
        if (*end != '\0' || !(v >= 0)) {
            fprintf(stderr, "seekdisk: %s: not a number: %s\n", argv[i], argv[i + 1]);
            return 2;
        }
        if (strcmp(argv[i], "--bandwidth-mbs") == 0 && v > 0)
            bandwidth = v * 1e6;
        else if (strcmp(argv[i], "--seek-ms") == 0)
            seek_s = v / 1e3;
        else {
            usage();
            return 2;
        }
        i += 2;
    }
    if (argc - i < 2) {
        usage();
        return 2;
    }
    const char *image = argv[i];
    image_fd = open(image, O_RDWR);
    if (image_fd < 0) {
        fprintf(stderr, "seekdisk: %s: %s\n", image, strerror(errno));
        return 1;
    }
    struct stat st;
    if (fstat(image_fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        fprintf(stderr, "seekdisk: %s: not a regular file\n", image);
        return 1;
    }
    image_size = st.st_size;
    /* FUSE gets: the program name, the mount point, -s (one request at a time), and
       whatever options follow it. */
    int fargc = 0;
    char **fargv = calloc(argc + 2, sizeof(char *));
    fargv[fargc++] = argv[0];
    fargv[fargc++] = "-s";
    for (int k = i + 1; k < argc; k++)
        fargv[fargc++] = argv[k];
    int rc = fuse_main(fargc, fargv, &ops, NULL);
    close(image_fd);
    free(fargv);
    return rc;
}
