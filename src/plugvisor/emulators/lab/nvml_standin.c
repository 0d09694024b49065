/*
 * The plugvisor lab's NVML stand-in: a libnvidia-ml.so.1 that answers from the lab's state.
 *
 * Loaded exactly as the real library is (pynvml -> ctypes -> dlopen), it finds its lab from
 * its own path: dladdr() on one of its symbols, realpath(), then up the directories until one
 * holds .plugvisor-lab/nvml/system. No environment variable is needed, so a plugin reads a
 * lab GPU through the same code path as a real one.
 *
 * State: the lab writes (atomically, by rename) plain "key=value" files under
 * <lab>/.plugvisor-lab/nvml/: "system" (driver, NVML and CUDA versions, GPU count, event
 * period) and "gpu<index>" (one per NVIDIA GPU, in bus order). Every call stat()s the file
 * it needs and re-reads it when it changed (see load_gpu), so a fault injected by
 * `plugvisor lab fault` shows on the next call.
 *
 * Events: an active fault has an injection time; the GPU raises its event then and again
 * every period while the fault stays (a GPU that keeps failing until reset). An event set
 * remembers, per registered GPU, the time up to which it has delivered events, and
 * nvmlEventSetWait_v2 polls the GPU files until the next event is due or the timeout ends.
 * A lost GPU (fallen off the bus, unplugged) raises XID 79 once, at the time it was lost.
 *
 * Signatures, return codes and structure layouts are NVML's (as nvidia-ml-py declares them);
 * any function not here is absent, which pynvml reports as NVMLError_FunctionNotFound.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define EVENT_SBE 0x1ULL
#define EVENT_DBE 0x2ULL
#define EVENT_XID 0x8ULL
#define SUPPORTED_EVENTS (EVENT_SBE | EVENT_DBE | EVENT_XID)
#define XID_FALLEN_OFF_BUS 79
#define MAX_GPUS 4096
#define MAX_XIDS 16
#define MAX_REGISTRATIONS 64

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

#define NVML_MEMORY_V2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2 << 24)))

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

/* The opaque handle: a pointer to one of these, one per GPU index, for the library's life. */
typedef struct nvmlDevice_st {
    unsigned int index;
} *nvmlDevice_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

typedef struct {
    unsigned int index;
    unsigned long long mask;
    long long cursor; /* events due at or before this time (ns) were delivered or predate it */
} registration_t;

typedef struct nvmlEventSet_st {
    unsigned int magic;
    int count;
    registration_t regs[MAX_REGISTRATIONS];
} *nvmlEventSet_t;

#define EVENT_SET_MAGIC 0x6e766d6cU

typedef struct {
    unsigned int code;
    long long since;
} xid_t;

typedef struct {
    char name[96];
    char uuid[96];
    char serial[32];
    char vbios[32];
    char bus_id[32];
    unsigned int brand, arch, cc_major, cc_minor, minor;
    unsigned int domain, bus, device, pci_device_id, pci_subsystem_id;
    unsigned long long memory_total, memory_used, memory_reserved;
    unsigned int temperature, power_mw, power_limit_mw, util_gpu, util_memory;
    unsigned long long energy_mj;
    long long energy_at;
    unsigned int clock_graphics, clock_sm, clock_memory, clock_video;
    unsigned long long pcie_replay;
    unsigned long long ecc_volatile[2], ecc_aggregate[2]; /* [0] single-bit (corrected), [1] double-bit */
    long long ecc_since[2];
    long long lost_at;
    int nxid;
    xid_t xids[MAX_XIDS];
    unsigned int required; /* REQUIRED_* bits of the keys the file had */
} gpu_t;

/* Keys the lab always writes: a file without one of them is not the lab's (garbage, truncated),
   and every query of that GPU answers NVML_ERROR_UNKNOWN rather than zeros. */
#define REQUIRED_UUID 0x1u
#define REQUIRED_BUS_ID 0x2u
#define REQUIRED_MEMORY 0x4u
#define REQUIRED_NAME 0x8u
#define REQUIRED_ALL (REQUIRED_UUID | REQUIRED_BUS_ID | REQUIRED_MEMORY | REQUIRED_NAME)

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int refcount;
static char state_dir[PATH_MAX + 32];
static unsigned int gpu_count;
static long long period_ns = 1000000000LL;
static struct nvmlDevice_st handles[MAX_GPUS];

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Read a small file whole; return its length, or -1. */
static int slurp(const char *path, char *buf, size_t size) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    size_t len = 0;
    while (len + 1 < size) {
        ssize_t n = read(fd, buf + len, size - 1 - len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        len += (size_t)n;
    }
    close(fd);
    buf[len] = '\0';
    return (int)len;
}

static void copy_value(char *dst, size_t size, const char *value) {
    snprintf(dst, size, "%s", value);
}

static void parse_pair(const char *value, long long *a, long long *b) {
    char *end;
    *a = strtoll(value, &end, 10);
    *b = (*end == '@') ? strtoll(end + 1, NULL, 10) : 0;
}

/* Parse one "key=value" line into the GPU record (unknown keys are ignored). */
static void gpu_line(gpu_t *g, const char *key, const char *value) {
    unsigned long long u = strtoull(value, NULL, 0);
    long long a, b;
    if (!strcmp(key, "name")) { copy_value(g->name, sizeof g->name, value); g->required |= REQUIRED_NAME; }
    else if (!strcmp(key, "uuid")) { copy_value(g->uuid, sizeof g->uuid, value); g->required |= REQUIRED_UUID; }
    else if (!strcmp(key, "serial")) copy_value(g->serial, sizeof g->serial, value);
    else if (!strcmp(key, "vbios")) copy_value(g->vbios, sizeof g->vbios, value);
    else if (!strcmp(key, "bus_id")) { copy_value(g->bus_id, sizeof g->bus_id, value); g->required |= REQUIRED_BUS_ID; }
    else if (!strcmp(key, "brand")) g->brand = (unsigned int)u;
    else if (!strcmp(key, "architecture")) g->arch = (unsigned int)u;
    else if (!strcmp(key, "cc_major")) g->cc_major = (unsigned int)u;
    else if (!strcmp(key, "cc_minor")) g->cc_minor = (unsigned int)u;
    else if (!strcmp(key, "minor")) g->minor = (unsigned int)u;
    else if (!strcmp(key, "domain")) g->domain = (unsigned int)u;
    else if (!strcmp(key, "bus")) g->bus = (unsigned int)u;
    else if (!strcmp(key, "device")) g->device = (unsigned int)u;
    else if (!strcmp(key, "pci_device_id")) g->pci_device_id = (unsigned int)u;
    else if (!strcmp(key, "pci_subsystem_id")) g->pci_subsystem_id = (unsigned int)u;
    else if (!strcmp(key, "memory_total")) { g->memory_total = u; g->required |= REQUIRED_MEMORY; }
    else if (!strcmp(key, "memory_used")) g->memory_used = u;
    else if (!strcmp(key, "memory_reserved")) g->memory_reserved = u;
    else if (!strcmp(key, "temperature")) g->temperature = (unsigned int)u;
    else if (!strcmp(key, "power_mw")) g->power_mw = (unsigned int)u;
    else if (!strcmp(key, "power_limit_mw")) g->power_limit_mw = (unsigned int)u;
    else if (!strcmp(key, "energy_mj")) { parse_pair(value, &a, &b); g->energy_mj = (unsigned long long)a; g->energy_at = b; }
    else if (!strcmp(key, "util_gpu")) g->util_gpu = (unsigned int)u;
    else if (!strcmp(key, "util_memory")) g->util_memory = (unsigned int)u;
    else if (!strcmp(key, "clock_graphics")) g->clock_graphics = (unsigned int)u;
    else if (!strcmp(key, "clock_sm")) g->clock_sm = (unsigned int)u;
    else if (!strcmp(key, "clock_memory")) g->clock_memory = (unsigned int)u;
    else if (!strcmp(key, "clock_video")) g->clock_video = (unsigned int)u;
    else if (!strcmp(key, "pcie_replay")) g->pcie_replay = u;
    else if (!strcmp(key, "ecc_sbe_volatile")) g->ecc_volatile[0] = u;
    else if (!strcmp(key, "ecc_dbe_volatile")) g->ecc_volatile[1] = u;
    else if (!strcmp(key, "ecc_sbe_aggregate")) g->ecc_aggregate[0] = u;
    else if (!strcmp(key, "ecc_dbe_aggregate")) g->ecc_aggregate[1] = u;
    else if (!strcmp(key, "ecc_sbe_since")) g->ecc_since[0] = (long long)u;
    else if (!strcmp(key, "ecc_dbe_since")) g->ecc_since[1] = (long long)u;
    else if (!strcmp(key, "lost_at")) g->lost_at = (long long)u;
    else if (!strcmp(key, "xid") && g->nxid < MAX_XIDS) {
        parse_pair(value, &a, &b);
        if (a >= 1 && a <= 65535) {
            g->xids[g->nxid].code = (unsigned int)a;
            g->xids[g->nxid].since = b;
            g->nxid++;
        }
    }
}

typedef struct {
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime, ctime;
    gpu_t gpu;
} cached_t;

static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;
static cached_t *cache[MAX_GPUS];

/* Load GPU ``index``'s file; 0 on success.

   The lab replaces a file by renaming a new one over it, so an unchanged inode and mtime mean
   an unchanged file: one stat() then answers from the parsed copy, which keeps a scrape of
   many GPUs and metrics cheap while still seeing every change on the next call. */
static int load_gpu(unsigned int index, gpu_t *g) {
    char path[PATH_MAX + 64];
    char buf[8192];
    struct stat st;
    snprintf(path, sizeof path, "%s/gpu%u", state_dir, index);
    if (index >= MAX_GPUS || stat(path, &st) != 0) return -1;
    pthread_mutex_lock(&cache_lock);
    cached_t *c = cache[index];
    if (c && c->dev == st.st_dev && c->ino == st.st_ino && c->size == st.st_size &&
        c->mtime.tv_sec == st.st_mtim.tv_sec && c->mtime.tv_nsec == st.st_mtim.tv_nsec &&
        c->ctime.tv_sec == st.st_ctim.tv_sec && c->ctime.tv_nsec == st.st_ctim.tv_nsec) {
        *g = c->gpu;
        pthread_mutex_unlock(&cache_lock);
        return (g->required & REQUIRED_ALL) == REQUIRED_ALL ? 0 : -1;
    }
    pthread_mutex_unlock(&cache_lock);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    if (fstat(fd, &st) != 0) {
        close(fd);
        return -1;
    }
    size_t len = 0;
    while (len + 1 < sizeof buf) {
        ssize_t n = read(fd, buf + len, sizeof buf - 1 - len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        len += (size_t)n;
    }
    close(fd);
    buf[len] = '\0';
    memset(g, 0, sizeof *g);
    char *save = NULL;
    for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char *eq = strchr(line, '=');
        if (!eq) continue;
        *eq = '\0';
        gpu_line(g, line, eq + 1);
    }
    pthread_mutex_lock(&cache_lock);
    if (!cache[index]) cache[index] = calloc(1, sizeof(cached_t));
    if (cache[index]) {
        cache[index]->dev = st.st_dev;
        cache[index]->ino = st.st_ino;
        cache[index]->size = st.st_size;
        cache[index]->mtime = st.st_mtim;
        cache[index]->ctime = st.st_ctim;
        cache[index]->gpu = *g;
    }
    pthread_mutex_unlock(&cache_lock);
    return (g->required & REQUIRED_ALL) == REQUIRED_ALL ? 0 : -1;
}

/* Read one value of the system file into ``out``; 0 when found. */
static int system_value(const char *key, char *out, size_t size) {
    char path[PATH_MAX + 32];
    char buf[4096];
    snprintf(path, sizeof path, "%s/system", state_dir);
    if (slurp(path, buf, sizeof buf) < 0) return -1;
    size_t klen = strlen(key);
    char *save = NULL;
    for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        if (!strncmp(line, key, klen) && line[klen] == '=') {
            snprintf(out, size, "%s", line + klen + 1);
            return 0;
        }
    }
    return -1;
}

/* Find the lab: up from this library's real path to the directory holding the NVML state. */
static int find_lab(void) {
    Dl_info info;
    char real[PATH_MAX];
    if (!dladdr((void *)&find_lab, &info) || !info.dli_fname) return -1;
    if (!realpath(info.dli_fname, real)) return -1;
    char *slash;
    while ((slash = strrchr(real, '/')) != NULL) {
        *slash = '\0';
        char probe[PATH_MAX + 64];
        snprintf(probe, sizeof probe, "%s/.plugvisor-lab/nvml/system", real[0] ? real : "");
        if (access(probe, R_OK) == 0) {
            snprintf(state_dir, sizeof state_dir, "%s/.plugvisor-lab/nvml", real);
            return 0;
        }
        if (!real[0]) break;
    }
    return -1;
}

static nvmlReturn_t start(void) {
    char value[64];
    pthread_mutex_lock(&lock);
    if (refcount == 0) {
        if (find_lab() != 0 || system_value("count", value, sizeof value) != 0) {
            pthread_mutex_unlock(&lock);
            return NVML_ERROR_DRIVER_NOT_LOADED;
        }
        unsigned long count = strtoul(value, NULL, 10);
        gpu_count = count > MAX_GPUS ? MAX_GPUS : (unsigned int)count;
        if (system_value("event_period_ms", value, sizeof value) == 0 && strtoll(value, NULL, 10) > 0)
            period_ns = strtoll(value, NULL, 10) * 1000000LL;
        for (unsigned int i = 0; i < MAX_GPUS; i++) handles[i].index = i;
    }
    refcount++;
    pthread_mutex_unlock(&lock);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlInit_v2(void) { return start(); }
API nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return start(); }

API nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    if (refcount == 0) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    refcount--;
    pthread_mutex_unlock(&lock);
    return NVML_SUCCESS;
}

API const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt Request Issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 20: return "Insufficient Memory";
    case 25: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

static int initialized(void) {
    pthread_mutex_lock(&lock);
    int on = refcount > 0;
    pthread_mutex_unlock(&lock);
    return on;
}

static nvmlReturn_t put_string(char *dst, unsigned int length, const char *value) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(value) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, value, strlen(value) + 1);
    return NVML_SUCCESS;
}

static nvmlReturn_t system_string(const char *key, char *out, unsigned int length) {
    char value[128];
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (system_value(key, value, sizeof value) != 0) return NVML_ERROR_UNKNOWN;
    return put_string(out, length, value);
}

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    return system_string("driver_version", version, length);
}

API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    return system_string("nvml_version", version, length);
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion) {
    char value[32];
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!cudaDriverVersion) return NVML_ERROR_INVALID_ARGUMENT;
    if (system_value("cuda_driver_version", value, sizeof value) != 0) return NVML_ERROR_UNKNOWN;
    *cudaDriverVersion = (int)strtol(value, NULL, 10);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion) {
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!deviceCount) return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = gpu_count;
    return NVML_SUCCESS;
}

/* Resolve a handle to its GPU's current record: the checks every device query starts with. */
static nvmlReturn_t lookup(nvmlDevice_t device, gpu_t *g) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (device < &handles[0] || device >= &handles[gpu_count] ||
        ((char *)device - (char *)&handles[0]) % sizeof handles[0])
        return NVML_ERROR_INVALID_ARGUMENT;
    if (load_gpu(device->index, g) != 0) return NVML_ERROR_UNKNOWN;
    if (g->lost_at) return NVML_ERROR_GPU_IS_LOST;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    gpu_t g;
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (index >= gpu_count || !device) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t ret = lookup(&handles[index], &g);
    if (ret == NVML_SUCCESS) *device = &handles[index];
    return ret;
}

/* Parse "[domain:]bus:device.function" (hex); 0 on success. */
static int parse_bus_id(const char *text, unsigned int *domain, unsigned int *bus, unsigned int *dev, unsigned int *fn) {
    unsigned int a, b, c, d;
    char tail;
    if (sscanf(text, "%x:%x:%x.%x%c", &a, &b, &c, &d, &tail) == 4) {
        *domain = a, *bus = b, *dev = c, *fn = d;
        return 0;
    }
    if (sscanf(text, "%x:%x.%x%c", &b, &c, &d, &tail) == 3) {
        *domain = 0, *bus = b, *dev = c, *fn = d;
        return 0;
    }
    return -1;
}

API nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device) {
    unsigned int domain, bus, dev, fn;
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!pciBusId || !device || parse_bus_id(pciBusId, &domain, &bus, &dev, &fn) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < gpu_count; i++) {
        gpu_t g;
        if (load_gpu(i, &g) != 0) continue;
        if (g.domain == domain && g.bus == bus && g.device == dev && fn == 0) {
            if (g.lost_at) return NVML_ERROR_GPU_IS_LOST;
            *device = &handles[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < gpu_count; i++) {
        gpu_t g;
        if (load_gpu(i, &g) != 0 || strcmp(g.uuid, uuid) != 0) continue;
        if (g.lost_at) return NVML_ERROR_GPU_IS_LOST;
        *device = &handles[i];
        return NVML_SUCCESS;
    }
    return NVML_ERROR_NOT_FOUND;
}

#define DEVICE_QUERY(out)                                    \
    gpu_t g;                                                 \
    nvmlReturn_t ret = lookup(device, &g);                   \
    if (ret != NVML_SUCCESS) return ret;                     \
    if (!(out)) return NVML_ERROR_INVALID_ARGUMENT

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    DEVICE_QUERY(name);
    return put_string(name, length, g.name);
}

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    DEVICE_QUERY(uuid);
    return put_string(uuid, length, g.uuid);
}

API nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length) {
    DEVICE_QUERY(serial);
    return put_string(serial, length, g.serial);
}

API nvmlReturn_t nvmlDeviceGetVbiosVersion(nvmlDevice_t device, char *version, unsigned int length) {
    DEVICE_QUERY(version);
    return put_string(version, length, g.vbios);
}

API nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, unsigned int *type) {
    DEVICE_QUERY(type);
    *type = g.brand;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, unsigned int *arch) {
    DEVICE_QUERY(arch);
    *arch = g.arch;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    DEVICE_QUERY(major && minor);
    *major = (int)g.cc_major;
    *minor = (int)g.cc_minor;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber) {
    DEVICE_QUERY(minorNumber);
    *minorNumber = g.minor;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    DEVICE_QUERY(pci);
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04x:%02x:%02x.0", g.domain, g.bus, g.device);
    snprintf(pci->busId, sizeof pci->busId, "%s", g.bus_id);
    pci->domain = g.domain;
    pci->bus = g.bus;
    pci->device = g.device;
    pci->pciDeviceId = g.pci_device_id;
    pci->pciSubSystemId = g.pci_subsystem_id;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    DEVICE_QUERY(memory);
    memory->total = g.memory_total;
    memory->used = g.memory_used;
    memory->free = g.memory_total - g.memory_used;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    DEVICE_QUERY(memory);
    if (memory->version != NVML_MEMORY_V2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    unsigned long long reserved = g.memory_reserved < g.memory_used ? g.memory_reserved : g.memory_used;
    memory->total = g.memory_total;
    memory->reserved = reserved;
    memory->used = g.memory_used - reserved;
    memory->free = g.memory_total - g.memory_used;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode) {
    DEVICE_QUERY(currentMode && pendingMode);
    *currentMode = 0;
    *pendingMode = 0;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensorType, unsigned int *temp) {
    DEVICE_QUERY(temp);
    if (sensorType != 0) return NVML_ERROR_INVALID_ARGUMENT;
    *temp = g.temperature;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    DEVICE_QUERY(power);
    *power = g.power_mw;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned int *limit) {
    DEVICE_QUERY(limit);
    *limit = g.power_limit_mw;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device, unsigned long long *energy) {
    DEVICE_QUERY(energy);
    long long elapsed = now_ns() - g.energy_at;
    if (elapsed < 0 || !g.energy_at) elapsed = 0;
    /* mW times seconds is mJ: the counter the lab froze at its last change, plus what the
       present draw has added since. */
    *energy = g.energy_mj + (unsigned long long)((double)g.power_mw * (double)elapsed / 1e9);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    DEVICE_QUERY(utilization);
    utilization->gpu = g.util_gpu;
    utilization->memory = g.util_memory;
    return NVML_SUCCESS;
}

/* Occurrences of a fault raised at ``since`` and every period after, up to ``now``. */
static unsigned long long ticks(long long since, long long now) {
    if (!since || now < since) return 0;
    return (unsigned long long)((now - since) / period_ns) + 1;
}

API nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int errorType, int counterType, unsigned long long *eccCounts) {
    DEVICE_QUERY(eccCounts);
    if (errorType < 0 || errorType > 1 || counterType < 0 || counterType > 1) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long base = counterType == 0 ? g.ecc_volatile[errorType] : g.ecc_aggregate[errorType];
    *eccCounts = base + ticks(g.ecc_since[errorType], now_ns());
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t device, unsigned int *value) {
    DEVICE_QUERY(value);
    *value = (unsigned int)g.pcie_replay;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type, unsigned int *clock) {
    DEVICE_QUERY(clock);
    switch (type) {
    case 0: *clock = g.clock_graphics; break;
    case 1: *clock = g.clock_sm; break;
    case 2: *clock = g.clock_memory; break;
    case 3: *clock = g.clock_video; break;
    default: return NVML_ERROR_INVALID_ARGUMENT;
    }
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    DEVICE_QUERY(eventTypes);
    *eventTypes = SUPPORTED_EVENTS;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlEventSet_t s = calloc(1, sizeof *s);
    if (!s) return NVML_ERROR_MEMORY;
    s->magic = EVENT_SET_MAGIC;
    *set = s;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set) {
    DEVICE_QUERY(set);
    if (set->magic != EVENT_SET_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    if (eventTypes & ~SUPPORTED_EVENTS) return NVML_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < set->count; i++) {
        if (set->regs[i].index == device->index) {
            set->regs[i].mask |= eventTypes;
            pthread_mutex_unlock(&lock);
            return NVML_SUCCESS;
        }
    }
    if (set->count == MAX_REGISTRATIONS) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_MEMORY;
    }
    set->regs[set->count].index = device->index;
    set->regs[set->count].mask = eventTypes;
    set->regs[set->count].cursor = now_ns();
    set->count++;
    pthread_mutex_unlock(&lock);
    return NVML_SUCCESS;
}

/* The first time after ``cursor`` at which a fault raised at ``since`` (every period) is due. */
static long long next_due(long long since, long long cursor) {
    if (!since) return 0;
    if (since > cursor) return since;
    return since + ((cursor - since) / period_ns + 1) * period_ns;
}

typedef struct {
    long long due;
    int reg;
    unsigned long long type, data;
} pending_t;

/* The earliest event due after each registration's cursor, over the whole set (due 0: none). */
static pending_t earliest(nvmlEventSet_t set) {
    pending_t best = {0, -1, 0, 0};
    for (int r = 0; r < set->count; r++) {
        registration_t *reg = &set->regs[r];
        gpu_t g;
        if (load_gpu(reg->index, &g) != 0) continue;
#define CONSIDER(when, kind, value)                                                  \
    do {                                                                             \
        long long due_ = (when);                                                     \
        if (due_ && (reg->mask & (kind)) && (!best.due || due_ < best.due)) {        \
            best.due = due_, best.reg = r, best.type = (kind), best.data = (value);  \
        }                                                                            \
    } while (0)
        if (g.lost_at) {
            /* A lost GPU says so once, then nothing more. */
            if (g.lost_at > reg->cursor) CONSIDER(g.lost_at, EVENT_XID, XID_FALLEN_OFF_BUS);
            continue;
        }
        for (int x = 0; x < g.nxid; x++) CONSIDER(next_due(g.xids[x].since, reg->cursor), EVENT_XID, g.xids[x].code);
        CONSIDER(next_due(g.ecc_since[0], reg->cursor), EVENT_SBE, 0);
        CONSIDER(next_due(g.ecc_since[1], reg->cursor), EVENT_DBE, 0);
#undef CONSIDER
    }
    return best;
}

API nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!set || set->magic != EVENT_SET_MAGIC || !data) return NVML_ERROR_INVALID_ARGUMENT;
    long long deadline = now_ns() + (long long)timeoutms * 1000000LL;
    for (;;) {
        pthread_mutex_lock(&lock);
        pending_t next = earliest(set);
        long long now = now_ns();
        if (next.due && next.due <= now) {
            set->regs[next.reg].cursor = next.due;
            data->device = &handles[set->regs[next.reg].index];
            data->eventType = next.type;
            data->eventData = next.data;
            data->gpuInstanceId = 0xFFFFFFFFU;
            data->computeInstanceId = 0xFFFFFFFFU;
            pthread_mutex_unlock(&lock);
            return NVML_SUCCESS;
        }
        pthread_mutex_unlock(&lock);
        if (now >= deadline) return NVML_ERROR_TIMEOUT;
        /* Poll: the lab's CLI changes the files from another process, so a fault injected
           now must be seen soon; 20 ms keeps that prompt and the loop cheap. */
        long long sleep_ns = deadline - now;
        if (next.due && next.due - now < sleep_ns) sleep_ns = next.due - now;
        if (sleep_ns > 20000000LL) sleep_ns = 20000000LL;
        struct timespec ts = {sleep_ns / 1000000000LL, sleep_ns % 1000000000LL};
        nanosleep(&ts, NULL);
    }
}

API nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!set || set->magic != EVENT_SET_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    set->magic = 0;
    free(set);
    return NVML_SUCCESS;
}
