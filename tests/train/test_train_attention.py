"""The aligned multi-step attention (LSE merge of a shifted causal part and diagonal terms) vs the dense
masked version."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from poss.train.aligned_attention import align_masks, aligned_attention, causal_attention_lse, naive_aligned_attention


def rand_inputs(B, H, Hkv, L, D, k, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g, dtype=dtype).requires_grad_()
    ks = [torch.randn(B, Hkv, L, D, generator=g, dtype=dtype).requires_grad_() for _ in range(k + 1)]
    vs = [torch.randn(B, Hkv, L, D, generator=g, dtype=dtype).requires_grad_() for _ in range(k + 1)]
    return q, ks, vs


@settings(max_examples=25, deadline=None)
@given(k=st.integers(0, 6), L=st.integers(1, 20), rep=st.sampled_from([1, 2, 3]), B=st.integers(1, 2),
       seed=st.integers(0, 10**6))
def test_matches_dense_masked_forward_and_backward(k, L, rep, B, seed):
    q, ks, vs = rand_inputs(B, 2 * rep, 2, L, 8, k, seed=seed)
    a = aligned_attention(q, ks, vs)
    b = naive_aligned_attention(q, ks, vs)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    go = torch.randn_like(a)
    inputs = [q] + ks + vs
    ga = torch.autograd.grad((a * go).sum(), inputs, allow_unused=True)
    gb = torch.autograd.grad((b * go).sum(), inputs, allow_unused=True)
    for x, y, t in zip(ga, gb, inputs):  # unused (k >= L: no level-0 column at all) means zero
        x = torch.zeros_like(t) if x is None else x
        y = torch.zeros_like(t) if y is None else y
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-10)


def test_masks_match_the_reference_pattern():
    # docs/algorithm.md §2.4: for F=3, level 0 is tril shifted down by 2, levels 1/2 are eye shifted by 1/0.
    m = align_masks(2, 6)
    L = 6
    assert torch.equal(m[0], torch.ones(L, L, dtype=torch.bool).tril(-2))
    assert torch.equal(m[1], torch.eye(L, dtype=torch.bool).roll(1, 0) & torch.ones(L, L, dtype=torch.bool).tril(-1))
    assert torch.equal(m[2], torch.eye(L, dtype=torch.bool))


def test_proper_minus_inf_masking_rows_are_convex_combinations():
    # With all values = 1 every row must output exactly 1 (weights sum to 1; the reference's 0-logit leak would not).
    q, ks, vs = rand_inputs(1, 4, 2, 12, 8, 3)
    ones = [torch.ones_like(v) for v in vs]
    out = aligned_attention(q * 5, ks, ones)
    torch.testing.assert_close(out, torch.ones_like(out))


def test_step_zero_is_plain_causal_attention():
    q, ks, vs = rand_inputs(2, 4, 4, 10, 8, 0)
    ref = torch.nn.functional.scaled_dot_product_attention(q, ks[0], vs[0], is_causal=True)
    torch.testing.assert_close(aligned_attention(q, ks, vs), ref)


def test_causal_lse_is_the_row_logsumexp():
    q, ks, vs = rand_inputs(1, 2, 2, 7, 4, 0)
    _, lse = causal_attention_lse(q, ks[0], vs[0], 0.5)
    s = (q @ ks[0].transpose(-1, -2)) * 0.5
    ref = torch.logsumexp(s.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf")), -1)
    torch.testing.assert_close(lse, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_close_to_fp64(dtype):
    q, ks, vs = rand_inputs(2, 4, 2, 33, 16, 4)
    ref = naive_aligned_attention(q, ks, vs)
    out = aligned_attention(q.to(dtype), [k.to(dtype) for k in ks], [v.to(dtype) for v in vs])
    assert out.dtype == dtype
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), ref.detach(), rtol=tol, atol=tol)
