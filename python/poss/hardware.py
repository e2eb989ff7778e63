"""What this machine is good at: the CPU's SIMD and bf16 support, the dtype to run in, the memory
bandwidth a decode step is bound by, and a one-line header for every benchmark.

Machines differ: some CPUs have AMX / AVX512-BF16 (bf16 GEMMs several times faster than fp32),
others only AVX2 + FMA. There torch's bf16 GEMMs convert in software and are slower than fp32, but
``poss.linear``'s AVX2 bf16 kernel widens the weights as they stream, so a decode step reads half
fp32's bytes: on a 2-core AVX2 EPYC our AR loop ran 1.6x faster in bf16 than in fp32
(``docs/benchmarks.md``). ``dtype="auto"`` picks bf16 wherever one of those kernels runs it.
"""

import functools
import math
import os
import platform
import time
from pathlib import Path
from typing import Dict, FrozenSet, Optional, Union

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> FrozenSet[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_class(flags: FrozenSet[str] = None) -> str:
    """The CPU's class for costs measured in advance: ``avx512-bf16`` (AVX512-BF16 or AMX), ``avx512``,
    ``avx2`` (with FMA) or ``other``."""
    flags = cpu_flags() if flags is None else flags
    if cpu_has_fast_bf16(flags):
        return "avx512-bf16"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "other"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; all of them where the OS does not say)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> Optional[float]:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def own_load() -> float:
    """About how much of the 1-minute load average is this process's own threads: its CPU seconds over
    its age, the age counted as at least a minute (the average's time constant). 0 where the OS does
    not say (no /proc)."""
    try:
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (ImportError, OSError, ValueError, IndexError):
        return 0.0
    return (usage.ru_utime + usage.ru_stime) / max(age, 60.0)


def others_busy_now(window_s: float = 0.2) -> Optional[float]:
    """Cores that other processes kept busy over the next ``window_s`` seconds: the busy share of all
    CPUs in ``/proc/stat`` less this process's own CPU time, times the CPU count. None without /proc."""
    def sample():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0), int(own[11]) + int(own[12])

    try:
        total0, idle0, own0 = sample()
        time.sleep(window_s)
        total1, idle1, own1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    if total <= 0:
        return None
    busy = (total - (idle1 - idle0)) - (own1 - own0)
    return max(0.0, busy / total * (os.cpu_count() or 1))


def others_load() -> float:
    """Cores other work keeps busy: the smaller of the 1-minute load average less this process's own
    share and what ``/proc/stat`` shows over the next 0.2 s. The average lags: a job that ended seconds
    ago (the previous `poss generate`) still counts in it for a minute, and then 1 thread ran where 2
    were free. 0 where the OS says neither."""
    load = load_average()
    average = None if load is None else max(0.0, load - own_load())
    now = others_busy_now()
    known = [x for x in (average, now) if x is not None]
    return min(known) if known else 0.0


def default_threads() -> int:
    """The CPU threads to decode with: the usable cores that other work leaves free, at least 1.

    More threads than free cores thrash: on a 2-core machine with another job on one core, SmolLM2
    with its draft ran 2.3 tokens/s on 2 threads and 33.6 on 1 (bf16, AVX2)."""
    cores = usable_cores()
    return max(1, min(cores, math.floor(cores - others_load() + 0.5)))


def cpu_has_fast_bf16(flags: FrozenSet[str] = None) -> bool:
    """AMX-BF16 or AVX512-BF16: bf16 GEMMs run in hardware (oneDNN uses them)."""
    flags = cpu_flags() if flags is None else flags
    return bool({"amx_bf16", "avx512_bf16"} & flags)


def cpu_runs_bf16_fast(flags: FrozenSet[str] = None) -> bool:
    """Hardware bf16, or AVX2 + FMA (``poss.linear``'s kernel that widens bf16 weights as they stream)."""
    flags = cpu_flags() if flags is None else flags
    return cpu_has_fast_bf16(flags) or {"avx2", "fma"} <= flags


def resolve_dtype(dtype: Union[str, torch.dtype], device: Union[str, torch.device] = "cpu",
                  training: bool = False) -> torch.dtype:
    """``"auto"``: bf16 on CUDA and where :func:`cpu_runs_bf16_fast`, else fp32; names and torch dtypes
    pass through. ``training=True``: bf16 on the CPU only with hardware bf16 (:func:`cpu_has_fast_bf16`),
    since training runs torch's own GEMMs, which convert bf16 in software elsewhere.

    Raises ``ValueError`` naming ``dtype`` for anything else.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16, float16 or 'auto', got {dtype}")
        return dtype
    if dtype == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16
        fast = cpu_has_fast_bf16() if training else cpu_runs_bf16_fast()
        return torch.bfloat16 if fast else torch.float32
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of 'auto', {', '.join(repr(k) for k in DTYPES)}, got {dtype!r}")


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Measured memory read bandwidth (GB/s): the best of ``repeats`` sums over a buffer far larger
    than the caches, the way a decode step streams its weights, on 4 KB pages and (where the OS has
    them) on 2 MB pages, as the runner's weights are: the roofline is the better of the two."""
    from poss.huge_pages import pack_on_huge_pages

    x = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    huge = pack_on_huge_pages([x])[0]  # x itself where the OS has no huge pages
    best = float("inf")
    for buf in [x] if huge is x else [x, huge]:
        buf.sum()  # touch every page before timing
        for _ in range(repeats):
            t = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def transparent_huge_pages() -> str:
    """The kernel's THP mode (``always`` / ``madvise`` / ``never``; ``n/a`` where it has none)."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        return mode.split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "n/a"


def describe(dtype: Union[str, torch.dtype, None] = None, threads: int = None) -> Dict:
    """The facts every benchmark header states."""
    import poss_ext

    flags = cpu_flags()
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    dt = resolve_dtype(dtype) if dtype is not None else None
    return {"cpu": cpu_model(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "simd": simd, "fast_bf16": cpu_has_fast_bf16(flags), "threads": threads or torch.get_num_threads(),
            "dtype": str(dt).replace("torch.", "") if dt is not None else None, "torch": torch.__version__,
            "linear_kernel": poss_ext.ops.cpu_linear_kernel(dt) if dt is not None else None,
            "transparent_huge_pages": transparent_huge_pages()}


def header(dtype=None, threads: int = None) -> str:
    """One line: CPU model, SIMD, bf16 support, threads and dtype."""
    d = describe(dtype, threads)
    bf16 = "fast bf16 (AMX/AVX512-BF16)" if d["fast_bf16"] else "no hardware bf16"
    s = f"{d['cpu']} ({d['torch_cpu_capability']}; {bf16}; THP {d['transparent_huge_pages']}), {d['threads']} threads"
    return s + (f", {d['dtype']} (GEMM: {d['linear_kernel']})" if d["dtype"] else "")
