"""Weights on 2 MB pages.

A decode step on a CPU streams every weight once, so it is bound by memory bandwidth, and on 4 KB
pages a 270 MB bf16 model touches ~66k pages per step: the page walks of the TLB misses stall the
stream. Linux backs anonymous memory with 2 MB transparent huge pages where the process asks for
them (``madvise(MADV_HUGEPAGE)``; most systems set ``/sys/kernel/mm/transparent_hugepage/enabled``
to ``madvise``), which cuts the pages per step ~500-fold. :func:`pack_on_huge_pages` copies a set of
tensors into one such arena; elsewhere (another OS, a GPU, THP ``never``) it returns them unchanged.
"""

import mmap
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

_ALIGN = 64          # cache line: every tensor starts on its own line
_HUGE = 2 << 20      # the arena is a whole number of 2 MB pages


def huge_pages_available() -> bool:
    """True where this process can ask for transparent huge pages (Linux, THP not ``never``)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def pack_on_huge_pages(tensors: Sequence[Optional[Tensor]]) -> List[Optional[Tensor]]:
    """Copies of CPU ``tensors`` (any shapes and dtypes; None passes through) in one huge-page arena.

    Returns contiguous tensors equal to the inputs, in order; tensors that shared storage (a tied
    embedding and lm_head) stay one copy. Returns the inputs themselves when huge pages are not
    available here or any tensor is not on the CPU.
    """
    present = [t for t in tensors if t is not None]
    if not present or not huge_pages_available() or any(t.device.type != "cpu" for t in present):
        return list(tensors)
    offsets: Dict[tuple, int] = {}
    size = 0
    for t in present:
        key = _key(t)
        if key not in offsets:
            offsets[key] = size
            size = _round_up(size + t.numel() * t.element_size(), _ALIGN)
    buf = mmap.mmap(-1, _round_up(max(size, 1), _HUGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    arena = torch.frombuffer(buf, dtype=torch.uint8)  # keeps ``buf`` alive as long as any view of it
    out: List[Optional[Tensor]] = []
    copied = set()
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        key = _key(t)
        start = offsets[key]
        view = arena[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        if key not in copied:
            view.copy_(t)
            copied.add(key)
        out.append(view)
    return out


def _key(t: Tensor) -> tuple:
    # Same data, same shape and dtype: one copy (a tied embedding / lm_head).
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def huge_page_bytes() -> int:
    """AnonHugePages of this process (bytes): how much of its anonymous memory is on 2 MB pages."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
