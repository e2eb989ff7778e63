"""poss::eagle3_layer_forward: opcheck, the fused op against poss_ext.reference (fp32, bf16, odd shapes),
an independent dense computation, empty inputs, and bad arguments named before the cache is written."""

import pytest
import torch

import poss_ext
from poss_ext import reference


def e3_args(B=2, T=3, N=4, H=256, Hq=4, Hkv=2, D=64, F=96, S=12, dtype=torch.float32, seed=0,
            prefix=(2, 5), parents=((-1, 0, 1, 1), (-1, 0, 0, -2))):
    """The op's arguments in schema order: row 0 a branching tree, row 1 a tree with a padding node."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.1).to(dtype)  # noqa: E731
    prefix_len = torch.tensor(prefix[:B], dtype=torch.int32)
    par = torch.tensor([list(p[:N]) for p in parents[:B]], dtype=torch.int32)
    positions = prefix_len.long().view(B, 1) + torch.tensor([[0, 1, 2, 2][:N]] * B)[:, N - T:]
    return dict(embeds=r(B, T, H), hidden=r(B, T, H) * 10, input_norm_w=r(H) + 1, hidden_norm_w=r(H) + 1,
                w_qkv=r((Hq + 2 * Hkv) * D, 2 * H), w_o=r(H, Hq * D), post_norm_w=r(H) + 1,
                w_gate_up=r(2 * F, H), w_down=r(H, F), k_cache=r(B, Hkv, S, D), v_cache=r(B, Hkv, S, D),
                prefix_len=prefix_len, parents=par, positions=positions,
                inv_freq=1.0 / 10000 ** (torch.arange(0, D, 2).float() / D), num_heads=Hq, num_kv_heads=Hkv,
                eps=1e-6)


def cloned(a):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()}


def dense(a):
    """The layer written out from its definition, with dense masked attention (no poss op, no reference)."""
    e, h = a["embeds"].double(), a["hidden"].double()
    B, T, H = h.shape
    Hq, Hkv, eps = a["num_heads"], a["num_kv_heads"], a["eps"]
    k_cache, v_cache = a["k_cache"].double().clone(), a["v_cache"].double().clone()
    D = k_cache.shape[-1]
    N = a["parents"].shape[1]

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()

    qkv = torch.cat([norm(e, a["input_norm_w"]), norm(h, a["hidden_norm_w"])], -1) @ a["w_qkv"].double().t()
    q, k, v = qkv.view(B, T, Hq + 2 * Hkv, D).split([Hq, Hkv, Hkv], 2)
    ang = a["positions"].double().unsqueeze(-1) * a["inv_freq"].double()
    cos, sin = torch.cat([ang.cos()] * 2, -1).unsqueeze(2), torch.cat([ang.sin()] * 2, -1).unsqueeze(2)
    rot = lambda x: x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin  # noqa: E731
    q, k = rot(q), rot(k)
    out = torch.zeros(B, T, Hq, D, dtype=torch.float64)
    for b in range(B):
        P = int(a["prefix_len"][b])
        k_cache[b, :, P + N - T:P + N] = k[b].transpose(0, 1)
        v_cache[b, :, P + N - T:P + N] = v[b].transpose(0, 1)
        par = a["parents"][b].tolist()
        for t in range(T):
            i = N - T + t
            if par[i] == -2:
                continue  # padding: its output is unspecified
            seen = list(range(P))
            while i >= 0:
                seen.append(P + i)
                i = par[i]
            for hh in range(Hq):
                kv = hh // (Hq // Hkv)
                s = (k_cache[b, kv, seen] @ q[b, t, hh]) / D ** 0.5
                out[b, t, hh] = torch.softmax(s, 0) @ v_cache[b, kv, seen]
    x = h + out.reshape(B, T, Hq * D) @ a["w_o"].double().t()
    gate, up = (norm(x, a["post_norm_w"]) @ a["w_gate_up"].double().t()).chunk(2, -1)
    return x + (torch.nn.functional.silu(gate) * up) @ a["w_down"].double().t()


def test_opcheck():
    torch.library.opcheck(torch.ops.poss.eagle3_layer_forward.default, tuple(e3_args().values()))
    torch.library.opcheck(torch.ops.poss.eagle3_layer_forward.default,
                          tuple(e3_args(dtype=torch.bfloat16, B=1, T=1, N=1, prefix=(0,)).values()))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("shape", [dict(), dict(H=200, Hq=5, Hkv=1, F=37, T=2, S=9, D=80),
                                   dict(B=1, T=1, N=1, prefix=(0,), H=64, Hq=1, Hkv=1, D=64, F=8)])
def test_matches_the_reference_and_writes_the_same_cache(dtype, tol, shape):
    a = e3_args(dtype=dtype, **shape)
    b = cloned(a)
    got = poss_ext.ops.eagle3_layer_forward(**a)
    want = reference.eagle3_layer_forward(**b)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    real = a["parents"][:, -got.shape[1]:] != -2
    torch.testing.assert_close(got[real].float(), want[real].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(a["k_cache"].float(), b["k_cache"].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(a["v_cache"].float(), b["v_cache"].float(), atol=tol, rtol=tol)


def test_the_reference_matches_a_dense_computation():
    a = e3_args()
    want = dense(a)
    got = reference.eagle3_layer_forward(**cloned(a))
    real = a["parents"][:, -got.shape[1]:] != -2
    torch.testing.assert_close(got[real].double(), want[real], atol=1e-5, rtol=1e-5)
    op = poss_ext.ops.eagle3_layer_forward(**cloned(a))
    torch.testing.assert_close(op[real].double(), want[real], atol=1e-5, rtol=1e-5)


def test_the_residual_is_the_hidden_and_the_embedding_comes_first():
    """Swapping the two norms' roles changes the output (the op is not symmetric in its inputs)."""
    a = e3_args()
    base = poss_ext.ops.eagle3_layer_forward(**cloned(a))
    swapped = cloned(a)
    swapped["embeds"], swapped["hidden"] = a["hidden"].clone(), a["embeds"].clone()
    assert not torch.allclose(poss_ext.ops.eagle3_layer_forward(**swapped), base, atol=1e-3)


@pytest.mark.parametrize("B,T", [(2, 0), (0, 2)])
def test_no_new_tokens_leave_the_cache(B, T):
    a = e3_args(B=max(B, 1), T=max(T, 1))
    a["embeds"], a["hidden"] = a["embeds"][:B, :T], a["hidden"][:B, :T]
    if B == 0:
        for k in ("k_cache", "v_cache", "prefix_len", "parents", "positions"):
            a[k] = a[k][:0]
    else:
        a["positions"] = a["positions"][:, :0]
    before = cloned(a)
    got = poss_ext.ops.eagle3_layer_forward(**a)
    assert got.shape == (B, T, 256)
    assert torch.equal(a["k_cache"], before["k_cache"])


@pytest.mark.parametrize("name,kw", [
    ("hidden", dict(hidden=torch.randn(2, 3, 768))),  # the three-layer feature before fc
    ("hidden", dict(hidden=torch.randn(2, 3, 256).double())),
    ("input_norm_w", dict(input_norm_w=torch.randn(255))),
    ("hidden_norm_w", dict(hidden_norm_w=torch.randn(256).half())),
    ("w_qkv", dict(w_qkv=torch.randn(512, 256))),  # over H, not [embedding; hidden]
    ("w_o", dict(w_o=torch.randn(256, 255))),
    ("w_gate_up", dict(w_gate_up=torch.randn(191, 256))),
    ("parents", dict(parents=torch.zeros(2, 2, dtype=torch.int32))),
    ("positions", dict(positions=torch.zeros(2, 3, dtype=torch.int32))),
    ("prefix_len", dict(prefix_len=torch.tensor([2, 9], dtype=torch.int32))),  # tree runs past S
    ("embeds", dict(embeds=torch.randn(2, 3, 256).int())),
])
def test_bad_inputs_name_the_argument_and_leave_the_cache(name, kw):
    a = e3_args()
    a.update(kw)
    before = cloned(a)
    with pytest.raises(RuntimeError, match=name):
        poss_ext.ops.eagle3_layer_forward(**a)
    assert torch.equal(a["k_cache"], before["k_cache"]) and torch.equal(a["v_cache"], before["v_cache"])
