"""Op boundaries: empty inputs, bad values caught before a cache is written, overlapping caches,
the fake kernels' strides, and the argument checks of the reference fallbacks.

Bad-input tests check the error type, that the message names the argument, and that no cache was
written; empty-input tests compare against poss_ext.reference.
"""

import pytest
import torch

from poss_ext import fallback, ops, reference

I32 = torch.int32
H, D_DEFAULT, F = 16, 64, 8


def layer_args(B=2, T=2, N=3, S=8, D=D_DEFAULT, Hq=2, Hkv=1, prefix=1, parents=None, x=None, seed=0):
    """decoder_layer's arguments in schema order: a chain tree of N nodes whose last T are new."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    prefix_len = torch.full((B,), prefix, dtype=I32) if isinstance(prefix, int) else torch.tensor(prefix, dtype=I32)
    return dict(
        x=r(B, T, H) if x is None else x, in_norm_w=r(H) + 1,
        w_qkv=r((Hq + 2 * Hkv) * D, H), b_qkv=r((Hq + 2 * Hkv) * D),
        w_o=r(H, Hq * D), post_norm_w=r(H) + 1, w_gate_up=r(2 * F, H), w_down=r(H, F),
        k_cache=r(B, Hkv, S, D), v_cache=r(B, Hkv, S, D), prefix_len=prefix_len,
        parents=torch.arange(-1, N - 1, dtype=I32).repeat(B, 1) if parents is None else parents,
        positions=(prefix_len.long().view(B, 1) + N - T + torch.arange(T)).clamp(min=0),
        inv_freq=1.0 / 10000 ** (torch.arange(0, D, 2).float() / D), num_heads=Hq, num_kv_heads=Hkv, eps=1e-5)


def specialist_args(embeds=None, **kw):
    """specialist_forward's arguments in schema order, around the same layer."""
    a = layer_args(**kw)
    g = torch.Generator().manual_seed(1)
    B, T, _ = a["x"].shape
    return dict(embeds=a["x"] if embeds is None else embeds, features=torch.randn(B, T, H, generator=g) * 0.1,
                fc_w=torch.randn(H, 2 * H, generator=g) * 0.1, fc_b=torch.randn(H, generator=g) * 0.1,
                **{k: a[k] for k in ("w_qkv", "w_o", "post_norm_w", "w_gate_up", "w_down", "k_cache", "v_cache",
                                     "prefix_len", "parents", "positions", "inv_freq", "num_heads", "num_kv_heads",
                                     "eps")})


def cloned(a):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()}


# ---- decoder_layer / specialist_forward without new tokens -------------------------------------


@pytest.mark.parametrize("B,T", [(2, 0), (0, 2), (0, 0)])
@pytest.mark.parametrize("op", ["decoder_layer", "specialist_forward"])
def test_no_new_tokens_give_the_references_empty_output_and_leave_the_cache(op, B, T):
    a = layer_args(B=B, T=T) if op == "decoder_layer" else specialist_args(B=B, T=T)
    b, before = cloned(a), cloned(a)
    got = getattr(torch.ops.poss, op)(*a.values())
    want = getattr(reference, op)(*b.values())
    assert got.shape == want.shape == (B, T, H) and got.dtype == want.dtype
    assert got.is_contiguous()
    assert torch.equal(a["k_cache"], before["k_cache"]) and torch.equal(a["v_cache"], before["v_cache"])


# ---- decoder_layer checks everything before rope_qkv writes the cache ------------------------


def _star(N):
    p = torch.zeros(1, N, dtype=I32)
    p[0, 0] = -1
    return p


BAD_LAYER_INPUTS = [
    ("prefix_len", dict(prefix=-1)),
    ("prefix_len", dict(prefix=[1, 6])),  # 6 + N = 9 > S = 8
    ("prefix_len", dict(prefix=2**31 - 1)),  # prefix_len + N - T overflows int32
    ("parents", dict(parents=torch.tensor([[-1, 0, 1], [0, 0, 1]], dtype=I32))),  # root
    ("parents", dict(parents=torch.tensor([[-1, 0, 1], [-1, 5, 1]], dtype=I32))),  # out of range
    ("parents", dict(parents=torch.tensor([[-1, 0, 1], [-1, -2, 1]], dtype=I32))),  # padding not last
    ("parents", dict(B=1, T=1, N=300, S=302, parents=_star(300))),  # general tree over 256 nodes
    ("k_cache", dict(D=32)),  # no attention kernel for this head dim
    ("k_cache", dict(N=3, S=2, prefix=0)),  # S < N
]


@pytest.mark.parametrize("name,kw", BAD_LAYER_INPUTS)
def test_decoder_layer_checks_before_writing_the_cache(name, kw):
    a = layer_args(**kw)
    before = cloned(a)
    with pytest.raises(RuntimeError, match=name) as e:
        torch.ops.poss.decoder_layer(*a.values())
    # Named as decoder_layer's arguments, not as its inner ops' (q, start).
    assert "q.size" not in str(e.value) and "start[" not in str(e.value)
    assert torch.equal(a["k_cache"], before["k_cache"]) and torch.equal(a["v_cache"], before["v_cache"])


@pytest.mark.parametrize("name,kw", BAD_LAYER_INPUTS[:5])
def test_specialist_forward_checks_before_writing_the_cache(name, kw):
    a = specialist_args(**kw)
    before = cloned(a)
    with pytest.raises(RuntimeError, match=name):
        torch.ops.poss.specialist_forward(*a.values())
    assert torch.equal(a["k_cache"], before["k_cache"]) and torch.equal(a["v_cache"], before["v_cache"])


@pytest.mark.parametrize("name", ["k_cache", "v_cache", "positions", "inv_freq"])
def test_decoder_layer_names_an_argument_on_another_device(name):
    a = layer_args()
    a[name] = a[name].to("meta")
    # The registered kernel itself, as a CPU call reaches it (the meta tensor would otherwise pick
    # the fake kernel).
    with pytest.raises(RuntimeError, match=f"{name} must be on the same device as x"):
        torch.ops.poss.decoder_layer.default.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU),
                                                       *a.values())


# ---- fake kernels: the real kernels' contiguous outputs ----------------------------------------


def test_opcheck_with_a_non_contiguous_x():
    x = torch.randn(16, 3).t()  # [3, 16], column-major
    assert not x.is_contiguous()
    w = torch.randn(16)
    torch.library.opcheck(torch.ops.poss.rms_norm.default, (x, w, 1e-5))
    torch.library.opcheck(torch.ops.poss.add_rms_norm.default, (x, torch.randn(3, 16), w, 1e-5))
    xl = (torch.randn(H, 3, 2) * 0.1).permute(2, 1, 0)  # [B, T, H] with strides (1, 2, 6)
    assert not xl.is_contiguous()
    torch.library.opcheck(torch.ops.poss.decoder_layer.default, tuple(layer_args(T=3, x=xl).values()))
    torch.library.opcheck(torch.ops.poss.specialist_forward.default, tuple(specialist_args(T=3, embeds=xl).values()))


# ---- linear with an empty dimension -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias,residual", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("lead,K,N", [((2, 3), 0, 5), ((2, 3), 4, 0), ((0, 3), 4, 5)])
def test_linear_with_an_empty_dimension_matches_the_reference(dtype, bias, residual, lead, K, N):
    # K = 0: bias + residual (F.linear gives bias), as an empty sum.
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*lead, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    r = torch.randn(*lead, N, generator=g).to(dtype) if residual else None
    got = torch.ops.poss.linear(x, w, b, r)
    assert got.shape == (*lead, N) and got.dtype == dtype
    torch.testing.assert_close(got, reference.linear(x, w, b, r), rtol=0, atol=0)
    if not residual:
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=0, atol=0)


# ---- overlapping caches ------------------------------------------------------------------------


def _kv_compact_args():
    return (torch.tensor([1], dtype=I32), torch.tensor([[0, 2, 3, -1]], dtype=I32), torch.tensor([2], dtype=I32))


@pytest.mark.parametrize("which", ["k_cache", "v_cache"])
def test_kv_compact_rejects_a_cache_with_internal_overlap(which):
    base = torch.arange(32.0).view(1, 1, 1, 8, 4)
    other = torch.randn(2, 1, 1, 8, 4)
    expanded = base.expand(2, 1, 1, 8, 4)  # both layers are the same memory
    k, v = (expanded, other) if which == "k_cache" else (other, expanded)
    base0, other0 = base.clone(), other.clone()
    with pytest.raises(RuntimeError, match=f"{which} must not have internal memory overlap"):
        torch.ops.poss.kv_compact(k, v, *_kv_compact_args())
    assert torch.equal(base, base0) and torch.equal(other, other0)


def _rope_args(k_cache, v_cache, start=0):
    g = torch.Generator().manual_seed(0)
    B, Hkv, S, D = k_cache.shape
    return (torch.randn(B, 2, (2 + 2 * Hkv) * D, generator=g), torch.zeros(B, 2, dtype=torch.long),
            torch.rand(D // 2, generator=g), k_cache, v_cache, torch.full((B,), start, dtype=I32), 2, Hkv)


def _partial_overlap():
    buf = torch.zeros(1 * 1 * 4 * 8 + 8)
    return buf[:32].view(1, 1, 4, 8), buf[8:].view(1, 1, 4, 8)  # v's slot s is k's slot s + 1


@pytest.mark.parametrize("make,message", [
    (lambda: (lambda c: (c, c))(torch.zeros(1, 1, 4, 8)), "v_cache must not share memory with k_cache"),
    (_partial_overlap, "v_cache must not share memory with k_cache"),
    (lambda: (torch.zeros(1, 1, 1, 8).expand(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)),
     "k_cache must not have internal memory overlap"),
    (lambda: (torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 1, 8).expand(1, 1, 4, 8)),
     "v_cache must not have internal memory overlap"),
])
def test_rope_qkv_rejects_overlapping_caches(make, message):
    k, v = make()
    k0, v0 = k.clone(), v.clone()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.poss.rope_qkv(*_rope_args(k, v))
    assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.mark.parametrize("index,name", [(1, "positions"), (2, "inv_freq"), (3, "k_cache"), (4, "v_cache"),
                                        (5, "start")])
def test_rope_qkv_names_the_argument_on_another_device(index, name):
    args = list(_rope_args(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)))
    args[index] = args[index].to("meta")
    with pytest.raises(RuntimeError, match=f"{name} must be on the same device as qkv"):
        torch.ops.poss.rope_qkv.default.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args)


# ---- the references behind the kernels' checks (the fallback for a device without kernels) -----


def _tv(parents, tokens, V=8, temperature=None, top_k=None, top_p=None, uniforms=None, min_p=None):
    parents = torch.tensor(parents, dtype=I32)
    B, N = parents.shape
    logits = torch.randn(B, N, V, generator=torch.Generator().manual_seed(0))
    if temperature is not None and uniforms is None:
        uniforms = torch.full((B, N + 1), 0.5)
    f = lambda v, dt: None if v is None else torch.tensor(v, dtype=dt)  # noqa: E731
    return (parents, torch.tensor(tokens), logits, f(temperature, torch.float32), f(top_k, I32),
            f(top_p, torch.float32), uniforms if not isinstance(uniforms, list) else torch.tensor(uniforms),
            f(min_p, torch.float32))


def _ta(parents=((-1, 0, 1),), prefix=(2,), scale=0.125, D=64, Hq=2, Hkv=1, S=8, Nq=None, v_dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    parents = torch.tensor(parents, dtype=I32)
    B, N = parents.shape
    return (torch.randn(B, Hq, N if Nq is None else Nq, D, generator=g), torch.randn(B, Hkv, S, D, generator=g),
            torch.randn(B, Hkv, S, D, generator=g).to(v_dtype), torch.tensor(prefix, dtype=I32), parents, scale)


def _bt(parents=((-1, -1, 0, 2),), scores=((-1.0, -2.0, -1.5, -3.0),), num_nodes=3, scores_dtype=torch.float32):
    return (torch.tensor([[5, 6, 7, 8]]), torch.tensor(scores, dtype=scores_dtype), torch.tensor(parents, dtype=I32),
            torch.tensor([9]), num_nodes)


def _kv(k=None, v=None, prefix=1, nodes=(0, 2, 3, -1), length=2):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 1, 1, 8, 4, generator=g) if k is None else k
    v = torch.randn(2, 1, 1, 8, 4, generator=g) if v is None else v
    return (k, v, torch.tensor([prefix], dtype=I32), torch.tensor([nodes], dtype=I32),
            torch.tensor([length], dtype=I32))


def _same(make):
    c = make()
    return c, c


FALLBACK_CASES = [
    # tree_verify: a negative token id is an error, not Python's index from the end.
    ("tree_verify", lambda: _tv([[-1, 0]], [[1, -1]], temperature=[1.0]), "tokens"),
    ("tree_verify", lambda: _tv([[-1, 0, -5]], [[1, 2, -1]], temperature=[1.0]), "parents"),
    ("tree_verify", lambda: _tv([[-1, 0]], [[1, 8]]), "tokens"),
    ("tree_verify", lambda: _tv([[0, 0]], [[1, 2]]), "parents"),
    ("tree_verify", lambda: _tv([[-1, -2, 0]], [[1, 2, 3]]), "parents"),
    ("tree_verify", lambda: _tv([[-1, 0]], [[1, 2]], temperature=[-1.0]), "temperature"),
    ("tree_verify", lambda: _tv([[-1, 0]], [[1, 2]], temperature=[float("nan")]), "temperature"),
    ("tree_verify", lambda: _tv([[-1, 0]], [[1, 2]], temperature=[1.0], top_k=[-1]), "top_k"),
    ("tree_verify", lambda: _tv([[-1, 0]], [[1, 2]], temperature=[1.0], top_p=[0.0]), "top_p"),
    ("tree_verify", lambda: _tv([[-1, 0]], [[1, 2]], temperature=[1.0], min_p=[2.0]), "min_p"),
    ("tree_verify", lambda: _tv([[-1, 0]], [[1, 2]], temperature=[1.0], uniforms=[[0.5, 1.0, 0.5]]), "uniforms"),
    ("tree_verify", lambda: _tv([[-1, 0]], [[1, 2]], temperature=[1.0], uniforms=[[0.5, 0.5]]), "uniforms"),
    ("tree_verify", lambda: _tv([[-1, 0]], [[1, 2]])[:3] + (torch.tensor([1.0]),), "uniforms"),
    ("tree_verify", lambda: (lambda a: (a[0], a[1], a[2].double()))(_tv([[-1, 0]], [[1, 2]])), "logits"),
    ("tree_verify", lambda: (lambda a: (a[0], a[1][:, :1], a[2]))(_tv([[-1, 0]], [[1, 2]])), "tokens"),
    # tree_attention: parents like -3 and a negative scale are errors.
    ("tree_attention", lambda: _ta(parents=((-1, 0, -3),)), "parents"),
    ("tree_attention", lambda: _ta(scale=-1.0), "scale"),
    ("tree_attention", lambda: _ta(scale=float("nan")), "scale"),
    ("tree_attention", lambda: _ta(prefix=(6,)), "prefix_len"),
    ("tree_attention", lambda: _ta(prefix=(-1,)), "prefix_len"),
    ("tree_attention", lambda: _ta(D=32), "q"),
    ("tree_attention", lambda: _ta(Hq=3, Hkv=2), "k_cache"),
    ("tree_attention", lambda: _ta(Nq=4), "q"),
    ("tree_attention", lambda: _ta(v_dtype=torch.float64), "v_cache"),
    ("tree_attention", lambda: _ta(parents=_star(300).tolist(), S=302, Nq=1), "parents"),
    # build_tree
    ("build_tree", lambda: _bt(parents=((-1, -3, 0, 2),)), "cand_parents"),
    ("build_tree", lambda: _bt(parents=((-1, -2, 1, 2),)), "cand_parents"),
    ("build_tree", lambda: _bt(scores=((-1.0, float("nan"), -1.5, -3.0),)), "cand_scores"),
    ("build_tree", lambda: _bt(num_nodes=0), "num_nodes"),
    ("build_tree", lambda: _bt(scores_dtype=torch.float64), "cand_scores"),
    # kv_compact
    ("kv_compact", lambda: _kv(k=torch.randn(1, 1, 1, 8, 4).expand(2, 1, 1, 8, 4)), "k_cache"),
    ("kv_compact", lambda: _kv(*_same(lambda: torch.randn(2, 1, 1, 8, 4))), "v_cache"),
    ("kv_compact", lambda: _kv(k=torch.randn(2, 1, 1, 4, 8).transpose(3, 4)), "k_cache"),
    ("kv_compact", lambda: _kv(length=-1), "accept_len"),
    ("kv_compact", lambda: _kv(nodes=(0, 3, 2, 0)), "accept_nodes"),
    ("kv_compact", lambda: _kv(nodes=(-1, 2, 3, 0)), "accept_nodes"),
    ("kv_compact", lambda: _kv(prefix=5), "prefix_len"),
    ("kv_compact", lambda: _kv(prefix=-1), "prefix_len"),
    # decoder-layer ops
    ("linear", lambda: (torch.randn(3, 4), torch.randn(5, 4), torch.randn(4), None), "bias"),
    ("linear", lambda: (torch.randn(3, 4), torch.randn(5, 4), None, torch.randn(3, 4)), "residual"),
    ("linear", lambda: (torch.randn(3, 4), torch.randn(5, 4).double(), None, None), "weight"),
    ("linear", lambda: (torch.ones(3, 4, dtype=I32), torch.ones(5, 4, dtype=I32), None, None), "x"),
    ("rms_norm", lambda: (torch.randn(3, 4), torch.randn(5), 1e-5), "weight"),
    ("rms_norm", lambda: (torch.tensor(1.0), torch.randn(1), 1e-5), "x"),
    ("add_rms_norm", lambda: (torch.randn(3, 4), torch.randn(1, 4), torch.randn(4), 1e-5), "residual"),
    ("swiglu", lambda: (torch.randn(3, 5),), "gate_up"),
    ("rope_qkv", lambda: _rope_args(*_same(lambda: torch.zeros(1, 1, 4, 8))), "v_cache"),
    ("rope_qkv", lambda: _rope_args(*_partial_overlap()), "v_cache"),
    ("rope_qkv", lambda: _rope_args(torch.zeros(1, 1, 1, 8).expand(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)), "k_cache"),
    ("rope_qkv", lambda: _rope_args(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8), start=3), "start"),
    ("rope_qkv", lambda: _rope_args(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8), start=-1), "start"),
    ("rope_qkv", lambda: (lambda a: (a[0], a[1].int()) + a[2:])(
        _rope_args(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8))), "positions"),
    ("rope_qkv", lambda: (lambda a: a[:6] + (3, 1))(_rope_args(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8))),
     "qkv"),
]


@pytest.mark.parametrize("op,make,name", FALLBACK_CASES)
def test_fallback_fails_as_the_kernel_does(op, make, name):
    with pytest.raises(RuntimeError) as kernel_error:
        getattr(torch.ops.poss, op)(*make())
    args = make()
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    with pytest.raises(RuntimeError) as fallback_error:
        fallback.checked(op)(*args)
    assert str(fallback_error.value) == str(kernel_error.value)
    assert name in str(fallback_error.value)
    for a, b in zip([a for a in args if isinstance(a, torch.Tensor)], before):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("op,make", [
    ("tree_verify", lambda: _tv([[-1, 0, 0, 1]], [[1, 2, 3, 4]], temperature=[0.7], top_k=[3], top_p=[0.9])),
    ("tree_attention", lambda: _ta(parents=((-1, 0, 0, -2),))),
    ("build_tree", _bt),
    ("kv_compact", _kv),
    ("linear", lambda: tuple(torch.randn(*s, generator=torch.Generator().manual_seed(i))
                             for i, s in enumerate([(3, 4), (5, 4), (5,), (3, 5)]))),
    ("rope_qkv", lambda: _rope_args(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8), start=2)),
])
def test_fallback_gives_the_reference_result_on_valid_input(op, make):
    a, b = make(), make()
    got, want = fallback.checked(op)(*a), getattr(reference, op)(*b)
    if op == "kv_compact":
        got, want = a[:2], b[:2]
    for x, y in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(x, y)


def test_fallbacks_registered_for_cuda_are_the_checked_references(monkeypatch):
    registered = {}
    monkeypatch.setattr(torch.library, "register_kernel",
                        lambda name, device, fn: registered.setdefault((name, device), fn))
    ops._register_fallbacks({"cuda": False})
    names = {"tree_verify", "build_tree", "kv_compact", "linear", "rms_norm", "add_rms_norm", "swiglu", "rope_qkv"}
    if ops.ATTENTION_BACKEND != "triton":
        names.add("tree_attention")
    assert set(registered) == {(f"poss::{n}", "CUDA") for n in names}
    serve = registered[("poss::tree_verify", "CUDA")]
    with pytest.raises(RuntimeError, match=r"tokens\[0, 1\] = -1 must be in \[0, 8\)"):
        serve(*_tv([[-1, 0]], [[1, -1]], temperature=[1.0]))
