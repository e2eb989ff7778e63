"""poss::qlinear in tests: which CPU kernels this CPU runs, a context that forces one, random blocks."""

import contextlib

import torch

import poss_ext


def runnable(name: str) -> bool:
    """Whether this CPU can run the qlinear kernel ``name`` ("avx512", "avx2", "scalar")."""
    try:
        poss_ext.ops.force_cpu_qlinear_kernel(name)
        return True
    except RuntimeError:
        return False
    finally:
        poss_ext.ops.force_cpu_qlinear_kernel("")


@contextlib.contextmanager
def kernel(name: str):
    """Run qlinear on kernel ``name`` inside the block, the automatic choice after it."""
    poss_ext.ops.force_cpu_qlinear_kernel(name)
    try:
        yield
    finally:
        poss_ext.ops.force_cpu_qlinear_kernel("")


def random_blocks(N: int, K: int, fmt: str, seed: int) -> torch.Tensor:
    """``[N, K / 32 * B] uint8``: random quants (every bit pattern, q8_0's -128 included) and random
    finite fp16 scales of both signs (and q4_1 mins)."""
    nbytes = poss_ext.ops.QFORMAT_BLOCK_BYTES[fmt]
    g = torch.Generator().manual_seed(seed)
    nb = K // 32
    raw = torch.randint(0, 256, (N, nb, nbytes), generator=g, dtype=torch.uint8)
    d = (torch.rand(N, nb, 1, generator=g) * 0.05 + 1e-3) * (torch.randint(0, 2, (N, nb, 1), generator=g) * 2 - 1)
    raw[..., 0:2] = d.half().view(torch.uint8)
    if fmt == "q4_1":
        raw[..., 2:4] = (torch.randn(N, nb, 1, generator=g) * 0.1).half().view(torch.uint8)
    return raw.reshape(N, nb * nbytes)
