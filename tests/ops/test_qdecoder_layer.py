"""poss::qdecoder_layer: decoder_layer with GGUF block projections, one dispatch. Against the same ops
called one by one from Python (its definition) bit for bit, with float, plain and interleaved weights
mixed; the cache it writes; its argument checks; opcheck.
"""

import math

import pytest
import torch

import poss_ext
from helpers.qlinear_kernels import random_blocks

I32 = torch.int32
H, F, D, HQ, HKV = 64, 96, 64, 2, 1
SHAPES = {"w_qkv": ((HQ + 2 * HKV) * D, H), "w_o": (H, HQ * D), "w_gate_up": (2 * F, H), "w_down": (H, F)}
NAMES = list(SHAPES)


def layer(formats, B=2, T=3, N=4, S=12, seed=0, dtype=torch.bfloat16):
    """The layer's arguments: projection i float when formats[i] is "", else random blocks in that format
    (interleaved when it ends in "x8"); a chain tree of N nodes whose last T are new."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.1).to(dtype)  # noqa: E731
    ws = {}
    for i, (name, (n, k)) in enumerate(SHAPES.items()):
        fmt = formats[i]
        if not fmt:
            ws[name] = r(n, k)
        else:
            base = fmt.removesuffix("x8")
            blocks = random_blocks(n, k, base, seed + i)
            ws[name] = poss_ext.ops.interleave_rows8(blocks, base) if fmt != base else blocks
    prefix_len = torch.full((B,), 2, dtype=I32)
    return dict(x=r(B, T, H), in_norm_w=r(H) + 1, w_qkv=ws["w_qkv"], b_qkv=r(SHAPES["w_qkv"][0]), w_o=ws["w_o"],
                post_norm_w=r(H) + 1, w_gate_up=ws["w_gate_up"], w_down=ws["w_down"], formats=list(formats),
                x_int8=True, k_cache=r(B, HKV, S, D), v_cache=r(B, HKV, S, D), prefix_len=prefix_len,
                parents=torch.arange(-1, N - 1, dtype=I32).repeat(B, 1),
                positions=prefix_len.long().view(B, 1) + N - T + torch.arange(T),
                inv_freq=1.0 / 10000 ** (torch.arange(0, D, 2).float() / D), num_heads=HQ, num_kv_heads=HKV, eps=1e-5)


def one_by_one(a):
    """The layer as its ops called one at a time (what qdecoder_layer fuses into one dispatch)."""
    ops = poss_ext.ops

    def project(x, name, i, bias=None, residual=None):
        if a["formats"][i]:
            return ops.qlinear(x, a[name], a["formats"][i], bias, residual, x_int8=a["x_int8"])
        return ops.linear(x, a[name], bias, residual)

    x, k_cache, v_cache = a["x"], a["k_cache"], a["v_cache"]
    B, T, _ = x.shape
    N = a["parents"].shape[1]
    x2 = x.reshape(B * T, H)
    h0 = ops.rms_norm(x2, a["in_norm_w"], a["eps"])
    qkv = project(h0, "w_qkv", 0, a["b_qkv"]).view(B, T, -1)
    q = ops.rope_qkv(qkv, a["positions"], a["inv_freq"], k_cache, v_cache, a["prefix_len"] + (N - T),
                     a["num_heads"], a["num_kv_heads"])
    attn = ops.tree_attention(q, k_cache, v_cache, a["prefix_len"], a["parents"], 1.0 / math.sqrt(D))
    m_in, h = ops.add_rms_norm(project(attn.transpose(1, 2).reshape(B * T, HQ * D), "w_o", 1), x2,
                               a["post_norm_w"], a["eps"])
    act = ops.swiglu(project(m_in, "w_gate_up", 2))
    return project(act, "w_down", 3, residual=h).view(B, T, H)


def cloned(a):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()}


@pytest.mark.parametrize("formats", [
    ["q4_1x8"] * 4, ["q4_1"] * 4, ["q8_0x8", "q4_0", "q4_1x8", "q8_0"], ["", "q4_1x8", "", "q8_0"], [""] * 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 3])
def test_same_bits_as_its_ops_one_by_one(formats, dtype, T):
    a = layer(formats, T=T, dtype=dtype, seed=T)
    want_args, got_args = cloned(a), cloned(a)
    want = one_by_one(want_args)
    got = poss_ext.ops.qdecoder_layer(**got_args)
    assert got.shape == a["x"].shape and got.dtype == dtype
    assert torch.equal(got, want)
    assert torch.equal(got_args["k_cache"], want_args["k_cache"])  # the K/V it wrote, too
    assert torch.equal(got_args["v_cache"], want_args["v_cache"])
    assert not torch.equal(got_args["k_cache"], a["k_cache"])


def test_all_float_is_decoder_layer():
    a = layer([""] * 4, dtype=torch.float32)
    plain = {k: v for k, v in cloned(a).items() if k not in ("formats", "x_int8")}
    assert torch.equal(poss_ext.ops.qdecoder_layer(**cloned(a)), poss_ext.ops.decoder_layer(**plain))


@pytest.mark.parametrize("change,match", [
    (dict(formats=["q4_1"] * 3), "formats must hold 4 entries"),
    (dict(formats=["q4_1", "q5_k", "q4_1", "q4_1"]), "format must be one of"),
    (dict(formats=["q8_0", "q4_1", "q4_1", "q4_1"]), r"w_qkv.size\(1\) must equal the input features / 32"),
    (dict(formats=["", "q4_1", "q4_1", "q4_1"]), r"w_qkv.size\(1\) must equal the expected input features"),
])
def test_bad_formats_name_the_weight_before_the_cache_is_written(change, match):
    a = layer(["q4_1"] * 4)
    a.update(change)
    before = a["k_cache"].clone()
    with pytest.raises(RuntimeError, match=match):
        poss_ext.ops.qdecoder_layer(**a)
    assert torch.equal(a["k_cache"], before)


def test_opcheck():
    a = layer(["q4_1x8", "", "q8_0", "q4_0x8"], dtype=torch.float32)
    torch.library.opcheck(torch.ops.poss.qdecoder_layer.default, tuple(a.values()))
