/* usbloop: exercises the usbwire loopback test device through usbfs, from
 * inside a test guest. Bulk IN 0x81 must return the source pattern (byte i of
 * each transfer == i % 63), bulk OUT 0x02 must take data, and what is written
 * to bulk OUT 0x03 must come back, in order, from bulk IN 0x83.
 * Usage: usbloop /dev/bus/usb/BBB/DDD. Exit status 0 only if every check passed. */
#include <errno.h>
#include <fcntl.h>
#include <linux/usbdevice_fs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

static int bulk(int fd, unsigned ep, void *data, unsigned len) {
    struct usbdevfs_bulktransfer t = {.ep = ep, .len = len, .timeout = 5000, .data = data};
    return ioctl(fd, USBDEVFS_BULK, &t);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: usbloop /dev/bus/usb/BBB/DDD\n");
        return 2;
    }
    int fd = open(argv[1], O_RDWR);
    if (fd < 0) {
        printf("FAIL open %s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    unsigned iface = 0;
    if (ioctl(fd, USBDEVFS_CLAIMINTERFACE, &iface) < 0) {
        printf("FAIL claim interface: %s\n", strerror(errno));
        return 1;
    }
    int failures = 0;
    static unsigned char buf[65536], back[65536];

    for (int round = 0; round < 4; round++) {
        int n = bulk(fd, 0x81, buf, sizeof buf);
        int ok = n == (int)sizeof buf;
        for (int i = 0; ok && i < n; i++) ok = buf[i] == i % 63;
        printf("%s source read %d bytes\n", ok ? "PASS" : "FAIL", n);
        failures += !ok;
    }
    memset(buf, 0x5a, sizeof buf);
    int n = bulk(fd, 0x02, buf, sizeof buf);
    printf("%s sink took %d bytes\n", n == (int)sizeof buf ? "PASS" : "FAIL", n);
    failures += n != (int)sizeof buf;

    srand(getpid());
    for (int round = 0; round < 4; round++) {
        unsigned len = 512 + (unsigned)(rand() % 16384);
        for (unsigned i = 0; i < len; i++) buf[i] = (unsigned char)rand();
        int w = bulk(fd, 0x03, buf, len);
        int r = bulk(fd, 0x83, back, sizeof back);
        int ok = w == (int)len && r == (int)len && memcmp(buf, back, len) == 0;
        printf("%s loop %u bytes (wrote %d, read %d)\n", ok ? "PASS" : "FAIL", len, w, r);
        failures += !ok;
    }
    close(fd);
    return failures ? 1 : 0;
}
