"""poss::qlinear (a linear layer whose weight is in GGUF blocks: q8_0, q4_0, q4_1) against the
reference, against the ``gguf`` package's own dequantisation, across its CPU kernels, and the
row-invariance that keeps greedy speculation on a quantized target identical to decoding.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import poss_ext
from helpers.qlinear_kernels import kernel, random_blocks, runnable
from poss_ext import reference

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

FORMATS = ["q8_0", "q4_0", "q4_1"]
GGML_TYPE = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
             "q4_1": GGMLQuantizationType.Q4_1}
BYTES = poss_ext.ops.QFORMAT_BLOCK_BYTES


KERNELS = [k for k in ("avx512", "avx2", "scalar") if runnable(k)]


def inputs(M, N, K, fmt, dtype, seed, bias=False, residual=False, lead=()):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(*lead, M, K, generator=g).to(dtype)
    w = random_blocks(N, K, fmt, seed)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    r = torch.randn(*lead, M, N, generator=g).to(dtype) if residual else None
    return x, w, b, r


def ulp(y: torch.Tensor, dtype) -> torch.Tensor:
    fi = torch.finfo(dtype)
    exp = torch.floor(torch.log2(y.abs().clamp_min(fi.smallest_normal)))
    return torch.exp2(exp - {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype])


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_dequantize_is_gguf_dequantize(fmt):
    """The reference decodes blocks to the same fp32 values as the gguf package, bit for bit: random
    bytes (every nibble and int8 value) and blocks gguf itself quantized."""
    blocks = random_blocks(37, 96, fmt, 0)
    want = gguf_quants.dequantize(blocks.numpy(), GGML_TYPE[fmt])
    assert np.array_equal(reference.dequantize(blocks, fmt).numpy().view(np.int32), want.view(np.int32))
    w = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    q = torch.from_numpy(gguf_quants.quantize(w, GGML_TYPE[fmt]))
    assert q.shape == (5, 2 * BYTES[fmt])
    got = reference.dequantize(q, fmt).numpy()
    assert np.array_equal(got, gguf_quants.dequantize(q.numpy(), GGML_TYPE[fmt]))
    assert np.abs(got - w).max() < 0.5  # a sanity check that these are the weights, quantized


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
def test_nibble_order_low_first(fmt):
    """Element j of a 4-bit block is the low nibble of byte j, element j + 16 its high nibble (d = 1, m = 0)."""
    blk = torch.zeros(1, BYTES[fmt], dtype=torch.uint8)
    blk[0, 0:2] = torch.tensor([1.0]).half().view(torch.uint8)
    off = 4 if fmt == "q4_1" else 2
    blk[0, off] = 0x3A  # element 0: 0xA, element 16: 0x3
    x = torch.zeros(1, 32)
    for j, q in ((0, 0xA), (16, 0x3)):
        x.zero_()
        x[0, j] = 1.0
        want = q - 8 if fmt == "q4_0" else q
        assert poss_ext.ops.qlinear(x, blk, fmt).item() == want
        assert reference.dequantize(blk, fmt)[0, j].item() == want


@pytest.mark.parametrize("kern", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 1, 32), (1, 130, 576), (3, 7, 64), (5, 67, 96), (7, 9, 1536), (13, 5, 32)])
@pytest.mark.parametrize("extras", ["none", "both"])
def test_matches_reference(kern, fmt, dtype, M, N, K, extras):
    x, w, b, r = inputs(M, N, K, fmt, dtype, M * 1000 + N + K, bias=extras == "both",
                        residual=extras == "both", lead=(2,))
    with kernel(kern):
        out = poss_ext.ops.qlinear(x, w, fmt, b, r)
    assert out.shape == (2, M, N) and out.dtype == dtype
    ref = reference.qlinear(x, w, fmt, b, r).double()
    exact = reference.linear(x.double(), reference.dequantize(w, fmt).double(),
                             None if b is None else b.double(), None if r is None else r.double())
    # fp32 accumulation: each of 32 lanes sums K / 32 products, 5 tree levels, + bias, + residual; then
    # one rounding to the output dtype (within one of its units of the exact value).
    wd = reference.dequantize(w, fmt).double().abs()
    mag = torch.einsum("...k,nk->...n", x.double().abs(), wd)
    mag = mag + (0 if b is None else b.double().abs()) + (0 if r is None else r.double().abs())
    bound = ulp(exact, dtype) + (K // 32 + 8) * 2.0 ** -24 * mag
    err = (out.double() - exact).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}"
    assert ((out.double() - ref).abs() <= 2 * bound).all()


@pytest.mark.skipif(len(KERNELS) < 2, reason="one kernel only on this CPU")
@settings(max_examples=40, deadline=None)
@given(M=st.integers(1, 20), N=st.integers(1, 80), nb=st.integers(1, 12), seed=st.integers(0, 2 ** 16),
       fmt=st.sampled_from(FORMATS), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_every_kernel_gives_the_same_bits(M, N, nb, seed, fmt, dtype):
    x, w, b, r = inputs(M, N, 32 * nb, fmt, dtype, seed, bias=True, residual=True)
    outs = {}
    for k in KERNELS:
        with kernel(k):
            outs[k] = poss_ext.ops.qlinear(x, w, fmt, b, r)
    first = outs[KERNELS[0]]
    for k in KERNELS[1:]:
        assert torch.equal(outs[k].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           first.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), k


@pytest.mark.parametrize("kern", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_is_the_same_in_batches_of_1_to_64(kern, fmt):
    """Every row of a call of M = 1..64 rows equals that row computed alone, bit for bit: the property
    greedy speculation needs (a tree verify's rows against a one-token decode step)."""
    x, w, b, r = inputs(64, 70, 160, fmt, torch.bfloat16, 7, bias=True, residual=True)
    with kernel(kern):
        alone = torch.cat([poss_ext.ops.qlinear(x[i:i + 1], w, fmt, b, r[i:i + 1]) for i in range(64)])
        for M in range(1, 65):
            whole = poss_ext.ops.qlinear(x[:M], w, fmt, b, r[:M])
            assert torch.equal(whole.view(torch.int16), alone[:M].view(torch.int16)), f"M = {M}"
            # and at an offset: the same rows in another tile
            if M < 64:
                shifted = poss_ext.ops.qlinear(x[64 - M:], w, fmt, b, r[64 - M:])
                assert torch.equal(shifted.view(torch.int16), alone[64 - M:].view(torch.int16)), f"M = {M}"


@pytest.mark.parametrize("rows", [1, 9])
def test_thread_count_does_not_change_results(rows):
    x, w, b, r = inputs(rows, 1000, 576, "q4_1", torch.bfloat16, 3, bias=True, residual=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = poss_ext.ops.qlinear(x, w, "q4_1", b, r)
        torch.set_num_threads(max(2, before))
        many = poss_ext.ops.qlinear(x, w, "q4_1", b, r)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def test_order_is_32_lanes_then_a_pairwise_tree():
    """The documented order (csrc/cpu/qlinear.cpp): lane l sums elements l, l + 32, ...; the lanes
    are added l + 16, then + 8, + 4, + 2, + 1. With q8_0 weights of 1 (d = 1) and x = ±2^25 at lanes 0
    and 16 and 1 elsewhere, the tree cancels the big pair first and keeps every 1; a left-to-right
    sum loses them to rounding."""
    big = 2.0 ** 25
    x = torch.ones(1, 64)
    x[0, 0], x[0, 16] = big, -big
    x[0, 32:] = 0
    blk = torch.zeros(1, 2 * 34, dtype=torch.uint8)
    for b in range(2):
        blk[0, 34 * b:34 * b + 2] = torch.tensor([1.0]).half().view(torch.uint8)
        blk[0, 34 * b + 2:34 * b + 34] = 1
    left_to_right = np.float32(0)
    for v in x[0].numpy():
        left_to_right = np.float32(left_to_right + v)
    assert left_to_right != 30.0  # the orders are told apart
    for k in KERNELS:
        with kernel(k):
            assert poss_ext.ops.qlinear(x, blk, "q8_0").item() == 30.0, k


def test_empty_rows_and_zero_k():
    x, w, b, _ = inputs(0, 8, 32, "q8_0", torch.bfloat16, 0, bias=True)
    assert poss_ext.ops.qlinear(x, w, "q8_0").shape == (0, 8)
    x = torch.zeros(3, 0)
    w = torch.zeros(4, 0, dtype=torch.uint8)
    b = torch.arange(4.0)
    assert torch.equal(poss_ext.ops.qlinear(x, w, "q4_0", b), b.expand(3, 4))


def test_strided_x():
    x, w, _, _ = inputs(5, 12, 64, "q4_0", torch.float32, 0)
    xt = x.t().contiguous().t()
    assert torch.equal(poss_ext.ops.qlinear(xt, w, "q4_0"), poss_ext.ops.qlinear(x, w, "q4_0"))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(fmt, dtype):
    x, w, b, r = inputs(3, 10, 64, fmt, dtype, 1, bias=True, residual=True)
    torch.library.opcheck(torch.ops.poss.qlinear.default, (x, w, fmt, b, r))
    torch.library.opcheck(torch.ops.poss.qlinear.default, (x, w, fmt))


@pytest.mark.parametrize("make,match", [
    (lambda x, w: (x, w, "q5_0", None, None),
     "format must be one of 'q8_0', 'q4_0', 'q4_1', 'q8_0x8', 'q4_0x8', 'q4_1x8', got 'q5_0'"),
    (lambda x, w: (x[:, :40], w, "q4_1", None, None), r"x.size\(-1\) \(K\) must be a multiple of the block size 32"),
    (lambda x, w: (x, w[:, :-1], "q4_1", None, None), r"blocks.size\(1\) must equal K / 32 \* 20"),
    (lambda x, w: (x, w, "q8_0", None, None), r"blocks.size\(1\) must equal K / 32 \* 34"),
    (lambda x, w: (x, w[0], "q4_1", None, None), "blocks must be 2-D"),
    (lambda x, w: (x, w.view(torch.int8), "q4_1", None, None), "blocks must be Byte"),
    (lambda x, w: (x.long(), w, "q4_1", None, None), "x must be float32, bfloat16 or float16"),
    (lambda x, w: (x, w, "q4_1", torch.zeros(3, dtype=x.dtype), None), r"bias.size\(0\) must equal"),
    (lambda x, w: (x, w, "q4_1", None, torch.zeros(2, 5, dtype=x.dtype)), r"residual must be \[..., N\]"),
    (lambda x, w: (x, w, "q4_1", None, torch.zeros(2, 8)), "residual must be BFloat16"),
])
def test_bad_arguments_name_the_argument(make, match):
    x, w, _, _ = inputs(2, 8, 64, "q4_1", torch.bfloat16, 0)
    with pytest.raises(RuntimeError, match=match):
        poss_ext.ops.qlinear(*make(x, w))


@pytest.mark.parametrize("kern", KERNELS)
@pytest.mark.parametrize("fmt,offset,what", [("q8_0", 0, "scale d"), ("q4_0", 0, "scale d"),
                                             ("q4_1", 0, "scale d"), ("q4_1", 2, "min m")])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scales_are_an_error(kern, fmt, offset, what, value):
    x, w, _, _ = inputs(2, 70, 96, fmt, torch.float32, 0)
    w[66, BYTES[fmt] + offset:BYTES[fmt] + offset + 2] = torch.tensor([value]).half().view(torch.uint8)
    with kernel(kern), pytest.raises(RuntimeError, match=f"blocks: row 66, block 1 has a non-finite {what}"):
        poss_ext.ops.qlinear(x, w, fmt)


def test_force_an_unknown_kernel_is_an_error():
    with pytest.raises(RuntimeError, match="kernel must be 'amx', 'avx512vnni', 'avx512', 'avx2', 'scalar'"):
        poss_ext.ops.force_cpu_qlinear_kernel("neon")
    assert poss_ext.ops.cpu_qlinear_kernel() == KERNELS[0]


@pytest.mark.cuda
def test_cuda_tensors_get_a_clear_error():
    x, w, _, _ = inputs(2, 8, 64, "q4_1", torch.bfloat16, 0)
    with pytest.raises(RuntimeError, match="poss::qlinear has CPU kernels only"):
        poss_ext.ops.qlinear(x.cuda(), w.cuda(), "q4_1")
