"""poss::linear against an fp64 expression written here, and the row-invariance of its CPU kernels
(bf16 on AVX512-BF16, bf16 and fp32 on AVX2 + FMA).

Row invariance is what makes bf16 speculative decoding bit-identical to bf16 decoding: a token's
logits must not depend on how many tree nodes shared the GEMM.
"""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import poss_ext
from helpers.devices import devices

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OURS = {dtype: poss_ext.ops.cpu_linear_kernel(dtype) != "aten" for dtype in DTYPES}  # row-invariant kernels
needs_ours = pytest.mark.skipif(not OURS[torch.bfloat16] and not OURS[torch.float32],
                                reason="this CPU has neither AVX512-BF16 nor AVX2 + FMA (or POSS_LINEAR=aten)")
# Each kernel's accumulation layout: fp32 lanes per SIMD vector, and consecutive K elements per lane.
LANES = {"avx512-bf16": (16, 2), "avx2-bf16": (8, 1), "avx2-fma": (8, 1)}


def exact(x, w, b=None, r=None):
    y = torch.einsum("...k,nk->...n", x.double(), w.double())
    if b is not None:
        y = y + b.double()
    if r is not None:
        y = y + r.double()
    return y


def ulp(y: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at |y| (float64), the subnormal spacing near zero."""
    fi = torch.finfo(dtype)
    exp = torch.floor(torch.log2(y.abs().clamp_min(fi.smallest_normal)))
    return torch.exp2(exp - (fi.bits - 1 - {torch.float32: 8, torch.bfloat16: 8, torch.float16: 5}[dtype]))


def inputs(M, N, K, dtype, seed, bias=False, residual=False, lead=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    r = torch.randn(*lead, M, N, generator=g).to(dtype) if residual else None
    return x, w, b, r


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (1, 130, 576), (5, 64, 33), (6, 7, 32), (7, 9, 1000), (8, 67, 64),
                                   (12, 131, 100), (13, 5, 31)])
@pytest.mark.parametrize("extras", ["none", "bias", "residual", "both"])
def test_matches_fp64(device, dtype, M, N, K, extras):
    x, w, b, r = inputs(M, N, K, dtype, M * 1000 + N + K, bias=extras in ("bias", "both"),
                        residual=extras in ("residual", "both"), lead=(2,))
    to = (lambda t: None if t is None else t.to(device))  # noqa: E731
    out = poss_ext.ops.linear(to(x), to(w), to(b), to(r)).cpu()
    assert out.shape == (2, M, N) and out.dtype == dtype
    ref = exact(x, w, b, r)
    # Our bf16 kernel rounds once an fp32 sum: within one unit in the last place of the exact value
    # plus the fp32 accumulation error. The vendor GEMMs may also round partial sums (and addmm
    # rounds bias + residual first): allow them a few units of the terms' magnitude.
    mag = torch.einsum("...k,nk->...n", x.double().abs(), w.double().abs())
    mag = mag + (0 if b is None else b.double().abs()) + (0 if r is None else r.double().abs())
    if OURS[dtype] and device == "cpu":
        bound = ulp(ref, dtype) + 2.0 ** -20 * mag
    else:
        bound = 4 * ulp(ref, dtype) + 2 * torch.finfo(dtype).eps * mag
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g} ulps {(err / ulp(ref, dtype)).max():.2f}"


@needs_ours
@settings(max_examples=60, deadline=None)
@given(M=st.integers(1, 40), N=st.integers(1, 140), K=st.integers(1, 300), seed=st.integers(0, 2 ** 16),
       residual=st.booleans(), dtype=st.sampled_from([d for d in DTYPES if OURS[d]] or [torch.float32]))
def test_rows_are_independent(M, N, K, seed, residual, dtype):
    x, w, b, r = inputs(M, N, K, dtype, seed, bias=True, residual=residual)
    whole = poss_ext.ops.linear(x, w, b, r)
    for i in range(M):
        alone = poss_ext.ops.linear(x[i:i + 1], w, b, None if r is None else r[i:i + 1])
        assert torch.equal(alone[0], whole[i]), f"row {i} of {M} differs when computed alone"
    # A different split of the rows and a different thread count change nothing either.
    cut = M // 2
    parts = torch.cat([poss_ext.ops.linear(x[:cut], w, b, None if r is None else r[:cut]),
                       poss_ext.ops.linear(x[cut:], w, b, None if r is None else r[cut:])])
    assert torch.equal(parts, whole)


@needs_ours
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 9])  # one row: a decode step, split over threads too
def test_thread_count_does_not_change_results(dtype, rows):
    if not OURS[dtype]:
        pytest.skip(f"no row-invariant kernel for {dtype} on this CPU")
    x, w, b, r = inputs(rows, 1000, 576, dtype, 3, bias=True, residual=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = poss_ext.ops.linear(x, w, b, r)
        torch.set_num_threads(max(2, before))
        many = poss_ext.ops.linear(x, w, b, r)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs(dtype):
    x, w, _, _ = inputs(5, 12, 40, dtype, 0)
    xt = x.t().contiguous().t()  # same values, column-major
    wt = w.t().contiguous().t()
    exact_match = OURS[dtype]  # ours reads any layout the same way
    tol = dict(rtol=0, atol=0) if exact_match else {}
    torch.testing.assert_close(poss_ext.ops.linear(xt, wt), poss_ext.ops.linear(x, w), **tol)


def test_empty_rows():
    x, w, _, _ = inputs(0, 8, 16, torch.bfloat16, 0)
    assert poss_ext.ops.linear(x, w).shape == (0, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    x, w, b, r = inputs(3, 10, 20, dtype, 1, bias=True, residual=True)
    torch.library.opcheck(torch.ops.poss.linear.default, (x, w, b, r))
    torch.library.opcheck(torch.ops.poss.linear.default, (x, w))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("make,match", [
    (lambda x, w: (x, w[0], None, None), "weight must be 2-D"),
    (lambda x, w: (x, w[:, :-1], None, None), r"weight.size\(1\) must equal x.size\(-1\)"),
    (lambda x, w: (x, w.float(), None, None), "weight must be BFloat16"),
    (lambda x, w: (x, w, torch.zeros(3, dtype=x.dtype, device=x.device), None), r"bias.size\(0\) must equal"),
    (lambda x, w: (x, w, None, torch.zeros(2, 5, dtype=x.dtype, device=x.device)), r"residual must be \[..., N\]"),
    (lambda x, w: (x, w, None, torch.zeros(2, 8, device=x.device)), "residual must be BFloat16"),
    (lambda x, w: (x.long(), w, None, None), "x must be float32, bfloat16 or float16"),
])
def test_bad_arguments_name_the_argument(device, make, match):
    x, w, _, _ = inputs(2, 8, 16, torch.bfloat16, 0)
    with pytest.raises(RuntimeError, match=match):
        poss_ext.ops.linear(*make(x.to(device), w.to(device)))


@pytest.mark.cuda
def test_device_mismatch_is_an_error():
    x, w, _, _ = inputs(2, 8, 16, torch.float32, 0)
    with pytest.raises(RuntimeError, match="weight must be on the same device as x"):
        poss_ext.ops.linear(x.cuda(), w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [1, 4, 8])
def test_lanes_are_summed_in_the_documented_pairwise_order(dtype, M):
    """The kernels' fixed order (csrc/cpu/linear.cpp): SIMD lane l accumulates elements per_lane*l ..
    per_lane*l + per_lane - 1 of each K-chunk, then the lanes are summed as a pairwise tree (lane l with
    l + lanes/2, then with l + lanes/4, ...). With one chunk and one nonzero product per lane, each lane
    holds an exact product, and lane values ±2^25 and 1 make the order visible: the tree cancels the
    big pair first, a left-to-right sum loses the ones to rounding."""
    if not OURS[dtype]:
        pytest.skip(f"this CPU runs the vendor GEMM for {dtype}")
    import numpy as np

    lanes, per_lane = LANES[poss_ext.ops.cpu_linear_kernel(dtype)]

    big = 2.0 ** 25
    v = np.ones(lanes, dtype=np.float32)
    v[0], v[lanes // 2] = big, -big

    def tree(a):
        a, n = a.copy(), len(a)
        while n > 1:
            n //= 2
            a[:n] = a[:n] + a[n:2 * n]
        return float(a[0])

    def left_to_right(a):
        s = np.float32(0)
        for t in a:
            s = np.float32(s + t)
        return float(s)

    want = tree(v)
    assert want != left_to_right(v)  # the values do tell the orders apart
    K = lanes * per_lane
    x = torch.zeros(M, K)
    w = torch.zeros(9, K)
    x[:, ::per_lane] = torch.where(torch.from_numpy(v).abs() == big, 2.0 ** 12, 1.0)
    w[:, ::per_lane] = torch.from_numpy(v) / x[0, ::per_lane]  # x * w = v exactly (powers of two and ones)
    out = poss_ext.ops.linear(x.to(dtype), w.to(dtype))
    assert torch.equal(out.float(), torch.full((M, 9), want).to(dtype).float())


@pytest.mark.parametrize("M", [1, 2, 5, 6, 8])
def test_bf16_output_is_rounded_to_nearest_even_once(M):
    """The epilogue adds bias and residual to the fp32 dot product and rounds once, to nearest, ties
    to even (as torch's float -> bfloat16 conversion does). Small integers keep every fp32 sum exact,
    and sums of 9 to 10 significant bits land on the bf16 ties and on both sides of them, so a
    truncating, round-half-up or twice-rounding epilogue gives different bits. A NaN input row gives NaN."""
    g = torch.Generator().manual_seed(M)
    N = 37  # full column tiles and a tail
    x = torch.randint(1, 3, (M, 2), generator=g).float()                  # 1 or 2
    w = torch.randint(0, 128, (N, 2), generator=g).float()                # dot product <= 512, exact
    b = torch.randint(0, 256, (N,), generator=g).float()
    r = torch.randint(0, 256, (M, N), generator=g).float()
    want = (x @ w.t() + b + r).to(torch.bfloat16)  # exact fp32 sums, rounded once
    assert ((x @ w.t() + b + r) != want.float()).any()  # some sums do need rounding
    bf = torch.bfloat16
    out = poss_ext.ops.linear(x.to(bf), w.to(bf), b.to(bf), r.to(bf))
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    x[0, 0] = float("nan")
    out = poss_ext.ops.linear(x.to(bf), w.to(bf), b.to(bf), r.to(bf))
    assert out[0].float().isnan().all() and not out[1:].float().isnan().any()


@pytest.mark.skipif(poss_ext.ops.cpu_linear_kernel(torch.bfloat16) != "avx512-bf16",
                    reason="only an AVX512-BF16 CPU has a bf16 kernel to set aside")
def test_this_file_passes_on_the_avx2_kernels_too():
    """An AVX512-BF16 CPU never runs the AVX2 bf16 kernel (the one AVX2-only CPUs decode with), so
    POSS_LINEAR=avx2 runs every other test of this file again with it."""
    env = {**os.environ, "POSS_LINEAR": "avx2"}
    probe = "import torch, poss_ext; print(poss_ext.ops.cpu_linear_kernel(torch.bfloat16))"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "avx2-bf16"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "not avx2_kernels_too"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
