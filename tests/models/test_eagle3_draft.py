"""EAGLE-3 features: the target runner's multi-layer taps, the ``eagle3`` draft (fused op against its eager
module, save / load, configs) and the clear errors for a draft and a runner that do not fit."""

import json

import pytest
import torch

from helpers.targets import tiny_model
from poss.models.draft import PosSDraft
from poss.models.draft_config import DraftConfig
from poss.models.target import TargetRunner, chain_parents, eagle3_feature_layers

TOL = {torch.float32: 2e-4, torch.bfloat16: 4e-2}
LAYERS = (1, 0, 2)  # hidden-state indices of the 2-layer tiny target, in a scrambled order


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=11)


@pytest.fixture(scope="module")
def runner(model):
    return TargetRunner(model, max_batch=2, max_seq=96)


def make_draft(runner, n=2, seed=0, dtype=torch.float32, draft_vocab=0, layers=LAYERS):
    cfg = DraftConfig.for_target(runner.config, "tiny", runner.fingerprint(), n_specialists=n, fc_bias=False,
                                 features="eagle3", feature_layers=list(layers), draft_vocab=draft_vocab)
    torch.manual_seed(seed)
    d = PosSDraft(cfg)
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.copy_(torch.randn_like(p) * (0.05 if p.dim() == 2 else 0.2) + (1.0 if name.endswith("norm") else 0.0))
        if draft_vocab:
            d.token_map.copy_(torch.randperm(cfg.vocab)[:draft_vocab].sort().values)
    return d.to(dtype)


def test_eagle3_default_layers():
    assert eagle3_feature_layers(32) == (2, 16, 29) and eagle3_feature_layers(30) == (2, 15, 27)
    with pytest.raises(ValueError, match="at least 3 layers"):
        eagle3_feature_layers(2)


def test_runner_taps_are_hf_hidden_states_in_the_same_pass(model, runner):
    prompts = [[5, 9, 2, 200, 17, 4], [8, 3, 1]]
    plain_last, plain = runner.prefill(prompts)
    wide_runner = TargetRunner(model, max_batch=2, max_seq=96, feature_layers=LAYERS)
    assert wide_runner.feature_width == 4 * 256
    last, wide = wide_runner.prefill(prompts)
    # The default path is untouched: the first H columns and the logits are the same bits.
    assert torch.equal(last, plain_last) and torch.equal(wide[..., :256], plain)
    with torch.no_grad():
        hs = model(torch.tensor([prompts[0]]), output_hidden_states=True).hidden_states
    for slot, i in enumerate(LAYERS):
        got = wide[0, :6, 256 * (slot + 1): 256 * (slot + 2)]
        torch.testing.assert_close(got, hs[i][0], rtol=1e-4, atol=1e-4)
    assert torch.equal(wide_runner.logits(wide[:, :3]), wide_runner.logits(plain[:, :3]))


@pytest.mark.parametrize("bad,match", [((0, 3), r"3 is not a hidden-state index in \[0, 2\]"), ((), "at least one"),
                                       ((1, -1), "-1 is not")])
def test_runner_refuses_bad_feature_layers(model, bad, match):
    with pytest.raises(ValueError, match=match):
        TargetRunner(model, max_batch=1, max_seq=8, feature_layers=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 9])
def test_fused_step_matches_eager_module(runner, dtype, T):
    runner.set_feature_layers(LAYERS)
    draft = make_draft(runner, dtype=dtype).attach(runner, max_batch=2, max_seq=96)
    gen = torch.Generator().manual_seed(T)
    H, B, P = 256, 2, [11, 23]
    zero = torch.zeros(B, dtype=torch.int32)
    target_feats = torch.randn(B, max(P), 4 * H, generator=gen).to(dtype)
    g = draft.draft_input(target_feats)
    assert g.shape == (B, max(P), H)
    with torch.no_grad():  # fc over the three layers' columns (the final-norm ones are not read)
        torch.testing.assert_close(g.float(), (target_feats[..., H:].float() @ draft.fc.weight.float().t()),
                                   rtol=TOL[dtype], atol=TOL[dtype])
    j = 1
    draft.step(j, torch.randint(0, 300, (B, max(P)), generator=gen), g, torch.arange(max(P)).expand(B, -1).contiguous(),
               chain_parents(P, max(P)), zero)
    k0, v0 = draft.caches.k.clone(), draft.caches.v.clone()
    prefix = torch.tensor(P, dtype=torch.int32)
    parents = torch.tensor([[-1] + list(range(T - 1))] * B, dtype=torch.int32)
    tok = torch.randint(0, 300, (B, T), generator=gen)
    hidden = torch.randn(B, T, H, generator=gen).to(dtype) * 3
    pos = prefix.long().view(B, 1) + torch.arange(T)
    fused = draft.step(j, tok, hidden, pos, parents, prefix)
    kf = draft.caches.k.clone()
    draft.caches.k.copy_(k0)
    draft.caches.v.copy_(v0)
    with torch.no_grad():
        eager = draft.step(j, tok, hidden, pos, parents, prefix, eager=True)
    tol = TOL[dtype]
    torch.testing.assert_close(fused.float(), eager.float(), rtol=tol, atol=tol * float(eager.abs().max()))
    torch.testing.assert_close(kf.float(), draft.caches.k.float(), rtol=tol, atol=tol)
    assert torch.equal(kf[0], k0[0])  # the other specialist's cache untouched
    # The draft scores with its own norm and head.
    with torch.no_grad():
        n = fused.float() * torch.rsqrt(fused.float().pow(2).mean(-1, keepdim=True) + 1e-5) * draft.norm.float()
        want = torch.log_softmax(n @ draft.lm_head.weight.float().t(), -1)
    torch.testing.assert_close(draft.log_probs(fused), want, rtol=tol, atol=tol * 10)
    runner.set_feature_layers(None)


def test_save_load_roundtrip_keeps_the_own_head(runner, tmp_path):
    draft = make_draft(runner, draft_vocab=50)
    draft.save(tmp_path)
    back = PosSDraft.load(tmp_path)
    assert back.config == draft.config and back.config.features == "eagle3"
    sd, bd = draft.state_dict(), back.state_dict()
    assert set(sd) == set(bd) and {"norm", "lm_head.weight", "token_map", "layers.1.hidden_norm"} <= set(bd)
    assert bd["lm_head.weight"].shape == (50, 256) and bd["fc.weight"].shape == (256, 3 * 256)
    assert all(torch.equal(sd[k], bd[k]) for k in sd)
    with pytest.raises(ValueError, match="own head"):
        PosSDraft.load(tmp_path, vocab="full")


def test_an_old_config_loads_as_a_last_feature_draft(runner, tmp_path):
    cfg = DraftConfig.for_target(runner.config, "tiny", runner.fingerprint())
    PosSDraft(cfg).save(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    for k in ("features", "feature_layers"):
        data.pop(k)
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert PosSDraft.load(tmp_path).config.features == "last"


@pytest.mark.parametrize("kw,match", [
    (dict(features="eagle2"), "features must be one of last, eagle3"),
    (dict(features="last", feature_layers=[1]), "feature_layers needs features 'eagle3'"),
    (dict(features="eagle3", fc_per_specialist=True, n_specialists=2), "fc_per_specialist must be false"),
    (dict(features="eagle3", feature_layers=[1, -2]), "non-negative"),
])
def test_bad_configs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        DraftConfig(hidden=8, heads=2, kv_heads=1, head_dim=4, ffn=8, vocab=10, **kw)


def test_a_draft_and_a_runner_that_do_not_fit_are_clear_errors(model, runner):
    draft = make_draft(runner)
    runner.set_feature_layers(None)
    with pytest.raises(ValueError, match=r"fuses the target's hidden states \[1, 0, 2\].*only its final-norm"):
        draft.attach(runner, 1, 16)
    runner.set_feature_layers((0, 1, 2))
    with pytest.raises(ValueError, match=r"\[1, 0, 2\].*returns layers \[0, 1, 2\]"):
        draft.attach(runner, 1, 16)
    runner.set_feature_layers(LAYERS)
    draft.attach(runner, 1, 16)
    with pytest.raises(ValueError, match="1024 features per token.*got 256"):
        draft.draft_input(torch.zeros(1, 3, 256))  # a runner's final-norm features only
    runner.set_feature_layers(None)
    # A final-norm draft reads the first H columns of a runner that returns more.
    cfg = DraftConfig.for_target(runner.config, "tiny", runner.fingerprint())
    wide = torch.randn(1, 3, 1024)
    assert torch.equal(PosSDraft(cfg).draft_input(wide), wide[..., :256])


def test_poss_load_runs_an_eagle3_draft_folder_losslessly(tmp_path):
    """``poss.load(target, draft=FOLDER)`` sets the runner's layers from the draft, then decodes as the AR loop."""
    import poss
    from helpers.targets import tiny_chat_folder
    from poss.decode.params import TreeParams
    from poss.testing import random_draft

    root = tiny_chat_folder(tmp_path)
    from transformers import AutoModelForCausalLM

    runner = TargetRunner(AutoModelForCausalLM.from_pretrained(root / "target"), 1, 64)
    random_draft(runner, n=3, ppl=1, aligned=True, features="eagle3", feature_layers=(2, 0, 1)).save(tmp_path / "d")
    kw = dict(dtype=torch.float32, tree=TreeParams(num_nodes=12, depth=4, beam_width=4), speculate_max_batch=None,
              datastore=None, threads=1)
    gen = poss.load(root / "target", draft=tmp_path / "d", **kw)
    assert gen.runner.feature_layers == (2, 0, 1) and gen.draft.config.features == "eagle3"
    prompts = ["Hello there", "What is two plus two?"]
    got = gen.generate(prompts, 24)
    want = poss.load(root / "target", **kw).generate(prompts, 24)
    assert got.token_ids == want.token_ids and all(s.draft_tokens > 0 for s in got.stats)  # it drafted
