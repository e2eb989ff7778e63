"""poss::qlinear with rows interleaved by 8 ("q8_0x8", "q4_0x8", "q4_1x8"; csrc/include/poss/qlinear_args.h):
the layout as documented byte by byte, packing and unpacking against the reference's own unpacking, and the
op's results bit for bit those of the file's layout on every CPU kernel, both activation paths.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import poss_ext
from helpers.qlinear_kernels import kernel, random_blocks, runnable
from poss_ext import reference

FORMATS = ["q8_0", "q4_0", "q4_1"]
BYTES = poss_ext.ops.QFORMAT_BLOCK_BYTES
KERNELS = [k for k in ("amx", "avx512vnni", "avx512", "avx2", "scalar") if runnable(k)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


@pytest.mark.parametrize("fmt", FORMATS)
def test_layout_is_the_documented_one(fmt):
    """Block b of rows 8g..8g+7 at 8 b B bytes into the group: the 8 d's, (q4_1) the 8 m's, then word j
    of row k's quants at 32 j + 4 k after the scales: read back here offset by offset."""
    N, nb, B = 16, 3, BYTES[fmt]
    w = random_blocks(N, 32 * nb, fmt, 11)
    packed = poss_ext.ops.interleave_rows8(w, fmt)
    assert packed.shape == w.shape and packed.dtype == torch.uint8
    flat, src = packed.reshape(-1), w.reshape(N, nb, B)
    scales = 2 if fmt == "q4_1" else 1
    for g in range(N // 8):
        for b in range(nb):
            at = g * 8 * nb * B + 8 * b * B
            for k in range(8):
                row = src[8 * g + k, b]
                for s in range(scales):
                    assert torch.equal(flat[at + 16 * s + 2 * k:at + 16 * s + 2 * k + 2], row[2 * s:2 * s + 2])
                for j in range((B - 2 * scales) // 4):
                    got = flat[at + 16 * scales + 32 * j + 4 * k:at + 16 * scales + 32 * j + 4 * k + 4]
                    assert torch.equal(got, row[2 * scales + 4 * j:2 * scales + 4 * j + 4])


@settings(max_examples=40, deadline=None)
@given(groups=st.integers(1, 6), nb=st.integers(1, 12), fmt=st.sampled_from(FORMATS), seed=st.integers(0, 2 ** 16))
def test_pack_and_unpack_undo_each_other(groups, nb, fmt, seed):
    w = random_blocks(8 * groups, 32 * nb, fmt, seed)
    packed = poss_ext.ops.interleave_rows8(w, fmt)
    assert torch.equal(poss_ext.ops.deinterleave_rows8(packed, fmt), w)
    plain, base = reference.plain_rows(packed, fmt + "x8")
    assert base == fmt and torch.equal(plain, w)
    assert not torch.equal(packed, w)  # the bytes did move


@pytest.mark.parametrize("kern", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("x_int8", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# M = 12, 16, 17, 33: the AMX kernel's tile pass (tiles of 12+ rows of x), with a leftover group of 8
# weight rows (N % 16 == 8) and chunks of 8 blocks with an odd tail (nb = 9, 47).
@pytest.mark.parametrize("M,N,K", [(1, 8, 32), (3, 16, 96), (17, 72, 576), (5, 136, 1504), (16, 64, 288),
                                   (64, 8, 64), (9, 24, 1536), (12, 40, 96), (33, 48, 1504)])
def test_same_bits_as_the_file_layout(kern, fmt, x_int8, dtype, M, N, K):
    g = torch.Generator().manual_seed(M * 7 + N + K)
    x = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    r = torch.randn(M, N, generator=g).to(dtype)
    w = random_blocks(N, K, fmt, N + K)
    packed = poss_ext.ops.interleave_rows8(w, fmt)
    with kernel(kern):
        out = poss_ext.ops.qlinear(x, packed, fmt + "x8", b, r, x_int8=x_int8)
    with kernel("scalar"):
        want = poss_ext.ops.qlinear(x, w, fmt, b, r, x_int8=x_int8)
    assert torch.equal(bits(out), bits(want))
    if x_int8:  # and the independent reference of the int8 path, given the interleaved blocks
        assert torch.equal(bits(out), bits(reference.qlinear_int8(x, packed, fmt + "x8", b, r)))


@pytest.mark.parametrize("kern", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_is_the_same_in_batches_of_1_to_40(kern, fmt):
    """Greedy speculation's property on the interleaved layout: a row's result whatever shares its call."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 288, generator=g).bfloat16()
    w = poss_ext.ops.interleave_rows8(random_blocks(80, 288, fmt, 5), fmt)
    with kernel(kern):
        alone = torch.cat([poss_ext.ops.qlinear(x[i:i + 1], w, fmt + "x8", x_int8=True) for i in range(40)])
        for M in range(1, 41):
            assert torch.equal(bits(poss_ext.ops.qlinear(x[:M], w, fmt + "x8", x_int8=True)), bits(alone[:M]))


def test_dequantize_reads_the_interleaved_layout():
    w = random_blocks(16, 64, "q4_1", 2)
    packed = poss_ext.ops.interleave_rows8(w, "q4_1")
    assert torch.equal(reference.dequantize(packed, "q4_1x8"), reference.dequantize(w, "q4_1"))


def test_rows_not_a_multiple_of_8_are_an_error():
    x = torch.randn(2, 64)
    w = random_blocks(12, 64, "q4_1", 0)
    with pytest.raises(RuntimeError, match=r"blocks.size\(0\) \(N\) must be a multiple of 8"):
        poss_ext.ops.qlinear(x, w, "q4_1x8")
    with pytest.raises(ValueError, match=r"blocks.shape\[0\] \(N\) must be a multiple of 8"):
        poss_ext.ops.interleave_rows8(w, "q4_1")
    with pytest.raises(ValueError, match="format must be 'q8_0', 'q4_0' or 'q4_1'"):
        poss_ext.ops.interleave_rows8(random_blocks(8, 64, "q4_1", 0), "q4_1x8")
    with pytest.raises(ValueError, match="multiple of 8"):
        poss_ext.ops.deinterleave_rows8(w, "q4_1")


@pytest.mark.parametrize("kern", KERNELS)
@pytest.mark.parametrize("x_int8", [True, False])
def test_a_non_finite_scale_names_its_row_in_the_file_layout(kern, x_int8):
    w = random_blocks(24, 96, "q4_1", 1)
    w[13, 20 + 2:20 + 4] = torch.tensor([float("nan")]).half().view(torch.uint8)  # row 13, block 1, the min
    packed = poss_ext.ops.interleave_rows8(w, "q4_1")
    with kernel(kern), pytest.raises(RuntimeError, match="blocks: row 13, block 1 has a non-finite min m"):
        poss_ext.ops.qlinear(torch.randn(3, 96), packed, "q4_1x8", x_int8=x_int8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_opcheck(fmt):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g)
    w = poss_ext.ops.interleave_rows8(random_blocks(16, 64, fmt, 0), fmt)
    torch.library.opcheck(torch.ops.poss.qlinear.default, (x, w, fmt + "x8", None, None, True))
