"""Greedy generation is lossless: token-identical to ``transformers`` ``generate(do_sample=False)``.

24 prompts (4 from each of the six eval sets), 128 new tokens, fp32, on a tiny random Llama with
random PosS drafts: N = 1 (EAGLE-2) and N = 3 specialists at 2 positions each (PosS-2), both a
plain random draft (it almost never agrees: tau ~ 1) and an "aligned" random draft that agrees
often, so long accepted paths, KV compaction and the specialists' catch-up are exercised too.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.loop import (
    eval_prompts,
    hf_greedy,
    make_generator,
    single_thread,  # noqa: F401  (autouse: one CPU thread)
    tiny_target,
)

NEW = 128
PROMPTS = eval_prompts(n_per_set=4)


@pytest.fixture(scope="module")
def target():
    model = tiny_target()
    # Make a token that greedy decoding reaches mid-way through one prompt the end token, so some
    # requests stop early (at different rounds of a batch) and others run all 128 tokens.
    model.generation_config.eos_token_id = hf_greedy(model, PROMPTS[1], 61)[60]
    return model


@pytest.fixture(scope="module")
def reference(target):
    return [hf_greedy(target, p, NEW) for p in PROMPTS]


def generate_batched(gen, prompts, batch, **kw):
    out, stats = [], []
    for i in range(0, len(prompts), batch):
        res = gen.generate(prompts[i: i + batch], NEW, **kw)
        out += res.token_ids
        stats += res.stats
    return out, stats


def assert_identical(got, want):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"prompt {i}: first difference at token {next(k for k in range(len(g)) if g[k:k+1] != w[k:k+1])}"


def test_prompts_cover_all_six_sets_and_some_stop_early(reference):
    assert len(PROMPTS) == 24
    assert any(len(r) < NEW for r in reference) and any(len(r) == NEW for r in reference)


@pytest.mark.parametrize("batch", [8, pytest.param(1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("n,ppl", [(1, 1), (3, 2)], ids=["eagle2-N1", "poss2-N3"])
@pytest.mark.parametrize("aligned", [False, True], ids=["random", "aligned"])
def test_greedy_matches_hf(target, reference, n, ppl, batch, aligned):
    gen = make_generator(target, draft=True, n=n, ppl=ppl, aligned=aligned)
    got, stats = generate_batched(gen, PROMPTS, batch)
    assert_identical(got, reference)
    for s, r in zip(stats, reference):
        assert s.tokens == len(r) and s.rounds == sum(s.accept_hist) and s.rounds <= s.tokens
    if aligned:  # the run really verified multi-token paths
        assert max(k for s in stats for k, c in enumerate(s.accept_hist) if c) >= 2


# The tiny target has 2 layers: EAGLE-3's default (2, L // 2, L - 3) needs 3, so the drafts fuse the
# embeddings (0), layer 0's output (1) and the last layer's (2), in a scrambled order.
E3_LAYERS = (1, 0, 2)


@pytest.mark.parametrize("n,ppl,draft_vocab", [(1, 1, 0), (3, 2, 0), (1, 1, 150)],
                         ids=["eagle3", "poss2-eagle3", "eagle3-draft-vocab-150"])
@pytest.mark.parametrize("aligned", [False, True], ids=["random", "aligned"])
def test_eagle3_features_greedy_matches_hf(target, reference, n, ppl, draft_vocab, aligned):
    """EAGLE-3 drafts (one layer) and PosS on EAGLE-3 features (3 specialists): the runner returns
    three layers' hidden states beside the final-norm features in the same pass, and the output stays
    the target's greedy decoding."""
    gen = make_generator(target, draft=True, n=n, ppl=ppl, aligned=aligned, features="eagle3",
                         feature_layers=E3_LAYERS, draft_vocab=draft_vocab)
    assert gen.runner.feature_layers == E3_LAYERS and gen.runner.feature_width == 4 * 256
    got, stats = generate_batched(gen, PROMPTS, 8)
    assert_identical(got, reference)
    for s, r in zip(stats, reference):
        assert s.tokens == len(r) and s.rounds == sum(s.accept_hist)
    if aligned:  # the aligned draft's proposals were really accepted, several at a time
        assert max(k for s in stats for k, c in enumerate(s.accept_hist) if c) >= 2


@pytest.mark.parametrize("draft_vocab", [150, 7])
def test_reduced_vocabulary_draft_is_lossless(target, reference, draft_vocab):
    """A draft that proposes only K of the 300 tokens: verification over the full vocabulary keeps
    the output identical (with K = 7 most target tokens are outside the draft's reach)."""
    gen = make_generator(target, draft=True, n=3, ppl=2, aligned=True, draft_vocab=draft_vocab)
    got, stats = generate_batched(gen, PROMPTS, 8, beam_width=min(draft_vocab, 10))
    assert_identical(got, reference)
    drafted = gen.draft.token_map.tolist()
    assert set(drafted) < set(range(300))
    if draft_vocab == 150:
        assert max(k for s in stats for k, c in enumerate(s.accept_hist) if c) >= 2


def test_reduced_vocabulary_draft_loaded_with_the_full_vocabulary_is_lossless(target, reference, tmp_path):
    """The K = 7 draft above, saved and loaded with ``vocab="full"``: the same weights now propose
    tokens outside its 7, so it is accepted far more often, and the output stays identical."""
    import torch

    from poss.models.draft import PosSDraft

    gen = make_generator(target, draft=True, n=3, ppl=2, aligned=True, draft_vocab=7)
    gen.draft.save(tmp_path / "k7")
    small, small_stats = generate_batched(gen, PROMPTS, 8, beam_width=7)
    gen.draft = PosSDraft.load(tmp_path / "k7", dtype=torch.float32, vocab="full").attach(gen.runner, 1, 64)
    got, stats = generate_batched(gen, PROMPTS, 8, beam_width=7)
    assert_identical(small, reference)
    assert_identical(got, reference)
    assert sum(s.rounds for s in stats) < 0.8 * sum(s.rounds for s in small_stats)


def test_autoregressive_baseline_matches_hf(target, reference):
    gen = make_generator(target, draft=False)
    got, stats = generate_batched(gen, PROMPTS, 8)
    assert_identical(got, reference)
    assert all(s.tau == 1.0 for s in stats if s.rounds)


def test_depth_and_tree_size_variants(target, reference):
    gen = make_generator(target, draft=True, n=3, ppl=1, aligned=True)
    for depth, nodes, k in [(1, 4, 3), (3, 8, 2), (8, 40, 4)]:
        got, _ = generate_batched(gen, PROMPTS[:6], 6, depth=depth, num_nodes=nodes, beam_width=k)
        assert_identical(got, reference[:6])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_nodes=st.integers(1, 24), depth=st.integers(0, 7), beam_width=st.integers(1, 12),
       lookup=st.integers(0, 6), batch=st.sampled_from([1, 3]))
def test_any_tree_shape_is_lossless(target, reference, num_nodes, depth, beam_width, lookup, batch):
    """Every tree a caller (or autotune) can ask for, including depth-1 trees wider than their beam
    (the draft tree then ends in padding) with a lookup chain merged in, as CI once hit by chance."""
    gen = make_generator(target, draft=True, n=3, ppl=2, aligned=True)
    if depth == 0 or num_nodes == 1:
        depth, num_nodes = 0, 1
    res = [gen.generate(PROMPTS[i: i + batch], 24, num_nodes=num_nodes, depth=depth, beam_width=beam_width,
                        lookup=lookup).token_ids for i in range(0, 3, batch)]
    assert_identical([t for r in res for t in r], [r[:24] for r in reference[:3]])


@pytest.mark.slow  # Inductor compiles the target and draft steps first (about a minute)
def test_compiled_steps_stay_lossless(target, reference):
    from poss.decode.loader import compile_steps

    gen = compile_steps(make_generator(target, draft=True, n=3, ppl=2, aligned=True))
    out, stats = generate_batched(gen, PROMPTS[:4], 2, num_nodes=8, depth=3)
    assert out == reference[:4]
    assert sum(s.tau for s in stats) / len(stats) > 1.0  # the aligned draft is accepted: real trees ran
