"""Bad input to tree_verify gets a clear error naming the argument, never a crash."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import poss_ext


def good(B=2, N=5, V=11):
    parents = torch.tensor([[-1, 0, 0, 1, -2]] * B, dtype=torch.int32)[:, :N]
    tokens = torch.randint(0, V, (B, N))
    logits = torch.randn(B, N, V)
    return dict(
        parents=parents,
        tokens=tokens,
        logits=logits,
        temperature=torch.full((B,), 0.8),
        top_k=torch.zeros(B, dtype=torch.int32),
        top_p=torch.ones(B),
        uniforms=torch.rand(B, N + 1) * 0.99,
        min_p=torch.full((B,), 0.05),
    )


def call(args):
    return poss_ext.tree_verify(**args)


def with_(**changes):
    args = good()
    args.update(changes)
    return args


def test_good_input_runs():
    call(good())


CASES = [
    ("parents", with_(parents=torch.tensor([[-1, 0, 0, 1, -2]] * 2)), "parents must be Int"),
    ("parents", with_(parents=torch.tensor([-1, 0, 0, 1, -2], dtype=torch.int32)), "parents must be 2-D"),
    ("parents", with_(parents=torch.tensor([[0, 0, 0, 1, -2]] * 2, dtype=torch.int32)), r"parents\[0, 0\] must be -1"),
    ("parents", with_(parents=torch.tensor([[-1, 0, 2, 1, -2]] * 2, dtype=torch.int32)),
     r"parents\[0, 2\] = 2 must be in \[0, 2\)"),
    ("parents", with_(parents=torch.tensor([[-1, 0, 5, 1, -2]] * 2, dtype=torch.int32)), r"parents\[0, 2\] = 5"),
    ("parents", with_(parents=torch.tensor([[-1, 0, -2, 1, -2]] * 2, dtype=torch.int32)), "padding nodes"),
    ("parents", with_(parents=torch.tensor([[-1, 0, -7, 1, -2]] * 2, dtype=torch.int32)), r"parents\[0, 2\] = -7"),
    ("tokens", with_(tokens=torch.zeros(2, 5, dtype=torch.int32)), "tokens must be Long"),
    ("tokens", with_(tokens=torch.zeros(2, 4, dtype=torch.int64)), r"tokens.size\(1\) must equal N"),
    ("tokens", with_(tokens=torch.tensor([[1, 2, 11, 3, 0]] * 2)), r"tokens\[0, 2\] = 11 must be in \[0, 11\)"),
    ("tokens", with_(tokens=torch.tensor([[1, 2, -1, 3, 0]] * 2)), r"tokens\[0, 2\] = -1"),
    ("logits", with_(logits=torch.randn(2, 5, 11, dtype=torch.float64)), "logits must be float32, bfloat16 or float16"),
    ("logits", with_(logits=torch.randn(2, 5)), "logits must be 3-D"),
    ("logits", with_(logits=torch.randn(3, 5, 11)), r"logits.size\(0\) must equal B"),
    ("logits", with_(logits=torch.randn(2, 5, 0)), "vocabulary of at least 1"),
    ("temperature", with_(temperature=torch.full((2,), -1.0)), r"temperature\[0\] = -1 must be finite and >= 0"),
    ("temperature", with_(temperature=torch.full((2,), float("nan"))), "temperature"),
    ("temperature", with_(temperature=torch.ones(3)), r"temperature.size\(0\) must equal B"),
    ("temperature", with_(temperature=torch.ones(2, dtype=torch.float64)), "temperature must be Float"),
    ("top_k", with_(top_k=torch.full((2,), -3, dtype=torch.int32)), r"top_k\[0\] = -3 must be >= 0"),
    ("top_k", with_(top_k=torch.zeros(2, dtype=torch.int64)), "top_k must be Int"),
    ("top_p", with_(top_p=torch.zeros(2)), r"top_p\[0\] = 0 must be in \(0, 1\]"),
    ("top_p", with_(top_p=torch.full((2,), 1.5)), r"top_p\[0\] = 1.5"),
    ("min_p", with_(min_p=torch.full((2,), -0.1)), r"min_p\[0\] = -0.1 must be in \[0, 1\]"),
    ("min_p", with_(min_p=torch.full((2,), 1.5)), r"min_p\[0\] = 1.5 must be in \[0, 1\]"),
    ("min_p", with_(min_p=torch.tensor([0.1, float("nan")])), r"min_p\[1\] = nan must be in \[0, 1\]"),
    ("min_p", with_(min_p=torch.full((2,), 0.1, dtype=torch.float64)), "min_p must be Float"),
    ("min_p", with_(min_p=torch.full((3,), 0.1)), r"min_p.size\(0\) must equal B"),
    ("min_p", with_(min_p=torch.full((2, 1), 0.1)), "min_p must be 1-D"),
    ("uniforms", with_(uniforms=None), "uniforms .* is required when any temperature > 0"),
    ("uniforms", with_(uniforms=torch.rand(2, 5)), r"uniforms.size\(1\) must equal N \+ 1"),
    ("uniforms", with_(uniforms=torch.ones(2, 6)), r"uniforms\[0, 0\] = 1 must be in \[0, 1\)"),
    ("uniforms", with_(uniforms=torch.full((2, 6), -0.5)), r"uniforms\[0, 0\] = -0.5"),
    ("logits", with_(logits=torch.full((2, 5, 11), float("nan"))), r"logits\[\d, 0\] contains NaN"),
    ("logits", with_(logits=torch.full((2, 5, 11), float("-inf"))), r"logits\[\d, 0\] has no finite maximum"),
]


@pytest.mark.parametrize("name,args,message", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_names_the_argument(name, args, message):
    with pytest.raises(RuntimeError, match=message) as err:
        call(args)
    assert name in str(err.value)


def test_greedy_nan_row_is_an_error():
    args = with_(temperature=None, uniforms=None)
    args["logits"][0, 0, 3] = float("nan")
    with pytest.raises(RuntimeError, match=r"logits\[0, 0\] contains NaN"):
        call(args)


@pytest.mark.parametrize("name", ["tokens", "min_p"])
def test_device_mismatch_is_an_error(name):
    args = good()
    args[name] = args[name].to("meta")
    with pytest.raises(RuntimeError, match=f"{name} must be on the same device as parents"):
        call(args)


def test_greedy_rows_still_validate_min_p():
    """min_p is checked for every request, even when all of them are greedy (it is then unused)."""
    args = with_(temperature=None, uniforms=None, min_p=torch.full((2,), 2.0))
    with pytest.raises(RuntimeError, match=r"min_p\[0\] = 2 must be in \[0, 1\]"):
        call(args)


def corrupt(rng: np.random.Generator, args: dict) -> dict:
    """One random corruption of a valid call: a value out of range, a shape, a dtype, a NaN."""
    name = rng.choice(list(args))
    t = args[name]
    if t is None:
        return args
    kind = rng.integers(0, 5)
    if kind == 0:  # wrong dtype
        args[name] = t.to(rng.choice([torch.float64, torch.int16, torch.int64, torch.float32]))
    elif kind == 1:  # wrong shape
        args[name] = t.reshape(-1) if t.dim() > 1 else t.unsqueeze(0).repeat(2, 1)
    elif kind == 2:  # truncated
        args[name] = t[..., : max(0, t.shape[-1] - int(rng.integers(1, 3)))]
    elif kind == 3 and t.numel():  # a value out of range
        flat = t.clone().reshape(-1)
        i = int(rng.integers(0, flat.numel()))
        bad = rng.choice([-5, 10**6, -(10**6), 2**31 - 1]) if not t.is_floating_point() else rng.choice(
            [float("nan"), float("inf"), -float("inf"), 7.0, -1.0]
        )
        try:
            flat[i] = bad
        except (RuntimeError, OverflowError):  # the value does not fit this dtype: keep the call as is
            return args
        args[name] = flat.reshape(t.shape)
    else:  # missing
        if name in ("parents", "tokens", "logits"):
            args[name] = torch.empty(0)
        else:
            args[name] = None
    return args


@settings(max_examples=400, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 3))
def test_fuzz_malformed_inputs_never_crash(seed, steps):
    """Random malformed calls either run or raise a Python exception; the process never dies."""
    rng = np.random.default_rng(seed)
    args = good(B=int(rng.integers(1, 4)), N=int(rng.integers(1, 6)), V=int(rng.integers(1, 20)))
    for _ in range(steps):
        args = corrupt(rng, args)
    try:
        accept_nodes, accept_len, next_token = call(args)
    except (RuntimeError, TypeError, ValueError, IndexError):
        return
    # If the corrupted call was still valid, the result must still be well formed.
    B, N = args["parents"].shape
    V = args["logits"].shape[-1]
    assert accept_nodes.shape == (B, N) and ((0 <= accept_len) & (accept_len < N)).all()
    assert ((0 <= next_token) & (next_token < V)).all()
