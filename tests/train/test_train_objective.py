"""The multi-step objective: each training row sees exactly the context a draft token sees at inference."""

import pytest
import torch
import torch.nn.functional as F

from helpers.train_tiny import randomize, tiny_examples, tiny_target
from poss.models.target import chain_parents
from poss.train.data import collate
from poss.train.features import OnlineFeatures
from poss.train.loop import TrainConfig, new_draft
from poss.train.objective import Objective, make_batch, run_steps, step_losses


@pytest.fixture(scope="module")
def runner():
    return tiny_target(max_batch=2, max_seq=48)


def batch_for(runner, n=2, seed=0, noise=0.0):
    b = collate(tiny_examples(n, seed=seed))
    f = OnlineFeatures(runner)(b["input_ids"], b["lengths"])
    return make_batch(b["input_ids"], b["loss_mask"], b["lengths"], f, runner.lm_head, noise), b


@pytest.mark.parametrize("method,steps,ppl", [("eagle2", 1, 1), ("hass", 3, 1), ("poss", 4, 2)])
def test_rows_equal_the_inference_context(runner, method, steps, ppl):
    """Row r of step k == the eager specialist run causally over [f_0..f_{r-k}, own k predictions]."""
    cfg = TrainConfig(method=method, steps=steps, positions_per_specialist=ppl)
    draft = randomize(new_draft(runner, cfg, "tiny"))
    batch, _ = batch_for(runner)
    outs = run_steps(draft, batch, runner.embed, runner.lm_head, runner.inv_freq, cfg.objective(), backward=False,
                     autocast_dtype=None, keep_outputs=True)
    c = draft.config
    B, L = batch.tokens.shape
    with torch.no_grad():
        for k, m in enumerate(outs):
            j = min(k // c.positions_per_specialist, c.n_specialists - 1)
            levels = m["levels"]
            # rows around the step's boundary (r < k has no true-feature column), the middle and the end
            rows = sorted({r for r in (0, 1, k - 1, k, k + 1, L // 2, L - 2, L - 1) if 0 <= r < L})
            for b in range(B):
                for r in rows:
                    feats = torch.stack([levels[0][b, t] if t <= r - k else levels[k - (r - t)][b, t]
                                         for t in range(r + 1)])
                    e = F.embedding(batch.tokens[b, : r + 1], runner.embed)
                    u = draft.fc(torch.cat([e, feats], -1)).unsqueeze(0)
                    kc = torch.zeros(1, c.kv_heads, L, c.head_dim)
                    vc = torch.zeros_like(kc)
                    g = draft.layers[j](u, kc, vc, torch.zeros(1, dtype=torch.int32), chain_parents([r + 1], r + 1),
                                        torch.arange(r + 1).unsqueeze(0), runner.inv_freq)
                    torch.testing.assert_close(m["g"][b, r], g[0, -1], rtol=1e-4, atol=1e-5)


def test_next_level_is_the_shifted_detached_prediction(runner):
    cfg = TrainConfig(method="hass", steps=3)
    draft = randomize(new_draft(runner, cfg, "tiny"))
    batch, _ = batch_for(runner)
    outs = run_steps(draft, batch, runner.embed, runner.lm_head, runner.inv_freq, cfg.objective(), backward=True,
                     autocast_dtype=None, keep_outputs=True)
    lv = outs[2]["levels"]
    assert len(lv) == 3 and not any(t.requires_grad for t in lv)
    torch.testing.assert_close(lv[1][:, 1:], outs[0]["g"][:, :-1])
    torch.testing.assert_close(lv[2][:, 1:], outs[1]["g"][:, :-1])
    torch.testing.assert_close(lv[2][:, 0], batch.features[:, 0])


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_gradients_reach_only_the_scheduled_specialists(runner, steps):
    cfg = TrainConfig(method="poss", steps=3, positions_per_specialist=1)
    draft = randomize(new_draft(runner, cfg, "tiny"))
    batch, _ = batch_for(runner)
    obj = Objective(steps=steps)
    run_steps(draft, batch, runner.embed, runner.lm_head, runner.inv_freq, obj, autocast_dtype=None)
    assert draft.fc.weight.grad is not None and draft.fc.weight.grad.abs().sum() > 0
    for j, layer in enumerate(draft.layers):
        got = layer.qkv_proj.weight.grad
        if j < steps:
            assert got is not None and got.abs().sum() > 0
        else:
            assert got is None


def test_losses_match_the_textbook_formulas(runner):
    batch, _ = batch_for(runner)
    g = torch.randn_like(batch.target)
    m = step_losses(g, batch, runner.lm_head, Objective(topk_weight=1.0, topk=5))
    rows = batch.row_mask
    logits = g[rows] @ runner.lm_head.t()
    p = torch.softmax(batch.target[rows] @ runner.lm_head.t(), -1)
    M = rows.sum().item()
    assert M > 0
    torch.testing.assert_close(m["ploss"], F.cross_entropy(logits, p), rtol=1e-4, atol=1e-5)
    vl = torch.stack([F.smooth_l1_loss(g[rows][i], batch.target[rows][i]) for i in range(M)]).mean()
    torch.testing.assert_close(m["vloss"], vl, rtol=1e-4, atol=1e-6)
    top = p.topk(5, -1)
    tl = -(top.values * torch.log_softmax(logits, -1).gather(-1, top.indices)).sum(-1).mean()
    torch.testing.assert_close(m["topkloss"], tl, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(m["loss"], vl + 0.1 * m["ploss"] + tl, rtol=1e-4, atol=1e-5)
    assert int(m["correct"]) == int((logits.argmax(-1) == p.argmax(-1)).sum()) and int(m["count"]) == M


def test_feature_weight_zero_trains_the_draft_on_its_tokens_alone(runner):
    """EAGLE-3's objective (``--feature-weight 0``): the loss and its gradient are the cross-entropy's only."""
    batch, _ = batch_for(runner)
    g = torch.randn_like(batch.target).requires_grad_()
    m = step_losses(g, batch, runner.lm_head, Objective(v_weight=0.0, p_weight=1.0))
    m["loss"].backward()
    rows = batch.row_mask
    g2 = g.detach().clone().requires_grad_()
    p = torch.softmax(batch.target[rows] @ runner.lm_head.t(), -1)
    ce = F.cross_entropy(g2[rows] @ runner.lm_head.t(), p, reduction="sum") / rows.sum()
    ce.backward()
    assert m["vloss"] > 0  # the feature loss is still reported, only not trained on
    torch.testing.assert_close(m["loss"], ce, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(g.grad, g2.grad, rtol=1e-4, atol=1e-7)


def test_make_batch_shift_mask_and_noise(runner):
    batch, b = batch_for(runner, noise=0.0)
    ids, mask, lengths = b["input_ids"], b["loss_mask"], b["lengths"]
    assert torch.equal(batch.tokens[:, :-1], ids[:, 1:]) and (batch.tokens[:, -1] == 0).all()
    assert torch.equal(batch.target[:, :-1], batch.features[:, 1:])
    assert torch.equal(batch.row_mask[:, :-1], mask[:, 1:].bool()) and not batch.row_mask[:, -1].any()
    for i, n in enumerate(lengths.tolist()):
        assert not batch.row_mask[i, n - 1:].any()  # no row past the last real target
    noisy, _ = batch_for(runner, noise=0.2)
    d = noisy.features - batch.features
    bound = (0.5 * 0.2 * 512 / lengths.float()).view(-1, 1, 1)
    assert (d.abs() <= bound + 1e-6).all() and d.abs().max() > 0.5 * bound.min()
    torch.testing.assert_close(noisy.target, batch.target)  # the target is never noised


def test_bf16_autocast_runs_and_is_close(runner):
    cfg = TrainConfig(method="poss", steps=2, positions_per_specialist=1)
    draft = randomize(new_draft(runner, cfg, "tiny"))
    batch, _ = batch_for(runner)
    a = run_steps(draft, batch, runner.embed, runner.lm_head, runner.inv_freq, cfg.objective(), backward=False,
                  autocast_dtype=None)
    b = run_steps(draft, batch, runner.embed, runner.lm_head, runner.inv_freq, cfg.objective(), backward=False)
    for x, y in zip(a, b):
        torch.testing.assert_close(x["loss"], y["loss"], rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("topk_weight,chunk", [(0.0, 5), (0.5, 7), (1.0, 1000)])
def test_head_distillation_gradient_matches_autograd(topk_weight, chunk):
    from poss.train.objective import HeadDistillation

    g0 = torch.Generator().manual_seed(1)
    M, H, V = 13, 16, 50
    gm = torch.randn(M, H, generator=g0, dtype=torch.float64, requires_grad=True)
    head = torch.randn(V, H, generator=g0, dtype=torch.float64)
    p = torch.softmax(torch.randn(M, V, generator=g0, dtype=torch.float64) * 2, -1)
    top1 = p.argmax(-1)
    loss, ce, tk, correct = HeadDistillation.apply(gm, head, p, top1, None, 0.1, topk_weight, 4, chunk)
    (loss * 3.0).backward()
    got = gm.grad.clone()
    x = gm.detach().clone().requires_grad_()
    logq = torch.log_softmax(x @ head.t(), -1)
    top_p, top_i = p.topk(4, -1)
    ref_ce = -(p * logq).sum()
    ref_tk = -(top_p * logq.gather(-1, top_i)).sum()
    ((0.1 * ref_ce + topk_weight * ref_tk) * 3.0).backward()
    torch.testing.assert_close(got, x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ce.double(), ref_ce.detach(), rtol=1e-5, atol=1e-5)
    assert int(correct) == int(((x @ head.t()).argmax(-1) == top1).sum())
