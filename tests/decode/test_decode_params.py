"""SamplingParams / TreeParams: validation in one place, per-request expansion, and min-p reaching
``tree_verify`` only when a request uses it."""

import pytest
import torch

from poss.decode import verify as verify_mod
from poss.decode.draft_tree import root_only_tree
from poss.decode.params import SamplingParams, SamplingTensors, TreeParams, tree_spec
from poss.models.draft_config import DraftConfig
from poss_ext.limits import MAX_CUDA_CANDIDATES, MAX_TREE_NODES


@pytest.mark.parametrize("kw,match", [(dict(temperature=-1), "temperature"), (dict(top_k=-1), "top_k"),
                                      (dict(top_p=2.0), "top_p"), (dict(top_p=0.0), "top_p"),
                                      (dict(min_p=1.5), "min_p"),
                                      # they pass a float64 / Python-int check but break the float32 /
                                      # int32 sampler or the 64-bit seed mid-batch
                                      (dict(temperature=1e-39), "temperature"), (dict(temperature=1e39), "temperature"),
                                      (dict(top_k=2 ** 31), "top_k"), (dict(top_p=1e-50), "top_p"),
                                      (dict(seed=2 ** 64), "seed"), (dict(seed=-1), "seed")])
def test_bad_sampling_parameters_are_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_the_edges_of_the_sampling_ranges_build_their_tensors():
    ps = [SamplingParams(temperature=1e-5, top_k=2 ** 31 - 1, top_p=1e-30, seed=2 ** 64 - 1),
          SamplingParams(temperature=1e4)]
    t = SamplingTensors.build(ps, "cpu")
    assert torch.isfinite(1 / t.temperature).all() and t.top_k[0] == 2 ** 31 - 1 and t.top_p[0] > 0
    torch.Generator().manual_seed(ps[0].seed)


@pytest.mark.parametrize("kw,match", [(dict(num_nodes=0), "num_nodes"),
                                      (dict(num_nodes=MAX_TREE_NODES + 1), "num_nodes"),
                                      (dict(depth=-1), "depth"), (dict(beam_width=0), "beam_width"),
                                      (dict(depth=40, beam_width=10), f"{MAX_TREE_NODES} nodes"),
                                      (dict(depth=11, beam_width=15), str(MAX_CUDA_CANDIDATES))])
def test_bad_tree_parameters_are_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        TreeParams(**kw)


def test_per_request_expansion_and_overrides():
    ps = SamplingParams.per_request(SamplingParams(temperature=0.7, seed=3), 3, top_k=[0, 5, 0], top_p=None)
    assert [p.top_k for p in ps] == [0, 5, 0] and all(p.temperature == 0.7 and p.seed == 3 for p in ps)
    with pytest.raises(ValueError, match="top_p has 2 values for 3 prompts"):
        SamplingParams.per_request(None, 3, top_p=[0.5, 0.6])
    with pytest.raises(TypeError, match="nucleus"):
        SamplingParams.per_request(None, 1, nucleus=0.5)


def test_min_p_reaches_tree_verify_only_when_used(monkeypatch):
    seen = []
    monkeypatch.setattr(verify_mod.poss_ext.ops, "tree_verify", lambda *a, **kw: seen.append(kw) or (None,) * 3)
    tree = root_only_tree(torch.tensor([1, 2]))
    logits, u = torch.zeros(2, 1, 5), torch.rand(2, 2)
    assert SamplingTensors.build([SamplingParams(), SamplingParams(min_p=0.1)], "cpu") is None  # all greedy
    for min_p, want in ((0.0, set()), (0.1, {"min_p"})):
        st = SamplingTensors.build([SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, min_p=min_p)],
                                   "cpu")
        verify_mod.tree_verify(tree, logits, st, u)
        assert set(seen[-1]) == want
    torch.testing.assert_close(seen[-1]["min_p"], torch.tensor([0.0, 0.1]))


def test_draft_config_reads_the_old_key(tmp_path):
    cfg = DraftConfig(hidden=8, heads=2, kv_heads=1, head_dim=4, ffn=16, vocab=10, n_specialists=2,
                      positions_per_specialist=3)
    cfg.save(tmp_path / "config.json")
    text = (tmp_path / "config.json").read_text().replace('"positions_per_specialist"', '"ppl"')
    (tmp_path / "config.json").write_text(text)
    assert DraftConfig.load(tmp_path / "config.json") == cfg


def test_tree_specs_parse_with_and_without_a_chain():
    """``N/D+K`` (the benches' and ``--tree``'s spelling): N nodes, depth D, a K-token lookup chain."""
    assert tree_spec("4/1+4") == TreeParams(num_nodes=4, depth=1, lookup=4)
    assert tree_spec("6/2") == TreeParams(num_nodes=6, depth=2)
    assert tree_spec("1/0+6") == TreeParams(num_nodes=1, depth=0, lookup=6)


@pytest.mark.parametrize("spec", ["4-1", "4/1+", "4/1/2", "0/0", "4/1+-2"])
def test_bad_tree_specs_are_rejected(spec):
    with pytest.raises(ValueError):
        tree_spec(spec)
