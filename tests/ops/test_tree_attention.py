"""poss.tree_attention against torch SDPA with an explicit dense mask (independent of the reference)."""


import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import poss_ext
from helpers.devices import devices
from poss_ext import reference
from poss_ext.limits import HEAD_DIMS

TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def dense_mask(prefix_len, parents, Nq, S):
    """[B, Nq, S] bool: query node N - Nq + qi sees the prefix and its ancestor path, walked upwards."""
    B, N = parents.shape
    mask = torch.zeros(B, Nq, S, dtype=torch.bool)
    for b in range(B):
        P, par = int(prefix_len[b]), parents[b].tolist()
        for qi in range(Nq):
            j = N - Nq + qi
            if par[j] == -2:
                continue
            mask[b, qi, :P] = True
            while j >= 0:
                mask[b, qi, P + j] = True
                j = par[j]
    return mask


def sdpa_expected(q, k, v, prefix_len, parents, scale):
    """fp32 SDPA over the whole cache with the dense mask; rows with no visible key are zero."""
    B, Hq, Nq, D = q.shape
    mask = dense_mask(prefix_len.cpu(), parents.cpu(), Nq, k.shape[2]).to(q.device)
    out = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask[:, None], scale=scale, enable_gqa=True
    )
    return torch.where(mask.any(-1)[:, None, :, None], out, torch.zeros_like(out))


def random_parents(gen, B, N, n_real, chain=False):
    parents = torch.full((B, N), -2, dtype=torch.int32)
    for b in range(B):
        parents[b, 0] = -1
        for i in range(1, n_real[b]):
            parents[b, i] = i - 1 if chain else int(torch.randint(0, i, (1,), generator=gen))
    return parents


def make_inputs(gen, B, Hq, Hkv, Nq, D, S, dtype, device):
    q = torch.randn(B, Hq, Nq, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    return q.to(device), k.to(device), v.to(device)


def check(q, k, v, prefix_len, parents, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.ops.poss.tree_attention(q, k, v, prefix_len, parents, scale)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    want = sdpa_expected(q, k, v, prefix_len, parents, scale)
    atol, rtol = TOL[q.dtype]
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)
    return out


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("ratio", [1, 3, 4, 8])
def test_matches_dense_sdpa(device, dtype, D, ratio):
    gen = torch.Generator().manual_seed(D * 10 + ratio)
    B, Hkv, N = 3, 2, 24
    parents = random_parents(gen, B, N, [24, 17, 1])
    prefix_len = torch.tensor([150, 0, 129], dtype=torch.int32)  # crosses a 128-key tile; empty
    q, k, v = make_inputs(gen, B, ratio * Hkv, Hkv, N, D, 200, dtype, device)
    check(q, k, v, prefix_len.to(device), parents.to(device))


@pytest.mark.parametrize("device", devices())
def test_draft_level_queries_only_newest_nodes(device):
    gen = torch.Generator().manual_seed(1)
    B, N, Nq = 2, 30, 8
    parents = random_parents(gen, B, N, [30, 26])  # request 1: queries 22..29, 4 real
    prefix_len = torch.tensor([77, 300], dtype=torch.int32)
    q, k, v = make_inputs(gen, B, 6, 2, Nq, 64, 400, torch.float32, device)
    out = check(q, k, v, prefix_len.to(device), parents.to(device))
    assert torch.all(out[1, :, 4:] == 0)


@pytest.mark.parametrize("device", devices())
def test_padding_queries_are_zero(device):
    gen = torch.Generator().manual_seed(2)
    parents = random_parents(gen, 2, 16, [5, 1])
    prefix_len = torch.tensor([10, 0], dtype=torch.int32)
    q, k, v = make_inputs(gen, 2, 4, 4, 16, 64, 64, torch.bfloat16, device)
    out = check(q, k, v, prefix_len.to(device), parents.to(device))
    assert torch.all(out[0, :, 5:] == 0) and torch.all(out[1, :, 1:] == 0)
    assert torch.all(out[0, :, :5].abs().sum(-1) > 0)
    # Nq covering only padding nodes: nothing to attend, all zero.
    q2 = q[:, :, :3].contiguous()
    assert torch.all(torch.ops.poss.tree_attention(q2, k, v, prefix_len.to(device), parents.to(device), 0.125) == 0)


@pytest.mark.parametrize("device", devices())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 3),
    N=st.integers(1, 70),
    nq_frac=st.floats(0.0, 1.0),
    ratio=st.sampled_from([1, 3, 4, 8]),
    Hkv=st.integers(1, 3),
    chain=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_random_trees(device, B, N, nq_frac, ratio, Hkv, chain, dtype, seed, data):
    gen = torch.Generator().manual_seed(seed)
    Nq = max(1, round(N * nq_frac))
    n_real = [data.draw(st.integers(1, N)) for _ in range(B)]
    prefix_len = torch.tensor([data.draw(st.sampled_from([0, 1, 127, 128, 129, 260])) for _ in range(B)],
                              dtype=torch.int32)
    parents = random_parents(gen, B, N, n_real, chain=chain)
    S = int(prefix_len.max()) + N + data.draw(st.integers(0, 5))
    q, k, v = make_inputs(gen, B, ratio * Hkv, Hkv, Nq, 64, S, dtype, device)
    check(q, k, v, prefix_len.to(device), parents.to(device))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("threads", [1, 2])
def test_split_and_unsplit_schedules_agree(device, threads):
    # Many groups (no split-K) and few groups (split-K + merge), single- and multi-threaded.
    gen = torch.Generator().manual_seed(3)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for B, Hkv in [(4, 4), (1, 1)]:
            parents = random_parents(gen, B, 40, [40] * B)
            prefix_len = torch.randint(300, 700, (B,), generator=gen, dtype=torch.int32)
            q, k, v = make_inputs(gen, B, 2 * Hkv, Hkv, 40, 128, 760, torch.float32, device)
            check(q, k, v, prefix_len.to(device), parents.to(device))
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("device", devices())
def test_strided_cache_is_read_in_place(device):
    # A [B, S, Hkv, D] cache viewed as [B, Hkv, S, D]: unit stride on D only.
    gen = torch.Generator().manual_seed(4)
    parents = random_parents(gen, 2, 12, [12, 9])
    prefix_len = torch.tensor([50, 131], dtype=torch.int32)
    for dtype in [torch.float32, torch.float16]:
        q, k, v = make_inputs(gen, 2, 4, 2, 12, 96, 150, dtype, device)
        k_t = k.transpose(1, 2).contiguous().transpose(1, 2)
        v_t = v.transpose(1, 2).contiguous().transpose(1, 2)
        check(q, k_t, v_t, prefix_len.to(device), parents.to(device))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("prefix", [0, 37])
def test_long_chain_is_causal_attention(device, prefix):
    # A chain of 4096 nodes (prefill): no 4096 x 4096 tree mask; compare with causal SDPA.
    gen = torch.Generator().manual_seed(5)
    N, D = 4096, 64
    parents = torch.arange(-1, N - 1, dtype=torch.int32)[None]
    q, k, v = make_inputs(gen, 1, 4, 2, N, D, prefix + N, torch.bfloat16, device)
    out = torch.ops.poss.tree_attention(q, k, v, torch.tensor([prefix], dtype=torch.int32, device=device),
                                        parents.to(device), D**-0.5)
    kf = k.float().repeat_interleave(2, 1)
    vf = v.float().repeat_interleave(2, 1)
    if prefix == 0:
        want = F.scaled_dot_product_attention(q.float(), kf, vf, is_causal=True)
    else:
        mask = torch.ones(N, prefix + N, dtype=torch.bool, device=device).tril(prefix)
        want = F.scaled_dot_product_attention(q.float(), kf, vf, attn_mask=mask)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("device", devices())
def test_chain_with_padding_and_draft_queries(device):
    gen = torch.Generator().manual_seed(6)
    parents = random_parents(gen, 2, 300, [300, 280], chain=True)  # > 256 nodes: chains only
    prefix_len = torch.tensor([5, 0], dtype=torch.int32)
    q, k, v = make_inputs(gen, 2, 3, 1, 100, 80, 310, torch.float32, device)
    check(q, k, v, prefix_len.to(device), parents.to(device))


def test_reference_matches_dense_sdpa():
    gen = torch.Generator().manual_seed(7)
    parents = random_parents(gen, 2, 10, [10, 6])
    prefix_len = torch.tensor([9, 0], dtype=torch.int32)
    q, k, v = make_inputs(gen, 2, 6, 2, 7, 64, 20, torch.float32, "cpu")
    got = reference.tree_attention(q, k, v, prefix_len, parents, 0.2)
    torch.testing.assert_close(got, sdpa_expected(q, k, v, prefix_len, parents, 0.2), atol=1e-5, rtol=1e-5)


def test_wrapper_and_reference_agree_with_op():
    gen = torch.Generator().manual_seed(8)
    parents = random_parents(gen, 1, 9, [9])
    prefix_len = torch.tensor([3], dtype=torch.int32)
    q, k, v = make_inputs(gen, 1, 2, 1, 9, 64, 12, torch.float32, "cpu")
    out = poss_ext.ops.tree_attention(q, k, v, prefix_len, parents, 0.3)
    torch.testing.assert_close(out, reference.tree_attention(q, k, v, prefix_len, parents, 0.3),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    gen = torch.Generator().manual_seed(9)
    parents = random_parents(gen, 2, 8, [8, 5]).to(device)
    prefix_len = torch.tensor([4, 0], dtype=torch.int32, device=device)
    for dtype in [torch.float32, torch.bfloat16]:
        q, k, v = make_inputs(gen, 2, 4, 2, 6, 64, 16, dtype, device)
        torch.library.opcheck(torch.ops.poss.tree_attention.default, (q, k, v, prefix_len, parents, 0.125))


def _good(device="cpu"):
    gen = torch.Generator().manual_seed(10)
    parents = random_parents(gen, 2, 6, [6, 4]).to(device)
    prefix_len = torch.tensor([3, 0], dtype=torch.int32, device=device)
    q, k, v = make_inputs(gen, 2, 4, 2, 6, 64, 12, torch.float32, device)
    return dict(q=q, k_cache=k, v_cache=v, prefix_len=prefix_len, parents=parents, scale=0.125)


def _call(a):
    return torch.ops.poss.tree_attention(a["q"], a["k_cache"], a["v_cache"], a["prefix_len"],
                                         a["parents"], a["scale"])


def _with(**kw):
    a = _good()
    a.update(kw)
    return a


def _parents_with(b, i, value):
    p = _good()["parents"].clone()
    p[b, i] = value
    return p


BAD = [
    ("q", lambda: _with(q=torch.zeros(2, 4, 6))),
    ("q", lambda: _with(q=torch.zeros(2, 4, 6, 64, dtype=torch.float64))),
    ("q.size(3)", lambda: _with(q=torch.zeros(2, 4, 6, 32), k_cache=torch.zeros(2, 2, 12, 32),
                                v_cache=torch.zeros(2, 2, 12, 32))),
    ("k_cache", lambda: _with(k_cache=torch.zeros(2, 2, 12, 64, dtype=torch.bfloat16))),
    ("k_cache", lambda: _with(k_cache=torch.zeros(2, 2, 12, 80))),
    ("k_cache", lambda: _with(k_cache=torch.zeros(2, 3, 12, 64), v_cache=torch.zeros(2, 3, 12, 64))),
    ("k_cache", lambda: _with(k_cache=torch.zeros(3, 2, 12, 64))),
    ("k_cache", lambda: _with(k_cache=torch.zeros(2, 2, 5, 64), v_cache=torch.zeros(2, 2, 5, 64))),
    ("v_cache", lambda: _with(v_cache=torch.zeros(2, 2, 11, 64))),
    ("prefix_len", lambda: _with(prefix_len=torch.tensor([3, 0]))),
    ("prefix_len", lambda: _with(prefix_len=torch.tensor([3], dtype=torch.int32))),
    ("prefix_len", lambda: _with(prefix_len=torch.tensor([-1, 0], dtype=torch.int32))),
    ("prefix_len", lambda: _with(prefix_len=torch.tensor([7, 0], dtype=torch.int32))),  # 7 + 6 > 12
    ("parents", lambda: _with(parents=torch.zeros(2, 6, dtype=torch.int64))),
    ("parents", lambda: _with(parents=torch.zeros(2, 6, 1, dtype=torch.int32))),
    ("q.size(2)", lambda: _with(parents=_good()["parents"][:, :4].contiguous())),
    ("parents[1, 0]", lambda: _with(parents=_parents_with(1, 0, 0))),
    ("parents[0, 3]", lambda: _with(parents=_parents_with(0, 3, 3))),
    ("parents[1, 5]", lambda: _with(parents=_parents_with(1, 5, 0))),
    ("parents[0]", lambda: _with(parents=torch.tensor([[-1] + [0] * 299] * 2, dtype=torch.int32),
                                 q=torch.zeros(2, 4, 6, 64), k_cache=torch.zeros(2, 2, 400, 64),
                                 v_cache=torch.zeros(2, 2, 400, 64))),
    ("scale", lambda: _with(scale=float("nan"))),
    ("scale", lambda: _with(scale=0.0)),
]


@pytest.mark.parametrize("name,make", BAD, ids=[f"{i}-{n}" for i, (n, _) in enumerate(BAD)])
def test_bad_inputs_name_the_argument(name, make):
    with pytest.raises(RuntimeError, match=name.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")
                       .replace("(", r"\(").replace(")", r"\)")):
        _call(make())


@pytest.mark.cuda
def test_device_mismatch_names_the_argument():
    a = _good()
    a["k_cache"] = a["k_cache"].cuda()
    with pytest.raises(RuntimeError, match="k_cache"):
        _call(a)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(P=st.integers(1, 300), N=st.integers(1, 40), ratio=st.sampled_from([1, 3]), seed=st.integers(0, 2 ** 16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_tree_row_is_bitwise_the_decode_step_of_its_path(P, N, ratio, seed, dtype):
    """Behind a committed prefix (CPU), node i of a tree sees exactly what a single-token decode step
    sees once i's ancestors are committed: the same bits, which keeps bf16 speculation lossless."""
    gen = torch.Generator().manual_seed(seed)
    Hkv, D = 2, 64
    parents = random_parents(gen, 1, N, [N])
    q, k, v = make_inputs(gen, 1, Hkv * ratio, Hkv, N, D, P + N, dtype, "cpu")
    tree = poss_ext.tree_attention(q, k, v, torch.tensor([P], dtype=torch.int32), parents, D ** -0.5)
    for i in range(N):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = int(parents[0, j])
        path.reverse()  # root ... i: the order decoding commits them in
        slots = list(range(P)) + [P + j for j in path]
        k1, v1 = k[:, :, slots].contiguous(), v[:, :, slots].contiguous()
        step = poss_ext.tree_attention(q[:, :, i:i + 1], k1, v1, torch.tensor([P + len(path) - 1], dtype=torch.int32),
                                       torch.tensor([[-1]], dtype=torch.int32), D ** -0.5)
        assert torch.equal(step[:, :, 0], tree[:, :, i]), f"node {i} (depth {len(path) - 1}) differs"


def _exact_path_cases():
    """Calls that take the row-exact path (prefix > 0): every head dim, GQA ratios, chains and trees,
    decode steps, prefixes across a 16-key boundary, three dtypes; with their outputs."""
    gen = torch.Generator().manual_seed(7)
    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for D, (Hkv, ratio), P, N, chain in [(64, (3, 3), 200, 1, True), (64, (3, 3), 17, 8, False),
                                            (80, (2, 4), 31, 5, False), (96, (1, 1), 1, 3, True),
                                            (128, (2, 2), 300, 13, False), (256, (1, 3), 16, 2, False),
                                            (64, (2, 1), 45, 40, False)]:
            q, k, v = make_inputs(gen, 1, Hkv * ratio, Hkv, N, D, P + N + 3, dtype, "cpu")
            parents = random_parents(gen, 1, N, [N], chain)
            args = (q, k, v, torch.tensor([P], dtype=torch.int32), parents, D ** -0.5)
            cases.append((args, torch.ops.poss.tree_attention(*args)))
    return cases


def test_exact_path_bits_do_not_depend_on_the_lane_width(tmp_path):
    """The row-exact loops run 16 lanes wide on AVX512F and 8 on AVX2 with the same per-lane
    arithmetic, so a token decodes to the same bits on either CPU; POSS_ATTENTION_LANES=8 runs the
    8-lane loops here for comparison (in a subprocess: the choice is read once)."""
    import os
    import subprocess
    import sys

    if poss_ext.ops.cpu_exact_attention_lanes() != 16:
        pytest.skip("this CPU runs only the 8-lane loops")
    path = tmp_path / "cases.pt"
    torch.save(_exact_path_cases(), path)
    script = (
        "import sys, torch, poss_ext; assert poss_ext.ops.cpu_exact_attention_lanes() == 8\n"
        f"cases = torch.load({str(path)!r})\n"
        "bad = [i for i, (a, want) in enumerate(cases) if not torch.equal(torch.ops.poss.tree_attention(*a), want)]\n"
        "print(bad); sys.exit(1 if bad else 0)\n")
    env = {**os.environ, "POSS_ATTENTION_LANES": "8"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run.returncode == 0, f"cases whose bits differ at 8 lanes: {run.stdout} {run.stderr[-2000:]}"


@pytest.mark.cuda
def test_more_query_groups_than_a_grid_y_or_z_dimension_holds():
    # B * Hkv = 65,540 groups: more than CUDA's grid y / z limit (65,535), so the kernel puts them on x.
    gen = torch.Generator().manual_seed(3)
    B, N = 32770, 3
    parents = torch.tensor([[-1, 0, 0]], dtype=torch.int32).expand(B, N).contiguous()
    prefix_len = torch.randint(0, 5, (B,), generator=gen, dtype=torch.int32)
    q, k, v = make_inputs(gen, B, 2, 2, N, 64, 8, torch.bfloat16, "cpu")
    want = torch.ops.poss.tree_attention(q, k, v, prefix_len, parents, 0.125)
    got = torch.ops.poss.tree_attention(q.cuda(), k.cuda(), v.cuda(), prefix_len.cuda(), parents.cuda(), 0.125)
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=atol, rtol=rtol)
