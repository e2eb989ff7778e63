"""tree_verify split across the vocabulary (csrc/include/poss/vocab_split.h).

Every vocabulary-wide step runs as per-chunk partials and a combine. Splitting changes only the order
of the mass additions, so with continuous random logits and uniforms any chunk length must give
exactly what one chunk gives (accepted nodes, lengths and tokens), and what the float64 reference
gives. The chi-square test of the split draw, and the wrong combine rules it catches, are in
test_sampling_exact.py.
"""

import contextlib

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


@contextlib.contextmanager
def chunk_len(length: int):
    """Runs tree_verify with vocabulary chunks of `length` tokens (0 = by shape) inside the block."""
    previous = poss_ext.ops.force_vocab_chunk_len(length)
    try:
        yield
    finally:
        poss_ext.ops.force_vocab_chunk_len(previous)


def verify(device, length, parents, tokens, logits, *sampling, min_p=None):
    """tree_verify with chunks of `length` tokens; the three outputs as CPU tensors."""
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    with chunk_len(length):
        got = poss_ext.tree_verify(to(parents), to(tokens), to(logits), *[to(t) for t in sampling],
                                   min_p=to(min_p))
    return [g.cpu() for g in got]


def assert_same(got, want, what):
    for g, w, name in zip(got, want, ("accept_nodes", "accept_len", "next_token")):
        assert torch.equal(g, w), f"{name} differs ({what}):\n{g}\nvs\n{w}"


def case(seed, B, N, V, shape, mode):
    """(parents, tokens, logits, sampling args, min_p) for greedy, sampling or sampling + min-p rows."""
    rng = np.random.default_rng(seed)
    parents, tokens, logits = make_case(rng, B, N, V, shape)
    if mode == "greedy":
        return parents, tokens, logits, (), None
    temperature, top_k, top_p = sampling_params(rng, B, V)
    uniforms = torch.from_numpy(rng.random((B, N + 1), dtype=np.float32))
    min_p = min_p_values(rng, B) if mode == "min-p" else None
    return parents, tokens, logits, (temperature, top_k, top_p, uniforms), min_p


@pytest.mark.parametrize("device", devices())
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    B=st.integers(1, 6),
    N=st.integers(1, 30),
    # 301 and 1000 are not multiples of any chunk length below; 1, 2 and 7 sit inside one chunk of 64.
    V=st.sampled_from([1, 2, 7, 64, 301, 1000]),
    # 1 token per chunk (bounded to 64 chunks: longer ones for V = 301 and 1000), uneven chunks, one
    # chunk longer than V.
    length=st.sampled_from([1, 3, 7, 64, 5000]),
    shape=st.sampled_from(["random", "chain", "star"]),
    dtype=st.sampled_from(DTYPES),
    mode=st.sampled_from(["greedy", "sampling", "min-p"]),
)
def test_any_split_gives_the_one_chunk_result(device, seed, B, N, V, length, shape, dtype, mode):
    parents, tokens, logits, sampling, min_p = case(seed, B, N, V, shape, mode)
    logits = logits.to(dtype)
    one = verify(device, V, parents, tokens, logits, *sampling, min_p=min_p)
    split = verify(device, length, parents, tokens, logits, *sampling, min_p=min_p)
    assert_same(split, one, f"chunks of {length} vs one chunk of {V}")
    want = reference.tree_verify(parents, tokens, logits, *sampling, min_p)
    assert_same(split, want, f"chunks of {length} vs the reference")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("V", [128_256, 300_007])
@pytest.mark.parametrize("mode", ["greedy", "sampling", "min-p"])
def test_split_by_shape_at_llama3_vocabularies(device, V, mode):
    """By shape V = 128,256 splits into 32 chunks of 4,096; V = 300,007 hits the 64-chunk bound and
    grows the chunks to 4,688 tokens (the last one shorter). Both must equal one chunk and the reference."""
    parents, tokens, logits, sampling, min_p = case(7, 3, 12, V, "random", mode)
    by_shape = verify(device, 0, parents, tokens, logits, *sampling, min_p=min_p)
    one = verify(device, V, parents, tokens, logits, *sampling, min_p=min_p)
    assert_same(by_shape, one, "by shape vs one chunk")
    assert_same(by_shape, reference.tree_verify(parents, tokens, logits, *sampling, min_p), "vs the reference")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("length", [1, 2, 3, 4])
def test_greedy_ties_across_chunks_go_to_the_lowest_id(device, length):
    # The maximum 2.0 sits at tokens 4 and 8, and at 1 once the root's child is accepted: the
    # combine must keep the lowest id whichever chunks hold the copies.
    V = 10
    logits = torch.zeros(1, 2, V)
    logits[0, 0, [4, 8]] = 2.0
    logits[0, 1, [1, 9]] = 2.0
    parents = torch.tensor([[-1, 0]], dtype=torch.int32)
    tokens = torch.tensor([[0, 4]])
    nodes, length_out, nxt = verify(device, length, parents, tokens, logits)
    assert nodes.tolist() == [[0, 1]] and length_out.tolist() == [1] and nxt.tolist() == [1]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("length", [1, 2, 3, 5])
@pytest.mark.parametrize(
    "top_k,top_p,min_p",
    [(3, 1.0, 0.0), (4, 1.0, 0.0), (0, 0.6, 0.0), (0, 0.7, 0.0), (5, 0.9, 0.3), (0, 1.0, 0.5), (4, 0.8, 0.2)],
)
def test_thresholds_with_ties_across_chunks(device, length, top_k, top_p, min_p):
    """Top-k / top-p / min-p thresholds over tied logits spread across chunk boundaries: the kept set
    (ties kept) and every draw must equal one chunk's and the reference's, for uniforms over [0, 1)."""
    V = 11
    row = torch.tensor([1.0, 3.0, 0.0, 3.0, 2.0, 3.0, 2.0, -1.0, 2.0, 0.5, 1.0])
    D = 64
    logits = row.expand(D, 1, V).contiguous()
    parents = torch.full((D, 1), -1, dtype=torch.int32)
    tokens = torch.zeros(D, 1, dtype=torch.int64)
    uniforms = ((torch.arange(D, dtype=torch.float32) + 0.5) / D).repeat(2, 1).T.contiguous()
    sampling = (torch.full((D,), 0.9), torch.full((D,), top_k, dtype=torch.int32), torch.full((D,), top_p),
                uniforms)
    mp = torch.full((D,), min_p)
    split = verify(device, length, parents, tokens, logits, *sampling, min_p=mp)
    one = verify(device, V, parents, tokens, logits, *sampling, min_p=mp)
    assert_same(split, one, f"chunks of {length} vs one chunk")
    assert_same(split, reference.tree_verify(parents, tokens, logits, *sampling, mp), "vs the reference")


@pytest.mark.parametrize("B", [1, 3])
def test_cpu_chunks_in_parallel_give_the_same_bits(B):
    """With fewer requests than threads the CPU kernel runs a request's chunks in parallel: the
    combines read the partials in chunk order, so 2 threads give 1 thread's bits."""
    parents, tokens, logits, sampling, min_p = case(11, B, 20, 1000, "random", "min-p")
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(verify("cpu", 7, parents, tokens, logits, *sampling, min_p=min_p))
    finally:
        torch.set_num_threads(threads)
    assert_same(outs[1], outs[0], "2 threads vs 1")


@pytest.mark.parametrize("mode", ["greedy", "sampling"])
def test_nan_in_a_later_chunk_is_an_error(mode):
    # The NaN sits in the third of four chunks: the combine, not only chunk 0, must report it.
    V = 12
    logits = torch.zeros(1, 1, V)
    logits[0, 0, 7] = float("nan")
    parents = torch.tensor([[-1]], dtype=torch.int32)
    tokens = torch.tensor([[0]])
    sampling = () if mode == "greedy" else (torch.ones(1), None, None, torch.full((1, 2), 0.5))
    with pytest.raises(RuntimeError, match="contains NaN"):
        verify("cpu", 3, parents, tokens, logits, *sampling)


def test_a_negative_chunk_length_is_an_error():
    with pytest.raises(RuntimeError, match="len must be >= 0"):
        poss_ext.ops.force_vocab_chunk_len(-1)
    assert poss_ext.ops.force_vocab_chunk_len(0) == 0  # unchanged by the failed call
