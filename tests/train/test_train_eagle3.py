"""EAGLE-3's training-time test (``--method eagle3``, ``--method poss --draft-features eagle3``): the loss and its
gradients against a hand-written unrolled computation, training, resume, cached features and the CLI checks."""

import argparse
import json

import pytest
import torch
import torch.nn.functional as F

from helpers.train_tiny import make_trainer, randomize, tiny_examples, tiny_target
from poss.cli.args import UsageError
from poss.cli.train import add_parser, check_train_arguments
from poss.train.data import collate
from poss.train.features import FeatureCache, OnlineFeatures, make_features
from poss.train.loop import TrainConfig, new_draft
from poss.train.objective import make_batch, run_steps
from poss.train.validate import evaluate

LAYERS = [1, 0, 2]  # the 2-layer tiny target: EAGLE-3's default (2, L // 2, L - 3) needs 3 layers


@pytest.fixture(scope="module")
def runner():
    r = tiny_target(max_batch=2, max_seq=48)
    r.set_feature_layers(LAYERS)
    return r


def batch_for(runner, n=2, seed=0, token_map=None, max_len=24):
    b = collate(tiny_examples(n, seed=seed, max_len=max_len))
    f = OnlineFeatures(runner)(b["input_ids"], b["lengths"])
    return make_batch(b["input_ids"], b["loss_mask"], b["lengths"], f, runner.lm_head, 0.0, token_map=token_map,
                      next_token=b["next_token"]), b


def dense_layer(layer, eps, e, g, inv_freq):
    """One EAGLE-3 layer over a causal chain ``e, g [T, H]`` (positions 0..T-1) from its raw parameters."""
    c = layer.c
    T = e.shape[0]

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    a = torch.cat([rms(e, layer.input_norm), rms(g, layer.hidden_norm)], -1)
    q, k, v = (a @ layer.qkv_proj.weight.t()).split([c.heads * c.head_dim, c.kv_heads * c.head_dim,
                                                     c.kv_heads * c.head_dim], -1)
    ang = torch.arange(T).view(T, 1).float() * inv_freq
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rot(x):
        x = x.view(T, -1, c.head_dim).transpose(0, 1)
        return x * cos + torch.cat([-x[..., c.head_dim // 2:], x[..., : c.head_dim // 2]], -1) * sin

    rep = c.heads // c.kv_heads
    att = F.scaled_dot_product_attention(rot(q), rot(k).repeat_interleave(rep, 0),
                                         v.view(T, -1, c.head_dim).transpose(0, 1).repeat_interleave(rep, 0),
                                         is_causal=True)
    h = g + att.transpose(0, 1).reshape(T, -1) @ layer.o_proj.weight.t()
    gate, up = (rms(h, layer.post_norm) @ layer.gate_up_proj.weight.t()).chunk(2, -1)
    return h + (F.silu(gate) * up) @ layer.down_proj.weight.t()


def unrolled_loss(draft, batch, runner, steps, weights):
    """The training-time-test loss written as inference runs: for every start s, the draft drafts
    ``steps`` positions after x_{s+1} with its own outputs fed back (the tokens are the data's); the
    output at depth k is scored at row s + k against the target's distribution there."""
    c = draft.config
    B, L = batch.tokens.shape
    g0 = batch.features[..., c.hidden:] @ draft.fc.weight.t()  # fc over the three layers, no bias
    rows_out = [[[None] * L for _ in range(B)] for _ in range(steps)]
    for b in range(B):
        e_all = runner.embed[batch.tokens[b]]
        for s in range(L):
            hidden = list(g0[b, : s + 1])
            for k in range(steps):
                r = s + k
                if r >= L:
                    break
                layer = draft.layers[c.specialist_for(k + 1)]
                out = dense_layer(layer, c.rms_eps, e_all[: r + 1], torch.stack(hidden), runner.inv_freq)[-1]
                rows_out[k][b][r] = out
                hidden.append(out)
    total, losses = 0.0, []
    m = batch.row_mask
    M = m.sum()
    for k in range(steps):
        idx = [(b, r) for b in range(B) for r in range(L) if m[b, r]]  # row-major, as batch.target_p
        ce = 0.0
        for i, (b, r) in enumerate(idx):
            h = rows_out[k][b][r]
            z = (h * torch.rsqrt(h.pow(2).mean() + c.rms_eps) * draft.norm) @ draft.lm_head.weight.t()
            keep = 1.0 if batch.ce_keep is None else float(batch.ce_keep[i])
            ce = ce - keep * (batch.target_p[i] * torch.log_softmax(z, -1)).sum()
        losses.append(ce / (M.float() + 1e-5))
        total = total + weights[k] * losses[-1]
    return total, losses


@pytest.mark.parametrize("method,steps,token_map", [("eagle3", 3, False), ("poss", 3, True)],
                         ids=["eagle3", "poss-eagle3-draft-vocab"])
def test_ttt_loss_and_gradients_match_the_unrolled_computation(runner, method, steps, token_map):
    cfg = TrainConfig(method=method, steps=steps, positions_per_specialist=1, draft_features="eagle3",
                      feature_layers=LAYERS)
    tm = torch.arange(0, 128, 2) if token_map else None  # 64 of the 128 tokens
    draft = randomize(new_draft(runner, cfg, "tiny", token_map=tm)).train()
    assert draft.config.features == "eagle3" and draft.fc.bias is None
    assert draft.config.n_specialists == (3 if method == "poss" else 1)
    batch, _ = batch_for(runner, token_map=tm)
    # Rows r < k have no start s = r - k >= 0 (training keeps row 0's input in front of the fed-back rows
    # there); the examples' answers start later, so no such row is scored.
    assert batch.row_mask.sum() > 0 and not batch.row_mask[:, :steps].any()
    if token_map:
        assert 0 < batch.ce_keep.sum() < batch.ce_keep.numel()  # some target tokens are outside the 64
    obj = cfg.objective()
    assert obj.position_weights == pytest.approx([1.0, 0.8, 0.64]) and obj.p_weight == 1.0
    outs = run_steps(draft, batch, runner.embed, runner.lm_head, runner.inv_freq, obj, backward=True,
                     autocast_dtype=None)
    got = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad(set_to_none=True)
    want_total, want = unrolled_loss(draft, batch, runner, steps, obj.position_weights)
    for k in range(steps):
        torch.testing.assert_close(outs[k]["loss"], want[k].detach(), rtol=1e-4, atol=1e-5)
    want_total.backward()
    # The gradients flow back through the fed-back outputs: fc, every layer and the own head agree.
    assert {"fc.weight", "norm", "lm_head.weight", "layers.0.qkv_proj.weight"} <= set(got)
    assert set(got) == {n for n, p in draft.named_parameters() if p.grad is not None}
    for n, p in draft.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-3, atol=1e-6, msg=n)


def test_next_levels_are_the_shifted_outputs_with_gradients(runner):
    cfg = TrainConfig(method="eagle3", steps=3, feature_layers=LAYERS)
    draft = randomize(new_draft(runner, cfg, "tiny"))
    batch, _ = batch_for(runner)
    outs = run_steps(draft, batch, runner.embed, runner.lm_head, runner.inv_freq, cfg.objective(), backward=False,
                     autocast_dtype=None, keep_outputs=True)
    lv = outs[2]["levels"]
    torch.testing.assert_close(lv[1][:, 1:], outs[0]["g"][:, :-1])
    torch.testing.assert_close(lv[2][:, 1:], outs[1]["g"][:, :-1])
    torch.testing.assert_close(lv[2][:, 0], lv[0][:, 0])  # row 0 keeps fc(target layers)
    assert all(m["vloss"] == 0 for m in outs)


@pytest.mark.parametrize("method", ["eagle3", "poss"])
def test_training_reduces_the_loss_and_saves_a_runnable_draft(tmp_path, method):
    tr = make_trainer(tmp_path, method=method, steps=3, ppl=1, n_train=4, batch_size=2, epochs=10, noise=0.0,
                      lr=3e-3, draft_features="eagle3", feature_layers=LAYERS)
    assert tr.runner.feature_layers == tuple(LAYERS)
    ids = list(range(len(tr.train)))
    before = evaluate(tr.draft, tr.features, tr.train, ids, tr.cfg.objective(), tr.runner, 2, None)
    result = tr.fit()
    after = evaluate(tr.draft, tr.features, tr.train, ids, tr.cfg.objective(), tr.runner, 2, None)
    assert result["finished"]
    # The tiny target's distribution is nearly uniform (its entropy ~4.8 nats of ln 128 = 4.85 bounds the
    # cross-entropy from below), so the draft's learning shows in its top-1 agreement.
    for k in range(3):
        assert after["loss"][k] < before["loss"][k] and after["acc"][k] > before["acc"][k] + 0.15
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert cfg["features"] == "eagle3" and cfg["feature_layers"] == LAYERS and cfg["fc_bias"] is False
    assert cfg["training"]["recipe"]["draft_features"] == "eagle3"
    from poss.models.draft import PosSDraft

    d = PosSDraft.load(tmp_path / "draft")
    assert d.config.n_specialists == (3 if method == "poss" else 1)
    # The saved draft decodes on the target (lossless greedy: the AR loop's tokens).
    from poss.decode.generator import Generator

    runner = tiny_target(max_batch=2, max_seq=64)
    # `poss train --validate` on it: the runner is given the draft's layers, the EAGLE-3 loss is reported.
    from poss.train.validate import validate_draft

    v = validate_draft(tmp_path / "draft", runner, tr.val, steps=4)
    assert len(v["acc"]) == 4 and v["vloss"] == [0.0] * 4 and runner.feature_layers == tuple(LAYERS)
    runner.set_feature_layers(None)
    ar = Generator(runner, end_ids=set()).generate([[5, 9, 17, 3]], 12).token_ids
    runner.set_feature_layers(d.feature_layers_for(2))
    gen = Generator(runner, draft=d.attach(runner, 1, 64), end_ids=set())
    assert gen.generate([[5, 9, 17, 3]], 12).token_ids == ar


def test_resume_continues_to_the_same_weights(tmp_path):
    kw = dict(method="eagle3", steps=2, n_train=4, batch_size=2, epochs=2, noise=0.0, draft_features="eagle3",
              feature_layers=LAYERS)
    ref = make_trainer(tmp_path / "ref", **kw)
    ref.fit()
    part = make_trainer(tmp_path / "part", max_batches=3, **kw)
    assert not part.fit()["finished"]
    resumed = make_trainer(tmp_path / "part", **kw)
    assert resumed.resume() and resumed.progress["step"] == 3
    assert resumed.fit()["finished"]
    for (n, a), (_, b) in zip(sorted(resumed.draft.state_dict().items()), sorted(ref.draft.state_dict().items())):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
    with pytest.raises(ValueError, match="another run.*feature_layers"):
        make_trainer(tmp_path / "part", **{**kw, "feature_layers": [0, 1, 2]}).resume()


def test_cached_features_record_their_layers_and_refuse_others(tmp_path, runner):
    ex = tiny_examples(2)
    b = collate(ex)
    cached = make_features(runner, tmp_path, 0)
    sub = tmp_path / "layers-1-0-2" / "rank0"
    assert cached.cache.dir == sub
    got = cached(b["input_ids"], b["lengths"], [3, 4])
    want = OnlineFeatures(runner)(b["input_ids"], b["lengths"])
    assert got.shape[-1] == 4 * 128
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # fp16 in the cache
    cached.cache.flush()
    assert json.loads((sub / "features.json").read_text()) == {"feature_layers": LAYERS}
    with pytest.raises(ValueError, match=r"holds layers \[1, 0, 2\], this run needs final-norm features only"):
        FeatureCache(sub)
    with pytest.raises(ValueError, match=r"holds layers \[1, 0, 2\], this run needs layers \[0, 1, 2\]"):
        FeatureCache(sub, feature_layers=[0, 1, 2])
    plain = tmp_path / "plain"
    c = FeatureCache(plain)
    c.put(0, torch.zeros(3, 128))
    c.flush()
    with pytest.raises(ValueError, match="holds final-norm features only, this run needs layers"):
        FeatureCache(plain, feature_layers=LAYERS)


def parse(*argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    return parser.parse_args(["train", "--target", "smollm2-135m", "--out", "x", *argv])


def test_cli_flags():
    a = parse("--method", "eagle3", "--ttt-steps", "5", "--feature-layers", "2,15,27")
    check_train_arguments(a)
    assert (a.method, a.steps, a.feature_layers, a.features) == ("eagle3", 5, [2, 15, 27], "cache")
    check_train_arguments(parse("--method", "poss", "--draft-features", "eagle3", "--positions-per-specialist", "2"))
    for argv, match in ((("--method", "hass", "--draft-features", "eagle3"), "needs --method eagle3 or poss"),
                        (("--method", "poss", "--feature-layers", "1,2,3"), "--feature-layers needs EAGLE-3"),
                        (("--method", "eagle3", "--draft-features", "last"), "drop --draft-features last"),
                        (("--method", "poss", "--draft-features", "eagle3", "--fc-per-specialist"), "one fc"),
                        (("--method", "eagle3", "--position-weights", "1,2"), "--position-weights")):
        with pytest.raises(UsageError, match=match):
            check_train_arguments(parse(*argv))
    cfg = TrainConfig(method="eagle3")
    assert (cfg.steps, cfg.n_specialists, cfg.position_weights, cfg.p_weight) == (7, 1, "eagle3", 1.0)
    with pytest.raises(ValueError, match="EAGLE-3 features train with"):
        TrainConfig(method="hass", draft_features="eagle3")


def test_poss_on_eagle3_starts_from_a_trained_eagle3_draft(tmp_path):
    kw = dict(n_train=2, batch_size=2, epochs=1, draft_features="eagle3", feature_layers=LAYERS)
    make_trainer(tmp_path / "e3", method="eagle3", steps=2, **kw).fit()
    src = tmp_path / "e3" / "draft"
    from poss.models.draft import PosSDraft

    e3 = PosSDraft.load(src)
    tp = make_trainer(tmp_path / "p", method="poss", steps=3, ppl=1, init_from=str(src), **kw)
    d = tp.draft
    assert d.config.n_specialists == 3 and d.config.features == "eagle3"
    for name in ("fc.weight", "norm", "lm_head.weight"):
        assert torch.equal(d.state_dict()[name], e3.state_dict()[name]), name
    for layer in d.layers:
        for (n, a), (_, b) in zip(layer.state_dict().items(), e3.layers[0].state_dict().items()):
            assert torch.equal(a, b), n
    make_trainer(tmp_path / "e2", method="eagle2", steps=1, n_train=2, batch_size=2, epochs=1).fit()
    with pytest.raises(ValueError, match="on 'last' features cannot start one on 'eagle3'"):
        make_trainer(tmp_path / "q", method="poss", steps=3, ppl=1, init_from=str(tmp_path / "e2" / "draft"), **kw)
