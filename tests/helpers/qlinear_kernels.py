"""Choosing poss::qlinear's CPU kernel in tests: which ones this CPU runs, and a context that forces one."""

import contextlib

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
