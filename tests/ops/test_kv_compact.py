"""poss.kv_compact against a clone-based gather, the reference, and the overlapping-move case."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import poss_ext
from helpers.devices import devices
from poss_ext import reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def naive_compact(k, v, prefix_len, accept_nodes, accept_len):
    """Out of place: every destination row is read from an untouched clone of the cache."""
    k2, v2 = k.clone(), v.clone()
    for b in range(k.shape[1]):
        p, n = int(prefix_len[b]), int(accept_len[b])
        for j in range(n + 1):
            src = p + int(accept_nodes[b, j])
            k2[:, b, :, p + j] = k[:, b, :, src]
            v2[:, b, :, p + j] = v[:, b, :, src]
    return k2, v2


def random_paths(gen, B, N, S):
    """Strictly increasing accepted paths starting at the root, with room in the cache."""
    accept_len = torch.randint(0, N, (B,), generator=gen, dtype=torch.int32)
    accept_nodes = torch.full((B, N), -1, dtype=torch.int32)
    prefix_len = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        n = int(accept_len[b])
        rest = torch.randperm(N - 1, generator=gen)[:n].sort().values + 1
        path = torch.cat([torch.zeros(1, dtype=torch.long), rest])
        accept_nodes[b, : n + 1] = path.int()
        prefix_len[b] = int(torch.randint(0, S - N + 1, (), generator=gen))
    return prefix_len, accept_nodes, accept_len


def make_cache(gen, shape, dtype, device):
    k = torch.randn(shape, generator=gen).to(dtype).to(device)
    v = torch.randn(shape, generator=gen).to(dtype).to(device)
    return k, v


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_overlapping_path(device, dtype):
    # Path 0,1,3,4: node 3 moves to slot P+2 while node 4 still has to leave P+4 for P+3, and
    # node 3's old slot P+3 is overwritten only after it has been read.
    gen = torch.Generator().manual_seed(0)
    k, v = make_cache(gen, (2, 1, 2, 12, 8), dtype, device)
    prefix_len = torch.tensor([3], dtype=torch.int32, device=device)
    accept_nodes = torch.tensor([[0, 1, 3, 4, -1, -1]], dtype=torch.int32, device=device)
    accept_len = torch.tensor([3], dtype=torch.int32, device=device)
    k0, v0 = k.clone(), v.clone()
    poss_ext.kv_compact(k, v, prefix_len, accept_nodes, accept_len)
    for new, old in ((k, k0), (v, v0)):
        assert torch.equal(new[:, :, :, 3:7], old[:, :, :, [3, 4, 6, 7]])
        assert torch.equal(new[:, :, :, :5], old[:, :, :, :5])  # prefix and nodes 0, 1 stay
        assert torch.equal(new[:, :, :, 7:], old[:, :, :, 7:])  # nothing past the path changes


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 80, 7])
def test_random_vs_naive_and_reference(device, dtype, D):
    gen = torch.Generator().manual_seed(D)
    L, B, H, S, N = 3, 5, 2, 40, 12
    k, v = make_cache(gen, (L, B, H, S, D), dtype, device)
    prefix_len, accept_nodes, accept_len = (t.to(device) for t in random_paths(gen, B, N, S))
    want_k, want_v = naive_compact(k, v, prefix_len, accept_nodes, accept_len)
    ref_k, ref_v = k.clone(), v.clone()
    reference.kv_compact(ref_k, ref_v, prefix_len, accept_nodes, accept_len)
    poss_ext.kv_compact(k, v, prefix_len, accept_nodes, accept_len)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert torch.equal(ref_k, want_k) and torch.equal(ref_v, want_v)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    L=st.integers(1, 3),
    B=st.integers(1, 4),
    H=st.integers(1, 3),
    N=st.integers(1, 10),
    extra_slots=st.integers(0, 6),
    D=st.integers(1, 40),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_hypothesis_vs_naive(L, B, H, N, extra_slots, D, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    S = N + extra_slots
    k, v = make_cache(gen, (L, B, H, S, D), dtype, "cpu")
    prefix_len, accept_nodes, accept_len = random_paths(gen, B, N, S)
    want_k, want_v = naive_compact(k, v, prefix_len, accept_nodes, accept_len)
    poss_ext.kv_compact(k, v, prefix_len, accept_nodes, accept_len)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


@pytest.mark.parametrize("device", devices())
def test_strided_views_of_a_combined_cache(device):
    # EAGLE-style combined [2L, ...] cache; K and V are the even and odd layers (strided views).
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(6, 2, 3, 20, 16, generator=gen).to(device)
    k, v = kv[0::2], kv[1::2]
    prefix_len, accept_nodes, accept_len = (t.to(device) for t in random_paths(gen, 2, 8, 20))
    want_k, want_v = naive_compact(k, v, prefix_len, accept_nodes, accept_len)
    poss_ext.kv_compact(k, v, prefix_len, accept_nodes, accept_len)
    assert torch.equal(kv[0::2], want_k) and torch.equal(kv[1::2], want_v)


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    gen = torch.Generator().manual_seed(2)
    k, v = make_cache(gen, (2, 3, 2, 16, 8), torch.float32, device)
    prefix_len, accept_nodes, accept_len = (t.to(device) for t in random_paths(gen, 3, 6, 16))
    # opcheck runs the op several times on clones of the arguments and checks that only the
    # (a!)/(b!) arguments change, that the fake kernel agrees, and the dispatcher registration.
    torch.library.opcheck(
        torch.ops.poss.kv_compact.default, (k, v, prefix_len, accept_nodes, accept_len)
    )


def good_args():
    return dict(
        k_cache=torch.zeros(1, 1, 1, 8, 4),
        v_cache=torch.zeros(1, 1, 1, 8, 4),
        prefix_len=torch.tensor([2], dtype=torch.int32),
        accept_nodes=torch.tensor([[0, 2, 3, -1]], dtype=torch.int32),
        accept_len=torch.tensor([2], dtype=torch.int32),
    )


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(k_cache=torch.zeros(1, 1, 8, 4)), "k_cache must be 5-D"),
        (dict(k_cache=torch.zeros(1, 1, 1, 8, 4, dtype=torch.int32)), "k_cache must be a floating dtype"),
        (dict(v_cache=torch.zeros(1, 1, 1, 9, 4)), "v_cache must have k_cache's shape"),
        (dict(v_cache=torch.zeros(1, 1, 1, 8, 4, dtype=torch.float16)), "v_cache must have k_cache's dtype"),
        (dict(k_cache=torch.zeros(1, 1, 1, 4, 8).transpose(3, 4)), "k_cache must be contiguous in its last"),
        (dict(prefix_len=torch.tensor([2])), "prefix_len must be Int"),
        (dict(prefix_len=torch.tensor([2, 2], dtype=torch.int32)), r"prefix_len.size\(0\)"),
        (dict(accept_nodes=torch.tensor([0, 2, 3], dtype=torch.int32)), "accept_nodes must be 2-D"),
        (dict(accept_nodes=torch.tensor([[0, 2, 3]], dtype=torch.int64)), "accept_nodes must be Int"),
        (dict(accept_len=torch.tensor([[2]], dtype=torch.int32)), "accept_len must be 1-D"),
        (dict(accept_len=torch.tensor([4], dtype=torch.int32)), r"accept_len\[0\] = 4 must be in \[0, 4\)"),
        (dict(accept_len=torch.tensor([-1], dtype=torch.int32)), r"accept_len\[0\] = -1"),
        (dict(prefix_len=torch.tensor([-1], dtype=torch.int32)), r"prefix_len\[0\] = -1 must be >= 0"),
        (dict(accept_nodes=torch.tensor([[-1, 2, 3, -1]], dtype=torch.int32)), r"accept_nodes\[0, 0\] = -1"),
        (dict(accept_nodes=torch.tensor([[0, 3, 2, -1]], dtype=torch.int32)),
         r"accept_nodes\[0, 2\] = 2 must be greater"),
        (dict(accept_nodes=torch.tensor([[0, 2, 2, -1]], dtype=torch.int32)),
         r"accept_nodes\[0, 2\] = 2 must be greater"),
        (dict(accept_nodes=torch.tensor([[0, 2, 4, -1]], dtype=torch.int32)),
         r"accept_nodes\[0, 2\] = 4 must be < N = 4"),
        (dict(prefix_len=torch.tensor([5], dtype=torch.int32)),
         r"prefix_len\[0\] \+ accept_nodes\[0, 2\] = 8 must be < S = 8"),
    ],
)
def test_bad_input(change, match):
    args = good_args()
    args.update(change)
    with pytest.raises(RuntimeError, match=match):
        poss_ext.kv_compact(**args)


def test_same_tensor_for_k_and_v_is_rejected():
    args = good_args()
    args["v_cache"] = args["k_cache"]
    with pytest.raises(RuntimeError, match="v_cache must not share memory with k_cache"):
        poss_ext.kv_compact(**args)


def test_bad_input_leaves_cache_untouched():
    args = good_args()
    args["k_cache"] = torch.randn(1, 1, 1, 8, 4)
    before = args["k_cache"].clone()
    args["accept_nodes"] = torch.tensor([[0, 3, 2, -1]], dtype=torch.int32)
    with pytest.raises(RuntimeError):
        poss_ext.kv_compact(**args)
    assert torch.equal(args["k_cache"], before)


@pytest.mark.cuda
def test_bad_device():
    args = good_args()
    args["accept_len"] = args["accept_len"].cuda()
    with pytest.raises(RuntimeError, match="accept_len must be on the same device"):
        poss_ext.kv_compact(**args)
