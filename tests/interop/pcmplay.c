/* pcmplay: plays SECONDS of a 48 kHz stereo S16_LE tone on an ALSA playback
 * device with raw ioctls (the test guests have no alsa-utils), then drains.
 * Prints the frames written. Exit 0 when every frame was taken.
 *
 *   pcmplay /dev/snd/pcmC0D0p SECONDS
 */
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>
#include <sound/asound.h>

#define RATE 48000
#define CHANNELS 2

static void mask_only(struct snd_pcm_hw_params *p, int param, unsigned int bit) {
    struct snd_mask *m = &p->masks[param - SNDRV_PCM_HW_PARAM_FIRST_MASK];
    memset(m, 0, sizeof *m);
    m->bits[bit / 32] = 1u << (bit % 32);
}

static void interval_exactly(struct snd_pcm_hw_params *p, int param, unsigned int value) {
    struct snd_interval *i = &p->intervals[param - SNDRV_PCM_HW_PARAM_FIRST_INTERVAL];
    i->min = i->max = value;
    i->openmin = i->openmax = 0;
    i->integer = 1;
    i->empty = 0;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: pcmplay DEVICE SECONDS\n");
        return 2;
    }
    int fd = open(argv[1], O_RDWR);
    if (fd < 0) {
        perror(argv[1]);
        return 1;
    }
    struct snd_pcm_hw_params params;
    memset(&params, 0, sizeof params);
    for (int m = 0; m <= SNDRV_PCM_HW_PARAM_LAST_MASK - SNDRV_PCM_HW_PARAM_FIRST_MASK; m++)
        memset(&params.masks[m], 0xff, sizeof params.masks[m]);
    for (int i = 0; i <= SNDRV_PCM_HW_PARAM_LAST_INTERVAL - SNDRV_PCM_HW_PARAM_FIRST_INTERVAL; i++)
        params.intervals[i].max = ~0u;
    params.rmask = ~0u;
    mask_only(&params, SNDRV_PCM_HW_PARAM_ACCESS, SNDRV_PCM_ACCESS_RW_INTERLEAVED);
    mask_only(&params, SNDRV_PCM_HW_PARAM_FORMAT, SNDRV_PCM_FORMAT_S16_LE);
    mask_only(&params, SNDRV_PCM_HW_PARAM_SUBFORMAT, SNDRV_PCM_SUBFORMAT_STD);
    interval_exactly(&params, SNDRV_PCM_HW_PARAM_CHANNELS, CHANNELS);
    interval_exactly(&params, SNDRV_PCM_HW_PARAM_RATE, RATE);
    if (ioctl(fd, SNDRV_PCM_IOCTL_HW_PARAMS, &params) < 0) {
        perror("HW_PARAMS");
        return 1;
    }
    if (ioctl(fd, SNDRV_PCM_IOCTL_PREPARE) < 0) {
        perror("PREPARE");
        return 1;
    }
    long total = RATE * atol(argv[2]), written = 0;
    static short buf[RATE / 10 * CHANNELS];
    while (written < total) {
        long frames = RATE / 10;
        for (long f = 0; f < frames; f++) {
            short v = (short)(8000 * sin(2 * M_PI * 440 * (double)(written + f) / RATE));
            buf[2 * f] = buf[2 * f + 1] = v;
        }
        struct snd_xferi x = {.result = 0, .buf = buf, .frames = frames};
        if (ioctl(fd, SNDRV_PCM_IOCTL_WRITEI_FRAMES, &x) < 0) {
            perror("WRITEI_FRAMES");
            break;
        }
        written += x.result;
    }
    if (ioctl(fd, SNDRV_PCM_IOCTL_DRAIN) < 0)
        perror("DRAIN");
    printf("%ld frames\n", written);
    close(fd);
    return written >= total ? 0 : 1;
}
