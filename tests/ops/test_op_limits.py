"""The op limits come from one place: ``csrc/include/poss/limits.h`` for the kernels and
``poss_ext.limits`` for Python. These tests read the header and check that the two agree, that no
other C++ file defines them again, and that the built ops enforce exactly these values (one past each
limit fails with an error naming the argument, the limit itself passes)."""

import re
from pathlib import Path

import pytest
import torch

import poss_ext
from poss_ext import limits, reference

ROOT_DIR = Path(__file__).resolve().parents[2]
HEADER = ROOT_DIR / "csrc" / "include" / "poss" / "limits.h"
# limits.h name -> poss_ext.limits name
SCALARS = {"kRootParent": "ROOT", "kPadParent": "PAD", "kEmptyCandidate": "EMPTY_CANDIDATE",
           "kMaxTreeNodes": "MAX_TREE_NODES", "kMaxCudaCandidates": "MAX_CUDA_CANDIDATES"}


def header_constants() -> dict:
    """``constexpr <int type> kName = <int>;`` and ``constexpr <int type> kName[] = {...};`` of limits.h."""
    text = HEADER.read_text()
    found = {m[1]: int(m[2]) for m in re.finditer(r"constexpr\s+u?int\d+_t\s+(k\w+)\s*=\s*(-?\d+)\s*;", text)}
    for m in re.finditer(r"constexpr\s+u?int\d+_t\s+(k\w+)\s*\[\]\s*=\s*\{([^}]*)\}\s*;", text):
        found[m[1]] = tuple(int(x) for x in m[2].split(","))
    return found


def test_poss_ext_limits_equal_the_cpp_header():
    got = header_constants()
    assert set(got) == set(SCALARS) | {"kHeadDims"}, "limits.h and this test name different constants"
    for cpp, py in SCALARS.items():
        assert got[cpp] == getattr(limits, py), f"{cpp} = {got[cpp]} in limits.h, poss_ext.limits.{py} = " \
                                                f"{getattr(limits, py)}"
    assert got["kHeadDims"] == limits.HEAD_DIMS


def test_the_independent_reference_agrees():
    """poss_ext.reference keeps its own sentinel (it is the oracle, it imports nothing it checks)."""
    assert reference.PAD == limits.PAD


def test_no_other_cpp_file_defines_a_limit_again():
    names = set(SCALARS) | {"kHeadDims", "kMaxCandidates"}
    define = re.compile(r"constexpr\s+[\w:]+\s+(" + "|".join(names) + r")\b")
    where = [f"{p.relative_to(ROOT_DIR)}: {m[1]}" for p in (ROOT_DIR / "csrc").rglob("*")
             if p.suffix in (".h", ".cpp", ".cu", ".cuh") and p != HEADER for m in define.finditer(p.read_text())]
    assert not where, where
    # the head-dim check, written out by hand, was what drifted before
    spelled = [str(p.relative_to(ROOT_DIR)) for p in (ROOT_DIR / "csrc").rglob("*")
               if p.suffix in (".h", ".cpp", ".cu") and re.search(r"D\s*==\s*64\s*\|\|", p.read_text())]
    assert not spelled, spelled


# ---- the built ops enforce these values ---------------------------------------------------------


def star(n: int) -> torch.Tensor:
    """[1, n] int32: every node a child of the root (a general tree: not a chain for n > 2)."""
    p = torch.zeros(1, n, dtype=torch.int32)
    p[0, 0] = limits.ROOT
    return p


def attention(n: int, D: int = 64):
    q = torch.randn(1, 2, n, D)
    k = torch.randn(1, 1, n + 4, D)
    return torch.ops.poss.tree_attention(q, k, torch.randn_like(k), torch.tensor([4], dtype=torch.int32),
                                         star(n), D ** -0.5)


def test_tree_attention_takes_general_trees_up_to_max_tree_nodes():
    assert attention(limits.MAX_TREE_NODES).shape[2] == limits.MAX_TREE_NODES
    with pytest.raises(RuntimeError, match=rf"parents.*{limits.MAX_TREE_NODES}"):
        attention(limits.MAX_TREE_NODES + 1)


@pytest.mark.parametrize("D", [limits.HEAD_DIMS[0] - 16, *limits.HEAD_DIMS, limits.HEAD_DIMS[-1] + 64])
def test_tree_attention_takes_exactly_the_head_dims(D):
    if D in limits.HEAD_DIMS:
        assert attention(3, D).shape[-1] == D
    else:
        with pytest.raises(RuntimeError, match=r"q\.size\(3\) \(head dim D\) must be one of " +
                           re.escape(", ".join(map(str, limits.HEAD_DIMS)))):
            attention(3, D)


def test_padding_and_root_sentinels_are_what_the_ops_read():
    parents = torch.tensor([[limits.ROOT, 0, limits.PAD]], dtype=torch.int32)
    ok = torch.ops.poss.tree_attention(torch.randn(1, 1, 3, 64), torch.randn(1, 1, 3, 64), torch.randn(1, 1, 3, 64),
                                       torch.tensor([0], dtype=torch.int32), parents, 0.125)
    assert ok.shape == (1, 1, 3, 64)
    for bad, name in ((torch.tensor([[0, 0, 1]], dtype=torch.int32), "parents"),
                      (torch.tensor([[limits.ROOT, limits.PAD, 0]], dtype=torch.int32), "padding")):
        with pytest.raises(RuntimeError, match=name):
            torch.ops.poss.tree_attention(torch.randn(1, 1, 3, 64), torch.randn(1, 1, 3, 64),
                                          torch.randn(1, 1, 3, 64), torch.tensor([0], dtype=torch.int32), bad, 0.125)


def test_build_tree_reads_empty_candidate_slots():
    """A slot whose parent is EMPTY_CANDIDATE is skipped: the tree keeps only the real candidates."""
    tokens = torch.tensor([[5, 6, 7]])
    scores = torch.tensor([[-0.1, -0.2, -0.3]])
    parents = torch.tensor([[-1, limits.EMPTY_CANDIDATE, 0]], dtype=torch.int32)
    out_tokens, out_parents, _ = poss_ext.build_tree(tokens, scores, parents, torch.tensor([1]), 4)
    assert out_tokens[0, :3].tolist() == [1, 5, 7]
    assert out_parents[0].tolist() == [limits.ROOT, 0, 1, limits.PAD]
