"""The depth-aware specialist layout: a schedule of positions per specialist, one fc per specialist,
specialists started from different drafts, per-position loss weights, and rounds that run only the
specialists their depth needs."""

import json

import pytest
import torch

from helpers.loop import eval_prompts, hf_greedy, make_generator, single_thread, tiny_target  # noqa: F401
from helpers.targets import tiny_model
from poss.models.draft import PosSDraft
from poss.models.draft_config import DraftConfig
from poss.models.target import TargetRunner
from poss.testing import random_draft
from poss.train.objective import position_weights

SHAPE = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=300)


def spans(schedule, depth):
    """Independent of DraftConfig: which specialist drafts each position 1..depth under a schedule."""
    owner = [j for j, n in enumerate(schedule) for _ in range(n)]
    return [owner[p - 1] if p <= len(owner) else len(schedule) - 1 for p in range(1, depth + 1)]


@pytest.mark.parametrize("schedule", [[1, 5], [2, 2, 2], [1, 1, 4], [3], [1, 2]])
def test_schedule_maps_positions(schedule):
    c = DraftConfig(**SHAPE, n_specialists=len(schedule), schedule=schedule)
    assert [c.specialist_for(p) for p in range(1, 10)] == spans(schedule, 9)


def test_uniform_schedule_equals_positions_per_specialist():
    a = DraftConfig(**SHAPE, n_specialists=3, positions_per_specialist=2)
    b = DraftConfig(**SHAPE, n_specialists=3, schedule=[2, 2, 2])
    assert [a.specialist_for(p) for p in range(1, 12)] == [b.specialist_for(p) for p in range(1, 12)]


@pytest.mark.parametrize("schedule", [[1], [0, 5], [1, 5, 2]])
def test_bad_schedule_is_refused(schedule):
    with pytest.raises(ValueError, match="schedule"):
        DraftConfig(**SHAPE, n_specialists=2, schedule=schedule)


def test_old_config_without_the_new_keys_loads(tmp_path):
    cfg = json.loads(open("drafts/poss2/config.json").read())
    for key in ("schedule", "fc_per_specialist"):
        cfg.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    c = DraftConfig.load(tmp_path / "config.json")
    assert c.schedule == [] and not c.fc_per_specialist
    assert [c.specialist_for(p) for p in range(1, 7)] == [0, 0, 1, 1, 2, 2]


@pytest.fixture(scope="module")
def runner():
    return TargetRunner(tiny_model("llama", seed=7), max_batch=2, max_seq=160)


def test_untied_fc_is_saved_and_used_per_specialist(runner, tmp_path):
    d = random_draft(runner, n=2, schedule=[1, 5], fc_per_specialist=True, seed=3)
    assert not hasattr(d, "fc") and d.fc_for(0) is not d.fc_for(1)
    assert {k for k in d.state_dict() if k.startswith("fcs.")} == {"fcs.0.weight", "fcs.0.bias", "fcs.1.weight",
                                                                   "fcs.1.bias"}
    d.save(tmp_path / "d")
    back = PosSDraft.load(tmp_path / "d")
    assert back.config == d.config
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], v.to(back.state_dict()[k].dtype)), k
    # The fused op runs specialist j on fc j: the same numbers as the eager module path.
    back.attach(runner, max_batch=1, max_seq=64)
    H = back.config.hidden
    g = torch.Generator().manual_seed(0)
    tok, feat = torch.randint(0, 300, (1, 5), generator=g), torch.randn(1, 5, H, generator=g)
    pos, zero = torch.arange(5).view(1, 5), torch.zeros(1, dtype=torch.int32)
    parents = (torch.arange(5, dtype=torch.int32) - 1).view(1, 5)
    for j in (0, 1):
        fused = back.step(j, tok, feat, pos, parents, zero)
        eager = back.step(j, tok, feat, pos, parents, zero, eager=True)
        torch.testing.assert_close(fused, eager, atol=2e-4, rtol=2e-4)
    other = back.step(1, tok, feat, pos, parents, zero)
    with torch.no_grad():
        back.fcs[1].weight.mul_(2.0)  # changing fc 1 changes specialist 1 only
    assert not torch.allclose(back.step(1, tok, feat, pos, parents, zero), other)


def test_specialists_start_from_different_drafts(runner):
    a, b = random_draft(runner, n=1, seed=1), random_draft(runner, n=1, seed=2)
    cfg = DraftConfig.for_target(runner.config, "tiny", runner.fingerprint(), n_specialists=3, schedule=[1, 2, 3],
                                 fc_per_specialist=True)
    d = PosSDraft.from_layers([a.state_dict(), b.state_dict(), b.state_dict()], cfg)
    sa, sb, sd = a.state_dict(), b.state_dict(), d.state_dict()
    for k in sa:
        if k.startswith("layers.0."):
            rest = k[len("layers.0."):]
            assert torch.equal(sd[f"layers.0.{rest}"], sa[k].float())
            assert torch.equal(sd[f"layers.1.{rest}"], sb[k].float())
            assert torch.equal(sd[f"layers.2.{rest}"], sb[k].float())
    assert torch.equal(sd["fcs.0.weight"], sa["fc.weight"].float())
    assert torch.equal(sd["fcs.2.weight"], sb["fc.weight"].float())
    tied = DraftConfig.for_target(runner.config, "tiny", runner.fingerprint(), n_specialists=2, schedule=[1, 5])
    t = PosSDraft.from_layers([a.state_dict(), b.state_dict()], tied)
    assert torch.equal(t.state_dict()["fc.weight"], sa["fc.weight"].float())


def test_sources_with_different_vocabularies_are_refused(runner):
    a = random_draft(runner, n=1, seed=1, draft_vocab=50)
    b = random_draft(runner, n=1, seed=2, draft_vocab=50)
    cfg = DraftConfig.for_target(runner.config, "tiny", runner.fingerprint(), n_specialists=2, schedule=[1, 5],
                                 draft_vocab=50)
    with pytest.raises(ValueError, match="token_map"):
        PosSDraft.from_layers([a.state_dict(), b.state_dict()], cfg)


NEW = 64
PROMPTS = eval_prompts(n_per_set=2)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize("schedule,untied", [([1, 5], True), ([1, 5], False), ([1, 1, 4], True)])
def test_depth_aware_layout_is_lossless(target, schedule, untied):
    want = [hf_greedy(target, p, NEW) for p in PROMPTS]
    gen = make_generator(target, draft=True, n=len(schedule), schedule=schedule, fc_per_specialist=untied,
                         aligned=True)
    got = []
    for i in range(0, len(PROMPTS), 4):
        got += gen.generate(PROMPTS[i:i + 4], NEW).token_ids
    assert got == want


@pytest.mark.parametrize("depth,expected", [(1, {0}), (2, {0, 1}), (6, {0, 1})])
def test_a_round_runs_only_the_specialists_its_depth_needs(target, depth, expected):
    gen = make_generator(target, draft=True, n=2, schedule=[1, 5], fc_per_specialist=True, aligned=True)
    ran = set()
    step = gen.draft.step

    def spy(j, *a, **k):
        ran.add(j)
        return step(j, *a, **k)

    gen.draft.step = spy
    gen.generate(PROMPTS[:2], 16, depth=depth, num_nodes=8, beam_width=2)
    assert ran == expected


def test_position_weights_forms():
    assert position_weights("uniform", 4) is None
    assert position_weights("eagle3", 3) == pytest.approx([1.0, 0.8, 0.64])
    assert position_weights("reach:0.5,0.4", 3) == pytest.approx([1.0, 0.5, 0.2])
    assert position_weights("1,0,2", 3) == [1.0, 0.0, 2.0]
    for bad in ("1,2", "reach:1.5,0.2", "x", "0,0,0"):
        with pytest.raises(ValueError, match="position weights"):
            position_weights(bad, 3)


def test_position_weights_scale_each_steps_gradient(runner):
    """A zero weight on steps 2-3 leaves specialist 1 (positions 2-3) without gradient; weight 2 on
    step 1 doubles specialist 0's gradient."""
    from poss.train.objective import Objective, make_batch, run_steps

    torch.manual_seed(0)
    d = random_draft(runner, n=2, schedule=[1, 2], fc_per_specialist=True, seed=4).float().train()
    B, L, H = 2, 12, runner.config.hidden_size
    ids = torch.randint(0, 300, (B, L))
    feats = torch.randn(B, L, H)
    batch = make_batch(ids, torch.ones(B, L, dtype=torch.int64), torch.tensor([L, L]), feats, runner.lm_head.float())

    def grads(weights):
        d.zero_grad(set_to_none=True)
        run_steps(d, batch, runner.embed.float(), runner.lm_head.float(), runner.inv_freq,
                  Objective(steps=3, position_weights=weights), autocast_dtype=None)
        return {k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for k, p in d.named_parameters()}

    g1, g2 = grads(None), grads([2.0, 0.0, 0.0])
    spec1 = [k for k in g1 if k.startswith(("layers.1.", "fcs.1."))]
    assert spec1 and all(g1[k].abs().sum() > 0 for k in spec1)
    assert all(g2[k].abs().sum() == 0 for k in spec1)
    for k in g1:
        if k.startswith(("layers.0.", "fcs.0.")):
            torch.testing.assert_close(g2[k], 2 * grads([1.0, 0.0, 0.0])[k])


def test_train_config_checks_the_schedule():
    from poss.train.loop import TrainConfig

    assert TrainConfig(method="poss", steps=6, specialists=[1, 5]).n_specialists == 2
    with pytest.raises(ValueError, match="past the 3 trained steps"):
        TrainConfig(method="poss", steps=3, specialists=[3, 2])
    with pytest.raises(ValueError, match="needs method 'poss'"):
        TrainConfig(method="hass", specialists=[1, 2])
    with pytest.raises(ValueError, match="position weights"):
        TrainConfig(method="poss", steps=6, position_weights="1,2")


@pytest.mark.parametrize("argv,match", [
    (["--specialists", "0,5"], "--specialists"),
    (["--specialists", "1,5", "--method", "hass"], "--specialists needs --method poss"),
    (["--position-weights", "1,2"], "--position-weights"),
    (["--init-from", "a", "b", "c"], "--init-from takes one or two"),
])
def test_train_flags_are_checked_before_any_model_loads(argv, match, tmp_path, capsys):
    from poss.cli import main

    try:
        rc = main(["train", "--out", str(tmp_path / "o"), *argv])
    except SystemExit as e:
        rc = e.code
    assert rc not in (0, None)
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("untied,schedule", [(True, [1, 5]), (False, [1, 5])])
def test_layouts_without_a_published_form_are_not_exported(runner, tmp_path, untied, schedule):
    from poss.models.draft_interop import export_draft

    d = random_draft(runner, n=2, schedule=schedule, fc_per_specialist=untied)
    d.save(tmp_path / "d")
    with pytest.raises(ValueError, match="no exact form"):
        export_draft(tmp_path / "d", "poss-ref", tmp_path / "out", embed=runner.embed)
