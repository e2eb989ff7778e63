"""rms_norm / add_rms_norm / swiglu / rope_qkv against independent PyTorch expressions.

The expected values are written out here (HF-style formulas, complex-number RoPE), not taken from
poss_ext.reference, so a shared mistake cannot hide.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import poss_ext  # noqa: F401
from helpers.devices import devices

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rms_expected(x, w, eps):
    x64 = x.double()
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def rope_expected(x, positions, inv_freq):
    """x [B, T, H, D] rotated as complex numbers (x_i + i x_{i+D/2}) * exp(i pos f_i), in float64.

    The angle pos * f_i is rounded to fp32 first, as HF computes it (at position 4000 that rounding
    alone moves the result by ~1e-4).
    """
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    ang = (positions.float()[..., None, None] * inv_freq.float()).double()
    z = z * torch.polar(torch.ones_like(ang), ang)
    return torch.cat([z.real, z.imag], -1)


def inv_freq_for(D, theta=10000.0):
    return 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [7, 64, 576, 1000])
def test_rms_norm(device, dtype, H):
    g = torch.Generator().manual_seed(H)
    x = (torch.randn(3, 5, H, generator=g) * 3).to(dtype).to(device)
    w = torch.randn(H, generator=g).to(dtype).to(device)
    out = poss_ext.ops.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out.double(), rms_expected(x, w, 1e-6), rtol=TOL[dtype][0], atol=TOL[dtype][1])


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(device, dtype):
    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(2, 9, 576, generator=g).to(dtype).to(device) for _ in range(2))
    w = torch.randn(576, generator=g).to(dtype).to(device)
    out, s = poss_ext.ops.add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(s, x + r, rtol=0, atol=0)  # one rounding, as the eager sum
    torch.testing.assert_close(out.double(), rms_expected(s, w, 1e-5), rtol=TOL[dtype][0], atol=TOL[dtype][1])


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("F_", [1, 13, 1536])
def test_swiglu(device, dtype, F_):
    g = torch.Generator().manual_seed(F_)
    gu = (torch.randn(4, 3, 2 * F_, generator=g) * 4).to(dtype).to(device)
    out = poss_ext.ops.swiglu(gu)
    gate, up = gu.double()[..., :F_], gu.double()[..., F_:]
    torch.testing.assert_close(out.double(), gate * torch.sigmoid(gate) * up, rtol=TOL[dtype][0], atol=TOL[dtype][1])


def run_rope(device, dtype, B, T, Hq, Hkv, D, S, start, positions, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=g).to(dtype).to(device)
    k_cache = torch.randn(B, Hkv, S, D, generator=g).to(dtype).to(device)
    v_cache = torch.randn(B, Hkv, S, D, generator=g).to(dtype).to(device)
    k0, v0 = k_cache.clone(), v_cache.clone()
    inv_freq = inv_freq_for(D).to(device)
    start_t = torch.tensor(start, dtype=torch.int32, device=device)
    pos = positions.to(device)
    q = poss_ext.ops.rope_qkv(qkv, pos, inv_freq, k_cache, v_cache, start_t, Hq, Hkv)
    heads = qkv.view(B, T, Hq + 2 * Hkv, D)
    tol = dict(rtol=TOL[dtype][0], atol=TOL[dtype][1] * 4)
    torch.testing.assert_close(q.double(), rope_expected(heads[:, :, :Hq], pos, inv_freq).transpose(1, 2), **tol)
    k_exp = rope_expected(heads[:, :, Hq:Hq + Hkv], pos, inv_freq)
    for b in range(B):
        s = start[b]
        torch.testing.assert_close(k_cache[b, :, s:s + T].double(), k_exp[b].transpose(0, 1), **tol)
        torch.testing.assert_close(v_cache[b, :, s:s + T], heads[b, :, Hq + Hkv:].transpose(0, 1), rtol=0, atol=0)
        # Slots outside [start, start + T) are untouched.
        keep = torch.ones(S, dtype=torch.bool)
        keep[s:s + T] = False
        assert torch.equal(k_cache[b, :, keep], k0[b, :, keep]) and torch.equal(v_cache[b, :, keep], v0[b, :, keep])


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128, 18])
def test_rope_qkv(device, dtype, D):
    B, T, S = 2, 5, 40
    positions = torch.tensor([[0, 1, 2, 3, 4], [30, 31, 31, 32, 4000]])
    run_rope(device, dtype, B, T, 9, 3, D, S, [0, 17], positions)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 9), kv=st.integers(1, 3), rep=st.integers(1, 3),
       D=st.sampled_from([2, 8, 32, 64]), data=st.data())
def test_rope_qkv_random(B, T, kv, rep, D, data):
    S = T + data.draw(st.integers(0, 6))
    start = [data.draw(st.integers(0, S - T)) for _ in range(B)]
    positions = torch.tensor([[data.draw(st.integers(0, 9000)) for _ in range(T)] for _ in range(B)])
    run_rope("cpu", torch.float32, B, T, kv * rep, kv, D, S, start, positions, seed=T * 7 + D)


@pytest.mark.parametrize("threads", [1, 2])
def test_rope_qkv_calls_in_a_row_match_their_own_positions_and_frequencies(threads):
    # The CPU kernel keeps the last call's cos / sin tables for the next layer: a call with other
    # positions, or frequencies changed in place, must not reuse them.
    B, T, Hq, Hkv, D, S = 2, 6, 4, 2, 8, 16
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=g)
    kc, vc = torch.zeros(B, Hkv, S, D), torch.zeros(B, Hkv, S, D)
    start = torch.zeros(B, dtype=torch.int32)
    pos = torch.arange(B * T).view(B, T) + 100
    inv_freq = inv_freq_for(D)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(4):
            if step == 1:
                pos[1, 3] += 7
            if step == 2:
                inv_freq.mul_(1.5)  # same storage, new values
            q = poss_ext.ops.rope_qkv(qkv, pos, inv_freq, kc, vc, start, Hq, Hkv)
            expected = rope_expected(qkv.view(B, T, Hq + 2 * Hkv, D)[:, :, :Hq], pos, inv_freq).transpose(1, 2)
            torch.testing.assert_close(q.double(), expected, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(old)


def test_opcheck():
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g)
    w = torch.randn(16, generator=g)
    torch.library.opcheck(torch.ops.poss.rms_norm.default, (x, w, 1e-5))
    torch.library.opcheck(torch.ops.poss.add_rms_norm.default, (x, r, w, 1e-5))
    torch.library.opcheck(torch.ops.poss.swiglu.default, (torch.randn(3, 4, 10, generator=g),))
    qkv = torch.randn(2, 3, (4 + 2 * 2) * 8, generator=g)
    kc, vc = torch.zeros(2, 2, 6, 8), torch.zeros(2, 2, 6, 8)
    pos = torch.tensor([[3, 4, 5], [0, 1, 2]])
    torch.library.opcheck(torch.ops.poss.rope_qkv.default,
                          (qkv, pos, inv_freq_for(8), kc, vc, torch.tensor([3, 0], dtype=torch.int32), 4, 2))


def _rope_args(**kw):
    a = dict(qkv=torch.randn(2, 3, 64), positions=torch.zeros(2, 3, dtype=torch.long), inv_freq=inv_freq_for(8),
             k_cache=torch.zeros(2, 2, 6, 8), v_cache=torch.zeros(2, 2, 6, 8),
             start=torch.zeros(2, dtype=torch.int32), num_heads=4, num_kv_heads=2)
    a.update(kw)
    return a


@pytest.mark.parametrize("name,kw", [
    ("qkv", dict(qkv=torch.randn(2, 3, 63))),
    ("qkv", dict(qkv=torch.randn(2, 3, 64).long())),
    ("positions", dict(positions=torch.zeros(2, 3, dtype=torch.int32))),
    ("positions", dict(positions=torch.zeros(2, 4, dtype=torch.long))),
    ("inv_freq", dict(inv_freq=torch.ones(3))),
    ("k_cache", dict(k_cache=torch.zeros(2, 2, 6, 8).double())),
    ("k_cache", dict(k_cache=torch.zeros(2, 3, 6, 8))),
    ("v_cache", dict(v_cache=torch.zeros(2, 2, 5, 8))),
    ("start", dict(start=torch.zeros(2, dtype=torch.long))),
    ("start", dict(start=torch.tensor([0, 4], dtype=torch.int32))),  # 4 + T > S
    ("start", dict(start=torch.tensor([-1, 0], dtype=torch.int32))),
    ("num_heads", dict(num_heads=3)),
])
def test_rope_qkv_bad_inputs(name, kw):
    with pytest.raises(RuntimeError, match=name):
        torch.ops.poss.rope_qkv(*_rope_args(**kw).values())


@pytest.mark.parametrize("call,name", [
    (lambda: torch.ops.poss.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5), "weight"),
    (lambda: torch.ops.poss.rms_norm(torch.randn(2, 8), torch.randn(8).double(), 1e-5), "weight"),
    (lambda: torch.ops.poss.rms_norm(torch.randn(2, 8).long(), torch.randn(8), 1e-5), "x"),
    (lambda: torch.ops.poss.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-5), "residual"),
    (lambda: torch.ops.poss.swiglu(torch.randn(2, 7)), "gate_up"),
    (lambda: torch.ops.poss.swiglu(torch.randn(2, 8).int()), "gate_up"),
])
def test_bad_inputs_name_the_argument(call, name):
    with pytest.raises(RuntimeError, match=name):
        call()
