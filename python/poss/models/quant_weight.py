"""Linear weights kept in GGUF blocks, and the decoder layer that runs them through ``poss_ext.ops.qlinear``.

The fused ``poss::decoder_layer`` op takes float weights; a target with quantized weights runs
``poss::qdecoder_layer``, the same ops with each projection through ``qlinear`` for blocks (``linear`` for
the float weights a file stores in other formats). Both compute a row the same way however many rows
share the call, so a tree verify's logits equal a decode step's bit for bit.
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

import poss_ext
from poss_ext.ops import QBLOCK, QFORMAT_BLOCK_BYTES


@dataclass
class QuantWeight:
    """A weight ``[N, K]`` as GGUF blocks: ``blocks [N, K / 32 * B] uint8`` in ``format`` ("q8_0",
    "q4_0", "q4_1"; ``B`` its block bytes), as :func:`poss_ext.ops.qlinear` reads them; ``"q8_0x8"``,
    ``"q4_1x8"``...: the same blocks with rows interleaved by 8 (:meth:`interleaved`)."""

    blocks: Tensor
    format: str

    def __post_init__(self):
        if self.format not in QFORMAT_BLOCK_BYTES:
            raise ValueError(f"format must be one of {', '.join(QFORMAT_BLOCK_BYTES)}, got {self.format!r}")
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2:
            raise ValueError(f"blocks must be a 2-D uint8 tensor, got {self.blocks.dtype} {tuple(self.blocks.shape)}")
        if self.blocks.shape[1] % QFORMAT_BLOCK_BYTES[self.format]:
            raise ValueError(f"blocks.shape[1] = {self.blocks.shape[1]} is not a whole number of "
                             f"{self.format} blocks ({QFORMAT_BLOCK_BYTES[self.format]} bytes)")

    @property
    def file_format(self) -> str:
        """The GGUF block format, whatever the row layout: "q8_0", "q4_0" or "q4_1"."""
        return self.format.removesuffix("x8")

    def interleaved(self) -> "QuantWeight":
        """This weight with rows interleaved by 8 (:func:`poss_ext.ops.interleave_rows8`: the int8 kernels
        then load 8 rows' scales and quant words without a transpose, one stream), or self where it
        already is or N is not a multiple of 8. The same bytes, so no extra memory once self is dropped.

        Measured (bench/bench_qlinear.py --rows 1 8 --acts int8 --clock cpu --parts, SmolLM2-135M's
        shapes, 1 thread, AMD EPYC with AVX512-VNNI, 2026-12-07): Q4_1 layers 5.0 -> 3.4 ms at 1 row of x,
        12.3 -> 10.1 at 8; the Q8_0 lm_head 2.0 -> 1.1 at 1 row."""
        if self.format != self.file_format or self.blocks.shape[0] % 8:
            return self
        return QuantWeight(poss_ext.ops.interleave_rows8(self.blocks, self.format), self.format + "x8")

    def plain(self) -> "QuantWeight":
        """This weight in the file's layout (rows one after another): self, or :meth:`interleaved` undone."""
        if self.format == self.file_format:
            return self
        return QuantWeight(poss_ext.ops.deinterleave_rows8(self.blocks, self.file_format), self.file_format)

    @property
    def shape(self) -> Tuple[int, int]:
        return self.blocks.shape[0], self.blocks.shape[1] // QFORMAT_BLOCK_BYTES[self.format] * QBLOCK

    def check(self, name: str, shape: Optional[Tuple[int, int]] = None) -> "QuantWeight":
        """Raise ``ValueError`` naming ``name`` unless the blocks are ``shape`` ``(N, K)`` (when given) and
        every scale (and Q4_1 min) is finite: at load time, before a forward meets them in
        :func:`poss_ext.ops.qlinear`. Returns self."""
        if shape is not None and tuple(self.shape) != tuple(shape):
            raise ValueError(f"{name}: {self.format} blocks {tuple(self.blocks.shape)} hold a [{self.shape[0]}, "
                             f"{self.shape[1]}] weight, expected [{shape[0]}, {shape[1]}] (K must be a multiple of "
                             f"{QBLOCK}, each row K / {QBLOCK} blocks of {QFORMAT_BLOCK_BYTES[self.format]} bytes)")
        n = self.blocks.shape[0]
        b = self.plain().blocks.reshape(n, -1, QFORMAT_BLOCK_BYTES[self.format])
        fields = {"scale": b[..., 0:2]} | ({"min": b[..., 2:4]} if self.file_format == "q4_1" else {})
        for what, raw in fields.items():
            bad = ~torch.isfinite(raw.contiguous().view(torch.float16))
            if bad.any():
                row, block = (int(i) for i in bad.nonzero()[0][:2])
                raise ValueError(f"{name}: {int(bad.sum())} {self.format} block(s) with an inf or NaN {what}, "
                                 f"the first at row {row}, block {block}")
        return self

    def dequantize(self) -> Tensor:
        """The weights ``[N, K] float32``, exactly as gguf decodes them."""
        return poss_ext.reference.dequantize(self.blocks, self.format)

    @staticmethod
    def stack(parts: Sequence[Optional["QuantWeight"]]) -> Optional["QuantWeight"]:
        """The parts' rows one after another (a fused q|k|v or gate|up weight), or None unless every
        part is blocks of one format and one K."""
        if not parts or any(p is None for p in parts):
            return None
        parts = [p.plain() for p in parts]
        if len({p.format for p in parts}) != 1 or len({p.blocks.shape[1] for p in parts}) != 1:
            return None
        return QuantWeight(torch.cat([p.blocks for p in parts]).contiguous(), parts[0].format)


Weight = Union[Tensor, QuantWeight]

# Block projections quantize their activations to int8 per block of 32 (``qlinear(x_int8=True)``: exact
# integer block dots, maddubs on AVX2), every format, every CPU: on the 2-core AVX2 EPYC, 1 thread, a
# pass over SmolLM2's Q4_1 weights took 15-23 ms at 1 row and 35-50 at 8 with it against 23-31 / 81-132
# with fp32 activations, and never more (bench/bench_qlinear.py, docs/ops.md). The AR loop and the tree
# verify both run this path, so speculation stays token-identical to our AR loop either way;
# ``dtype="auto"`` times the same path (poss.decode.dtype_choice).
X_INT8 = True
# The revision of poss::qlinear's CPU kernels, in the cache keys of timings on blocks (dtype "auto",
# the tree calibration): bump it when their speed changes, so those timings are taken again.
# 2: q4_0 / q4_1 take 8 weight rows a pass (csrc/cpu/qlinear.cpp rows8_micro).
# 3: that pass serves up to 16 rows of x (a tree verify's), each extra row much cheaper.
# 4: the runner's weights interleaved by 8 rows (QuantWeight.interleaved), and an AVX512-VNNI kernel.
# 5: a layer is one poss::qdecoder_layer dispatch.
# 6: the AMX kernel (tile passes for 12+ rows of x); the tree calibration's key names the kernel too.
QLINEAR_REVISION = 6


def project(x: Tensor, w: Weight, bias: Optional[Tensor] = None, residual: Optional[Tensor] = None) -> Tensor:
    """``x [..., K] @ w.T + bias + residual`` -> ``[..., N]`` in x's dtype, for float or block weights."""
    if isinstance(w, QuantWeight):
        return poss_ext.ops.qlinear(x, w.blocks, w.format, bias, residual, x_int8=X_INT8)
    return poss_ext.ops.linear(x, w, bias, residual)


def decoder_layer(x: Tensor, p, k_cache: Tensor, v_cache: Tensor, prefix_len: Tensor, parents: Tensor,
                  positions: Tensor, inv_freq: Tensor, num_heads: int, num_kv_heads: int, eps: float) -> Tensor:
    """:func:`poss_ext.ops.decoder_layer` with ``p`` a :class:`~poss.models.target.LayerParams` whose
    projections may be :class:`QuantWeight`: :func:`poss_ext.ops.qdecoder_layer`, the same ops in the same
    order (csrc/decoder_layer.cpp), one dispatch for the layer.

    ``x [B, T, H]`` -> ``[B, T, H]``; the T new tokens' K/V go to slots ``prefix_len + N - T + t``.
    """
    ws = [p.w_qkv, p.w_o, p.w_gate_up, p.w_down]
    tensors = [w.blocks if isinstance(w, QuantWeight) else w for w in ws]
    formats = [w.format if isinstance(w, QuantWeight) else "" for w in ws]
    return poss_ext.ops.qdecoder_layer(x, p.in_norm_w, tensors[0], p.b_qkv, tensors[1], p.post_norm_w, tensors[2],
                                       tensors[3], formats, X_INT8, k_cache, v_cache, prefix_len, parents,
                                       positions, inv_freq, num_heads, num_kv_heads, eps)
