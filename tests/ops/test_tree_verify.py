"""torch.ops.poss.tree_verify against the pure-PyTorch reference, opcheck, and bad input."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import poss_ext
from helpers.devices import devices
from helpers.tree_cases import make_case, min_p_values, sampling_params
from poss_ext import reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def run_both(device, parents, tokens, logits, temperature=None, top_k=None, top_p=None, uniforms=None,
             min_p=None):
    """(op on `device`, reference on the CPU), both as CPU tensors."""
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    got = poss_ext.tree_verify(to(parents), to(tokens), to(logits), to(temperature), to(top_k), to(top_p), to(uniforms),
                               min_p=to(min_p))
    want = reference.tree_verify(parents, tokens, logits, temperature, top_k, top_p, uniforms, min_p)
    return [g.cpu() for g in got], want


def assert_same(got, want):
    for g, w, name in zip(got, want, ("accept_nodes", "accept_len", "next_token")):
        assert torch.equal(g, w), f"{name} differs:\n{g}\nvs reference\n{w}"


@pytest.mark.parametrize("device", devices())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    B=st.integers(1, 12),
    N=st.integers(1, 40),
    V=st.sampled_from([1, 2, 7, 64, 300]),
    shape=st.sampled_from(["random", "chain", "star"]),
    dtype=st.sampled_from(DTYPES),
    mode=st.sampled_from(["greedy", "mixed", "mixed-min-p"]),
)
def test_matches_reference_on_random_trees(device, seed, B, N, V, shape, dtype, mode):
    rng = np.random.default_rng(seed)
    parents, tokens, logits = make_case(rng, B, N, V, shape)
    logits = logits.to(dtype)
    if mode == "greedy":
        got, want = run_both(device, parents, tokens, logits)
    else:
        temperature, top_k, top_p = sampling_params(rng, B, V)
        uniforms = torch.from_numpy(rng.random((B, N + 1), dtype=np.float32))
        min_p = min_p_values(rng, B) if mode == "mixed-min-p" else None
        got, want = run_both(device, parents, tokens, logits, temperature, top_k, top_p, uniforms, min_p)
    assert_same(got, want)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shape", ["random", "chain", "star"])
@pytest.mark.parametrize("mode", ["greedy", "sampling", "min-p"])
def test_thousands_of_trees(device, shape, mode):
    """400 trees per case, 3,600 in all, with many deep accepted paths."""
    rng = np.random.default_rng(1234)
    for _ in range(20):
        B, N, V = 20, int(rng.integers(2, 64)), int(rng.integers(2, 200))
        parents, tokens, logits = make_case(rng, B, N, V, shape, match_prob=0.8)
        if mode == "greedy":
            got, want = run_both(device, parents, tokens, logits)
        else:
            temperature, top_k, top_p = sampling_params(rng, B, V, greedy_frac=0.0)
            uniforms = torch.from_numpy(rng.random((B, N + 1), dtype=np.float32))
            min_p = min_p_values(rng, B) if mode == "min-p" else None
            got, want = run_both(device, parents, tokens, logits, temperature, top_k, top_p, uniforms, min_p)
        assert_same(got, want)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["chain", "random"])
def test_large_trees_and_vocab(device, dtype, shape):
    """N = 256 nodes and a real vocabulary size, greedy and sampling in one batch."""
    rng = np.random.default_rng(7)
    B, N, V = 4, 256, 49152
    parents, tokens, logits = make_case(rng, B, N, V, shape, match_prob=0.9)
    logits = (logits * 3).to(dtype)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3])
    top_k = torch.tensor([0, 50, 0, 1000], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 0.8, 1.0])
    min_p = torch.tensor([0.5, 0.0, 0.05, 0.1])  # the greedy row ignores its min_p
    uniforms = torch.from_numpy(rng.random((B, N + 1), dtype=np.float32))
    got, want = run_both(device, parents, tokens, logits, temperature, top_k, top_p, uniforms, min_p)
    assert_same(got, want)
    if shape == "chain":  # deep paths were exercised, not just the root
        assert int(got[1].max()) >= 10


@pytest.mark.parametrize("device", devices())
def test_greedy_rule_by_hand(device):
    """A tree whose answer is derived by hand: the first matching sibling wins, ties take the lowest id."""
    V = 6
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2, -2]], dtype=torch.int32)
    tokens = torch.tensor([[5, 3, 3, 1, 4, 2, 0]])
    logits = torch.zeros(1, 7, V)
    logits[0, 0, 3] = 2.0  # root predicts 3: nodes 1 and 2 both carry 3, node 1 (first) wins
    logits[0, 1, 1] = 1.0  # node 1 predicts 1: node 3 matches
    logits[0, 3, 2] = logits[0, 3, 4] = 7.0  # tie between 2 and 4 at the leaf: the bonus is 2
    nodes, length, nxt = poss_ext.tree_verify(parents.to(device), tokens.to(device), logits.to(device))
    assert nodes.cpu().tolist() == [[0, 1, 3, -1, -1, -1, -1]]
    assert length.tolist() == [2] and nxt.tolist() == [2]


@pytest.mark.parametrize("device", devices())
def test_uniform_zero_never_accepts_a_zero_mass_child(device):
    """u = 0 must not accept a token that top-k removed, nor draw one as the next token."""
    parents = torch.tensor([[-1, 0]], dtype=torch.int32)
    tokens = torch.tensor([[0, 4]])
    logits = torch.tensor([[[3.0, 2.0, 1.0, 0.0, -1.0]] * 2])
    got = poss_ext.tree_verify(
        parents.to(device), tokens.to(device), logits.to(device),
        torch.tensor([1.0], device=device), torch.tensor([2], dtype=torch.int32, device=device),
        None, torch.zeros(1, 3, device=device),
    )
    assert got[1].tolist() == [0] and got[2].tolist() == [0]


@pytest.mark.parametrize("device", devices())
def test_min_p_rule_by_hand(device):
    """min-p keeps p(x) >= min_p * max p, after top-p, and a rejected child leaves only survivors."""
    V = 4
    # probabilities proportional to 8, 4, 2, 1 at T = 1
    row = torch.log(torch.tensor([8.0, 4.0, 2.0, 1.0]))
    parents = torch.tensor([[-1, 0, 0]], dtype=torch.int32)
    tokens = torch.tensor([[0, 2, 0]])
    logits = row.expand(1, 3, V).contiguous()
    one = torch.ones(1, device=device)

    def run(min_p, u):
        return poss_ext.tree_verify(
            parents.to(device), tokens.to(device), logits.to(device), one, None, None,
            torch.tensor([u], device=device), min_p=None if min_p is None else torch.tensor([min_p], device=device),
        )

    # min_p = 0.3: floor 0.3 * 8 = 2.4 removes tokens 2 and 3; node 1 (token 2) can never be accepted,
    # node 2 (token 0) is accepted with probability 8 / 12.
    nodes, length, nxt = run(0.3, [0.0, 0.0, 0.6, 0.0])
    assert length.tolist() == [1] and nodes.cpu().tolist() == [[0, 2, -1]]
    nodes, length, nxt = run(0.3, [0.0, 0.0, 0.7, 0.99])
    assert length.tolist() == [0] and nxt.tolist() == [1]  # token 0 rejected: only token 1 is left
    # min_p = 0.2: the floor 1.6 keeps token 2, and u = 0 accepts node 1.
    nodes, length, nxt = run(0.2, [0.0, 0.0, 0.0, 0.0])
    assert length.tolist() == [1] and nodes.cpu().tolist() == [[0, 1, -1]]
    # min_p = 0 and no min_p are the same call.
    for u in ([0.0, 0.9, 0.1, 0.5], [0.0, 0.99, 0.99, 0.99]):
        assert [t.tolist() for t in run(0.0, u)] == [t.tolist() for t in run(None, u)]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("top_p,min_p,kept", [(0.52, 0.3, {0, 1}), (0.8, 0.0, {0, 1, 2}), (0.8, 0.4, {0, 1})])
def test_min_p_comes_after_top_p(device, top_p, min_p, kept):
    """min-p measures against the survivors of top-p; the other order would keep only token 0 in the
    first case (min-p keeps {0, 1, 2}, whose renormalised top token, 0.5 / 0.9, alone reaches 0.52)."""
    V = 4
    row = torch.log(torch.tensor([0.5, 0.22, 0.18, 0.1]))
    draws = torch.linspace(0, 0.999, 500).view(-1, 1).repeat(1, 2)  # u[N] sweeps [0, 1)
    B = draws.shape[0]
    _, _, nxt = poss_ext.tree_verify(
        torch.full((B, 1), -1, dtype=torch.int32, device=device), torch.zeros(B, 1, dtype=torch.int64, device=device),
        row.expand(B, 1, V).contiguous().to(device), torch.ones(B, device=device), None,
        torch.full((B,), top_p, device=device), draws.to(device), min_p=torch.full((B,), min_p, device=device),
    )
    assert set(nxt.cpu().tolist()) == kept


def test_opcheck():
    rng = np.random.default_rng(0)
    parents, tokens, logits = make_case(rng, 3, 9, 33, "random")
    temperature, top_k, top_p = sampling_params(rng, 3, 33)
    uniforms = torch.from_numpy(rng.random((3, 10), dtype=np.float32))
    min_p = torch.tensor([0.1, 0.0, 0.5])
    for args in [
        (parents, tokens, logits),
        (parents, tokens, logits.bfloat16(), temperature, top_k, top_p, uniforms),
        (parents, tokens, logits, temperature, top_k, top_p, uniforms, min_p),
    ]:
        torch.library.opcheck(torch.ops.poss.tree_verify.default, args)


def test_compiles_with_torch_compile():
    rng = np.random.default_rng(0)
    parents, tokens, logits = make_case(rng, 2, 6, 17, "random")
    fn = torch.compile(lambda p, t, lg: poss_ext.tree_verify(p, t, lg), fullgraph=True, backend="eager")
    assert_same(fn(parents, tokens, logits), reference.tree_verify(parents, tokens, logits))


@pytest.mark.cuda
@pytest.mark.parametrize("temperature", ["float('nan')", "-1.0"])
def test_cuda_rejects_a_bad_temperature_as_the_cpu_does(temperature, tmp_path):
    # A device assert ends the CUDA context, so the call runs in a process of its own. Before the
    # check moved in front of the greedy branch, a NaN or negative temperature decoded greedily.
    import os
    import subprocess
    import sys
    from pathlib import Path

    # The child imports the same poss_ext as this process (in place or installed), from a neutral cwd.
    env = {**os.environ, "PYTHONPATH": str(Path(poss_ext.__file__).resolve().parents[1])}
    code = f"""
import torch, poss_ext
parents = torch.tensor([[-1, 0]], dtype=torch.int32)
tokens = torch.tensor([[0, 1]])
logits = torch.randn(1, 2, 8)
t = torch.tensor([{temperature}])
for device in ("cpu", "cuda"):
    try:
        out = torch.ops.poss.tree_verify(parents.to(device), tokens.to(device), logits.to(device), t.to(device),
                                         None, None, torch.rand(1, 3).to(device), None)
        torch.cuda.synchronize()
    except RuntimeError as e:
        print(device, "refused:", str(e).splitlines()[0][:200], flush=True)
        continue
    print(device, "accepted", flush=True)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    lines = r.stdout.splitlines()
    assert lines and lines[0].startswith("cpu refused: temperature[0]"), r.stdout + r.stderr
    assert not any(line.startswith("cuda accepted") for line in lines), r.stdout + r.stderr
