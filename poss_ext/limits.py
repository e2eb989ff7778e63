"""The limits and sentinel values of the poss ops, for every Python caller.

The C++ kernels read the same values from ``csrc/include/poss/limits.h``; tests/ops/test_op_limits.py
checks that the two agree. ``poss_ext.reference`` keeps its own copy on purpose: it is the oracle the
kernels are tested against and shares nothing with them.
"""

ROOT = -1  # parents[b, 0]: the root of every tree
PAD = -2  # parents of padding nodes, which follow the real nodes of a ragged batch's tree
EMPTY_CANDIDATE = -2  # build_tree's cand_parents of an empty candidate slot

# Real nodes of a general (non-chain) tree in tree_attention (each keeps a 256-bit ancestor mask);
# chains, parents[i] = i - 1, have no limit.
MAX_TREE_NODES = 256
# Candidates per request of build_tree on CUDA (they live in shared memory); the CPU has no limit.
MAX_CUDA_CANDIDATES = 2048
# Head dims D that tree_attention and decoder_layer take.
HEAD_DIMS = (64, 80, 96, 128, 256)
