"""poss::qlinear's int8-activation path (``x_int8=True``): x quantized per row and block of 32, exact
integer block dot products. Against the plain-PyTorch reference bit for bit, across its CPU kernels, the
row-invariance greedy speculation needs, and the quantization of x on hand-made blocks.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import poss_ext
from helpers.qlinear_kernels import kernel, random_blocks, runnable
from poss_ext import reference

FORMATS = ["q8_0", "q4_0", "q4_1"]
BYTES = poss_ext.ops.QFORMAT_BLOCK_BYTES
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# The int8 path's kernels: AMX-INT8 (tiles of 4+ rows of x on interleaved rows, else VNNI's passes),
# AVX512-VNNI, AVX2 (which an AVX512 CPU without VNNI runs) and scalar.
KERNELS = [k for k in ("amx", "avx512vnni", "avx2", "scalar") if runnable(k)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def inputs(M, N, K, fmt, dtype, seed, bias=False, residual=False):
    g = torch.Generator().manual_seed(seed + 1)
    # Blocks of very different magnitudes, so the per-block scales dx differ.
    x = (torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-6, 6, (M, K // 32, 1), generator=g))
         .repeat_interleave(32, 1).reshape(M, K)).to(dtype)
    w = random_blocks(N, K, fmt, seed)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    r = torch.randn(M, N, generator=g).to(dtype) if residual else None
    return x, w, b, r


def one_hot_q8(N: int, K: int, d: float = 1.0) -> torch.Tensor:
    """q8_0 blocks of the weight whose row n is 1 at column n (d = 1, q = 1), 0 elsewhere: output n is
    then ``d * dx * q_n`` for x's block holding column n."""
    nb = K // 32
    raw = torch.zeros(N, nb, 34, dtype=torch.uint8)
    raw[..., 0:2] = torch.tensor([d]).half().view(torch.uint8)
    for n in range(N):
        raw[n, n // 32, 2 + n % 32] = 1
    return raw.reshape(N, nb * 34)


@pytest.mark.parametrize("kern", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", [(1, 1, 32), (1, 131, 576), (3, 7, 96), (5, 67, 288), (64, 9, 1504),
                                   (13, 5, 32), (9, 33, 1536)])
@pytest.mark.parametrize("extras", ["none", "both"])
def test_matches_reference_bit_for_bit(kern, fmt, dtype, M, N, K, extras):
    x, w, b, r = inputs(M, N, K, fmt, dtype, M * 1000 + N + K, bias=extras == "both", residual=extras == "both")
    with kernel(kern):
        out = poss_ext.ops.qlinear(x, w, fmt, b, r, x_int8=True)
    assert out.shape == (M, N) and out.dtype == dtype
    assert torch.equal(bits(out), bits(reference.qlinear_int8(x, w, fmt, b, r)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_is_the_linear_layer_up_to_the_quantization_of_x(fmt):
    """An independent check of what the path computes: |x - q * dx| <= dx / 2 per element, so the output
    is within sum_b dx_b / 2 * sum |w_b| (+ fp32 rounding) of the exact x @ W^T."""
    x, w, _, _ = inputs(6, 40, 320, fmt, torch.float32, 5)
    out = poss_ext.ops.qlinear(x, w, fmt, x_int8=True).double()
    wd = reference.dequantize(w, fmt).double()  # [N, K]
    exact = x.double() @ wd.t()
    _, dx = reference.quantize_x_int8(x)  # [M, nb]
    wabs = wd.abs().reshape(40, -1, 32).sum(-1)  # [N, nb]
    bound = (dx.double() / 2) @ wabs.t() + 1e-5 * (x.double().abs() @ wd.abs().t())
    assert ((out - exact).abs() <= bound).all()
    assert ((out - exact).abs() > 0).any()  # and it is not the fp32 path


@pytest.mark.skipif(len(KERNELS) < 2, reason="one int8 kernel only on this CPU")
@settings(max_examples=60, deadline=None)
@given(M=st.integers(1, 20), N=st.integers(1, 80), nb=st.integers(1, 20), seed=st.integers(0, 2 ** 16),
       fmt=st.sampled_from(FORMATS), dtype=st.sampled_from(DTYPES))
def test_every_kernel_gives_the_same_bits(M, N, nb, seed, fmt, dtype):
    x, w, b, r = inputs(M, N, 32 * nb, fmt, dtype, seed, bias=True, residual=True)
    outs = {}
    for k in KERNELS:
        with kernel(k):
            outs[k] = poss_ext.ops.qlinear(x, w, fmt, b, r, x_int8=True)
    for k in KERNELS[1:]:
        assert torch.equal(bits(outs[k]), bits(outs[KERNELS[0]])), k


@pytest.mark.parametrize("kern", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_is_the_same_in_batches_of_1_to_64(kern, fmt):
    """Every row of a call of M = 1..64 rows equals that row computed alone, bit for bit (a tree
    verify's rows against a one-token decode step), also when the rows start at another offset."""
    x, w, b, r = inputs(64, 70, 288, fmt, torch.bfloat16, 7, bias=True, residual=True)
    with kernel(kern):
        alone = torch.cat([poss_ext.ops.qlinear(x[i:i + 1], w, fmt, b, r[i:i + 1], x_int8=True) for i in range(64)])
        for M in range(1, 65):
            whole = poss_ext.ops.qlinear(x[:M], w, fmt, b, r[:M], x_int8=True)
            assert torch.equal(bits(whole), bits(alone[:M])), f"M = {M}"
            if M < 64:
                shifted = poss_ext.ops.qlinear(x[64 - M:], w, fmt, b, r[64 - M:], x_int8=True)
                assert torch.equal(bits(shifted), bits(alone[64 - M:])), f"M = {M}"


def test_thread_count_does_not_change_results():
    x, w, b, r = inputs(9, 1000, 576, "q4_1", torch.bfloat16, 3, bias=True, residual=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = poss_ext.ops.qlinear(x, w, "q4_1", b, r, x_int8=True)
        torch.set_num_threads(max(2, before))
        many = poss_ext.ops.qlinear(x, w, "q4_1", b, r, x_int8=True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


@pytest.mark.parametrize("kern", KERNELS)
@pytest.mark.parametrize("fmt,qbyte,qw", [("q8_0", 0x80, -128), ("q8_0", 0x7F, 127), ("q4_0", 0xFF, 7),
                                          ("q4_0", 0x00, -8), ("q4_1", 0xFF, 15)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_extreme_quants_do_not_saturate(kern, fmt, qbyte, qw, sign):
    """Every weight at an extreme quant against x = +-127 everywhere (dx = 1, q = +-127), d = 1: the
    integer sums at their largest (q8_0: pairs of 128 * 127 through the sign trick; 4-bit: 16 products
    per int16 before the madd) and exact, 32 * qw * q per block."""
    K = 64
    x = torch.full((17, K), 127.0 * sign)  # a tile of 16 rows of x and one more
    # 13 rows: a group of 8 (the 4-bit formats' 8-row AVX2 pass) and 5 one by one
    w = torch.full((13, K // 32, BYTES[fmt]), qbyte, dtype=torch.uint8)
    w[..., 0:2] = torch.tensor([1.0]).half().view(torch.uint8)
    if fmt == "q4_1":
        w[..., 2:4] = torch.tensor([0.0]).half().view(torch.uint8)
    w = w.reshape(13, -1)
    with kernel(kern):
        out = poss_ext.ops.qlinear(x, w, fmt, x_int8=True)
    assert (out == 2 * 32 * qw * 127 * sign).all()


# ---- weight rows 8 at a time (the AVX2 pass of the 4-bit formats), the last N % 8 one by one ----


@pytest.mark.parametrize("kern", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("N,K", [(8, 32), (16, 256), (24, 288), (29, 544), (64, 1504), (136, 576)])
def test_weight_rows_in_groups_of_8_match_the_reference(kern, fmt, N, K):
    """N whole groups of 8 rows or not, K / 32 blocks a whole number of 8-block groups or not (the pass
    adds block b into accumulator b % 8), at M = 1..20 rows (the 4-bit formats' tiles of up to 16 rows
    of x, a full one and the rest) and 31..64: the reference's bits."""
    x, w, b, r = inputs(64, N, K, fmt, torch.bfloat16, N * 7 + K, bias=True, residual=True)
    for M in [*range(1, 21), 31, 32, 33, 64]:
        with kernel(kern):
            out = poss_ext.ops.qlinear(x[:M], w, fmt, b, r[:M], x_int8=True)
        assert torch.equal(bits(out), bits(reference.qlinear_int8(x[:M], w, fmt, b, r[:M]))), f"M = {M}"


@pytest.mark.parametrize("kern", KERNELS)
@pytest.mark.parametrize("fmt,offset,what", [("q8_0", 0, "scale d"), ("q4_0", 0, "scale d"),
                                             ("q4_1", 0, "scale d"), ("q4_1", 2, "min m")])
@pytest.mark.parametrize("row,block", [(0, 0), (11, 7), (15, 10), (16, 3)])
@pytest.mark.parametrize("M", [3, 16, 19])
def test_non_finite_scale_in_a_group_of_8_rows_is_an_error(kern, fmt, offset, what, row, block, M):
    """The 8-row pass checks the scales of all 8 lanes, in the whole 8-block groups and the last
    partial one (11 blocks), in one tile of rows of x or two; row 16 is the last N % 8 = 1 row, run
    alone."""
    x, w, _, _ = inputs(M, 17, 352, fmt, torch.float32, 4)
    at = block * BYTES[fmt] + offset
    w[row, at:at + 2] = torch.tensor([float("nan")]).half().view(torch.uint8)
    with kernel(kern), pytest.raises(RuntimeError, match=f"blocks: row {row}, block {block} has a non-finite {what}"):
        poss_ext.ops.qlinear(x, w, fmt, x_int8=True)


# ---- the quantization of x, through one-hot weights: output n = dx * q_n ----


@pytest.mark.parametrize("kern", KERNELS)
def test_ties_round_half_to_even(kern):
    """amax = 127 gives dx = 1 exactly, so x / dx = x: the .5 ties go to the even integer."""
    x = torch.zeros(1, 32)
    vals = [127.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5, 4.4999995, 0.49999997]
    x[0, :len(vals)] = torch.tensor(vals)
    with kernel(kern):
        out = poss_ext.ops.qlinear(x, one_hot_q8(len(vals), 32), "q8_0", x_int8=True)
    assert out[0].tolist() == [127.0, 2.0, 4.0, -2.0, -4.0, 0.0, -0.0, 2.0, 126.0, -126.0, 4.0, 0.0]
    q, dx = reference.quantize_x_int8(x)
    assert dx.item() == 1.0 and q[0, 0, :len(vals)].tolist() == [int(v) for v in out[0].tolist()]


@pytest.mark.parametrize("kern", KERNELS)
def test_a_block_of_zeros_and_a_block_with_one_huge_value(kern):
    """A zero block (dx = 0) adds nothing, even against weights with large scales; a block with one
    huge value keeps that value (q = 127) and sends the small ones to 0; blocks are independent."""
    K = 96
    x = torch.zeros(1, K)
    x[0, 32] = 3.0e30
    x[0, 33:64] = 1.0e20  # < dx / 2 = 3e30 / 254: rounds to 0
    x[0, 64:96] = torch.linspace(-1, 1, 32)
    w = one_hot_q8(K, K)
    with kernel(kern):
        out = poss_ext.ops.qlinear(x, w, "q8_0", torch.full((K,), 0.25), x_int8=True)
    assert (out[0, :32] == 0.25).all()  # zero block: bias only
    dx = np.float32(3.0e30) / np.float32(127)
    assert out[0, 32].item() == np.float32(np.float32(dx) * np.float32(127)) + np.float32(0.25)
    assert (out[0, 33:64] == 0.25).all()
    assert torch.equal(out, reference.qlinear_int8(x, w, "q8_0", torch.full((K,), 0.25)))


@pytest.mark.parametrize("kern", KERNELS)
def test_subnormal_scale_is_clamped_to_127(kern):
    """amax = 190 * 2^-149 gives dx = 2^-149 (190 / 127 rounds to 1 ulp): x / dx = 190 is clamped to 127."""
    x = torch.zeros(1, 32)
    x[0, 0] = 190 * 2.0 ** -149
    q, dx = reference.quantize_x_int8(x)
    assert dx.item() == 2.0 ** -149 and q[0, 0, 0].item() == 127
    w = one_hot_q8(1, 32, d=2.0 ** 15)
    with kernel(kern):
        out = poss_ext.ops.qlinear(x, w, "q8_0", x_int8=True)
    assert out.item() == 127 * 2.0 ** -134


@pytest.mark.parametrize("kern", KERNELS)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_x_makes_its_row_nan_only(kern, bad, dtype):
    x, w, _, _ = inputs(3, 10, 64, "q4_1", dtype, 2)
    x[1, 40] = bad
    with kernel(kern):
        out = poss_ext.ops.qlinear(x, w, "q4_1", x_int8=True)
        rows = torch.cat([poss_ext.ops.qlinear(x[i:i + 1], w, "q4_1", x_int8=True) for i in (0, 2)])
    assert out[1].isnan().all()
    assert torch.equal(out[[0, 2]], rows)
    assert torch.equal(out.nan_to_num(7.0), reference.qlinear_int8(x, w, "q4_1").nan_to_num(7.0))


@pytest.mark.skipif(len(KERNELS) < 2, reason="one int8 kernel only on this CPU")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_row_has_the_same_bits_on_every_kernel(fmt, dtype):
    """A NaN row's outputs (8 weight rows at a time and the N % 8 rest), rounded to x's dtype, with
    bias and residual: the AVX2 kernel's vector rounding gives the scalar kernel's bits, NaNs too."""
    x, w, b, r = inputs(19, 21, 96, fmt, dtype, 5, bias=True, residual=True)
    x[4, 50] = float("nan")
    r[7, 3] = float("nan")
    outs = []
    for k in KERNELS:
        with kernel(k):
            outs.append(poss_ext.ops.qlinear(x, w, fmt, b, r, x_int8=True))
    assert outs[0][4].isnan().all() and outs[0][7, 3].isnan()
    assert torch.equal(bits(outs[0]), bits(outs[1]))


def test_order_is_8_lanes_then_a_pairwise_tree():
    """Block b adds into lane b % 8, the lanes are summed l + 4, + 2, + 1. Blocks 0 and 4 (lanes 0 and 4)
    carry +-127 * 2^20 and the rest 127: the tree cancels the big pair first and keeps the 127s, which a
    left-to-right sum over the blocks loses to rounding."""
    big = 127.0 * 2.0 ** 20
    x = torch.zeros(1, 8 * 32)
    for b in range(8):
        x[0, 32 * b] = big if b == 0 else -big if b == 4 else 127.0
    w = torch.zeros(1, 8, 34, dtype=torch.uint8)
    w[..., 0:2] = torch.tensor([1.0]).half().view(torch.uint8)
    w[..., 2] = 1
    w = w.reshape(1, 8 * 34)
    vals = [np.float32(big if b == 0 else -big if b == 4 else 127.0) for b in range(8)]
    left_to_right = np.float32(0)
    for v in vals:
        left_to_right = np.float32(left_to_right + v)
    assert left_to_right != 762.0  # the orders are told apart
    for k in KERNELS:
        with kernel(k):
            assert poss_ext.ops.qlinear(x, w, "q8_0", x_int8=True).item() == 762.0, k
    assert reference.qlinear_int8(x, w, "q8_0").item() == 762.0


# ---- API ----


@pytest.mark.parametrize("kern", KERNELS)
@pytest.mark.parametrize("fmt,offset,what", [("q8_0", 0, "scale d"), ("q4_0", 0, "scale d"),
                                             ("q4_1", 0, "scale d"), ("q4_1", 2, "min m")])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scales_are_an_error(kern, fmt, offset, what, value):
    x, w, _, _ = inputs(2, 70, 352, fmt, torch.float32, 0)
    w[66, 9 * BYTES[fmt] + offset:9 * BYTES[fmt] + offset + 2] = torch.tensor([value]).half().view(torch.uint8)
    with kernel(kern), pytest.raises(RuntimeError, match=f"blocks: row 66, block 9 has a non-finite {what}"):
        poss_ext.ops.qlinear(x, w, fmt, x_int8=True)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(fmt, dtype):
    x, w, b, r = inputs(3, 10, 64, fmt, dtype, 1, bias=True, residual=True)
    torch.library.opcheck(torch.ops.poss.qlinear.default, (x, w, fmt, b, r, True))
    torch.library.opcheck(torch.ops.poss.qlinear.default, (x, w, fmt), {"x_int8": True})


def test_default_is_the_fp32_path():
    x, w, _, _ = inputs(2, 6, 64, "q4_1", torch.float32, 4)
    assert torch.equal(poss_ext.ops.qlinear(x, w, "q4_1"), poss_ext.ops.qlinear(x, w, "q4_1", x_int8=False))
    assert torch.equal(torch.ops.poss.qlinear(x, w, "q4_1"), poss_ext.ops.qlinear(x, w, "q4_1"))
    assert not torch.equal(poss_ext.ops.qlinear(x, w, "q4_1", x_int8=True), poss_ext.ops.qlinear(x, w, "q4_1"))


def test_kernel_names():
    """The int8 path runs "avx512vnni", "avx2" or "scalar" (an AVX512 CPU without VNNI runs the AVX2
    one) and follows the force; "avx512vnni" is the AVX512 kernel for fp32 activations."""
    assert poss_ext.ops.cpu_qlinear_kernel(x_int8=True) == KERNELS[0]
    if runnable("avx512vnni"):
        with kernel("avx512vnni"):
            assert poss_ext.ops.cpu_qlinear_kernel() == "avx512"
        with kernel("avx512"):
            assert poss_ext.ops.cpu_qlinear_kernel(x_int8=True) == "avx2"
    with kernel("scalar"):
        assert poss_ext.ops.cpu_qlinear_kernel(x_int8=True) == "scalar"
        assert poss_ext.ops.cpu_qlinear_kernel() == "scalar"
