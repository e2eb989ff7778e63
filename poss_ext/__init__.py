"""poss_ext: the compiled ops of poss (``torch.ops.poss.*``), their Python wrappers and references.

Importing this package loads ``poss_ext._C`` (which registers the ops), the fake kernels and the
fallbacks for devices without compiled kernels.
"""

from poss_ext import _loader

# A source checkout without a built _C defers to the installed poss_ext (see _loader.package_dir).
__path__[:] = [_loader.package_dir(__path__[0])]
_C = _loader.load_library(__path__[0])

from poss_ext import ops, reference  # noqa: E402
from poss_ext.ops import build_tree, kv_compact, tree_attention, tree_verify  # noqa: E402

ops._register_fallbacks(dict(_C.build_info()))
ops._register_qlinear_cuda_error()
ops._register_attention_backend()  # POSS_ATTENTION=triton: the Triton kernel on CUDA


def build_info() -> dict:
    """How the library was built: torch version, whether CUDA kernels exist, CUDA arch list."""
    return dict(_C.build_info())


__all__ = ["build_info", "build_tree", "kv_compact", "ops", "reference", "tree_attention", "tree_verify"]
