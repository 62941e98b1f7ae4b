/* A stand-in for libnvidia-ml.so.1 with three cards, for tests/governor/test_startup.py: the
   governor's ctypes probe (hintfs/governor/cardmemory.py) runs against it on a host without a GPU.
   Card 0: 80 GiB; card 1: 40 GiB (UUID GPU-fake-1); card 2: in MIG mode. */
#include <string.h>

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { int index; unsigned long long total; int mig; const char *name; const char *uuid; } card_t;

static card_t cards[3] = {
    {0, 80ULL << 30, 0, "Fake H100", "GPU-fake-0"},
    {1, 40ULL << 30, 0, "Fake A100", "GPU-fake-1"},
    {2, 80ULL << 30, 1, "Fake MIG", "GPU-fake-2"},
};
static int initialized = 0;

int nvmlInit_v2(void) { initialized++; return 0; }
int nvmlShutdown(void) { initialized--; return 0; }
const char *nvmlErrorString(int r) { return r == 2 ? "Invalid Argument" : r == 1 ? "Uninitialized" : "Unknown Error"; }

int nvmlDeviceGetHandleByIndex_v2(unsigned int i, card_t **out) {
    if (!initialized) return 1;
    if (i >= 3) return 2;
    *out = &cards[i];
    return 0;
}

int nvmlDeviceGetHandleByUUID(const char *uuid, card_t **out) {
    for (int i = 0; i < 3; i++)
        if (strcmp(uuid, cards[i].uuid) == 0) { *out = &cards[i]; return 0; }
    return 2;
}

int nvmlDeviceGetMigMode(card_t *c, unsigned int *current, unsigned int *pending) {
    if (!c->mig) return 3;                 /* NVML_ERROR_NOT_SUPPORTED, as on a card without MIG */
    *current = *pending = 1;
    return 0;
}

int nvmlDeviceGetMemoryInfo(card_t *c, nvmlMemory_t *m) {
    m->total = c->total; m->used = 1 << 20; m->free = c->total - m->used;
    return 0;
}

int nvmlDeviceGetName(card_t *c, char *name, unsigned int len) {
    strncpy(name, c->name, len - 1);
    name[len - 1] = 0;
    return 0;
}
