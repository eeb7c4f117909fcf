"""How much host memory a process may still take: what a Hessian, an arena or `--memory-budget auto` may use.

Linux's MemAvailable counts the page cache the kernel would give back (MemFree does not: on a machine
whose cache fills half the memory, MemFree refuses what fits). A cgroup's limit (a container's) is
where the OOM killer strikes, so its headroom counts too (its inactive file cache, which it would
give back first, not counted as used), whichever is smaller."""
import os

MEMORY_SHARE = 0.8   # of the memory available now, what one Hessian or an automatic budget may take

# (limit, usage, stats, the stat of the file cache the kernel reclaims before the OOM killer acts)
CGROUP_LIMITS = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat",
                  "inactive_file"),                                                                        # cgroup v2
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
                  "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file"))                             # v1
NO_LIMIT = 2 ** 60   # cgroup v1 writes "no limit" as a number near 2^63


def available_bytes():
    """Bytes this process can allocate now without swapping or meeting its cgroup's limit; None when the
    system does not say."""
    known = [b for b in (_mem_available(), *(_cgroup_headroom(*files) for files in CGROUP_LIMITS)) if b is not None]
    return min(known) if known else None


def _mem_available():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:   # not Linux, or a kernel before 3.14
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_headroom(limit_path, usage_path, stat_path, cache_key):
    """The cgroup's limit less its use, the cache it would give back not counted as use (as the kubelet's
    working set); None without a limit."""
    try:
        with open(limit_path) as f:
            limit = f.read().strip()
        if limit == "max" or int(limit) >= NO_LIMIT:
            return None
        with open(usage_path) as f:
            usage = int(f.read().strip())
    except (OSError, ValueError):
        return None
    cache = 0
    try:
        with open(stat_path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == cache_key:
                    cache = int(value)
    except (OSError, ValueError):
        pass
    return max(0, int(limit) - max(0, usage - cache))
