"""The reduced draft vocabulary: selection, inverse map, coverage."""

from collections import Counter

import pytest
import torch

from poss.train.draft_vocab import coverage, inverse_map, select_draft_vocab, token_counts


def test_most_frequent_ids_with_end_tokens_kept():
    counts = token_counts([[5, 5, 5, 7, 7, 9], [7, 3, 3, 3, 3]])
    assert counts == Counter({3: 4, 5: 3, 7: 3, 9: 1})
    # 3 (4x), then 5 and 7 tie at 3x: lower id first; end token 2 takes the last seat
    assert select_draft_vocab(counts, 3, 10).tolist() == [3, 5, 7]
    assert select_draft_vocab(counts, 3, 10, always=[2]).tolist() == [2, 3, 5]


def test_too_few_tokens_are_filled_to_k():
    m = select_draft_vocab(Counter({8: 2}), 4, 10)
    assert m.tolist() == [0, 1, 2, 8]
    assert select_draft_vocab(Counter({1: 1}), 50, 10).numel() == 10
    with pytest.raises(ValueError, match="draft vocabulary size"):
        select_draft_vocab(Counter(), 0, 10)


def test_inverse_map_round_trips():
    m = torch.tensor([1, 4, 6])
    inv = inverse_map(m, 8)
    assert inv.tolist() == [-1, 0, -1, -1, 1, -1, 2, -1]
    assert torch.equal(m[inv[m]], m)


def test_coverage_counts_tokens_in_the_set():
    assert coverage(torch.tensor([1, 2]), [[1, 2, 3, 4], [1]]) == pytest.approx(3 / 5)


# -- training with a reduced vocabulary --------------------------------------------------------------

def _tiny_batch(token_map=None):
    from helpers.train_tiny import tiny_examples, tiny_target
    from poss.train.data import collate
    from poss.train.features import OnlineFeatures
    from poss.train.objective import make_batch

    runner = tiny_target(max_batch=2, max_seq=48)
    b = collate(tiny_examples(2))
    f = OnlineFeatures(runner)(b["input_ids"], b["lengths"])
    return runner, b, make_batch(b["input_ids"], b["loss_mask"], b["lengths"], f, runner.lm_head, token_map=token_map)


def test_target_side_is_the_renormalised_restriction():
    token_map = torch.arange(0, 128, 2)  # the even ids
    runner, b, full = _tiny_batch()
    _, _, red = _tiny_batch(token_map)
    # the restricted distribution is the full one on the K ids, renormalised
    want = full.target_p[:, token_map]
    torch.testing.assert_close(red.target_p, want / want.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)
    # a row leaves the classification loss exactly when its next data token x_{t+2} is odd (outside) or unknown
    ids, lengths = b["input_ids"], b["lengths"]
    B, L = ids.shape
    want_keep = []
    for i in range(B):
        for t in range(L):
            if red.row_mask[i, t]:
                want_keep.append(t + 2 < int(lengths[i]) and int(ids[i, t + 2]) % 2 == 0)
    assert red.ce_keep.tolist() == want_keep
    assert (red.target_top1[~red.ce_keep] == -1).all()
    # kept rows: top-1 is the reduced index of the target's top-1 among the even ids
    kept = red.ce_keep
    assert torch.equal(token_map[red.target_top1[kept]], token_map[want[kept].argmax(-1)])


def test_the_row_predicting_a_distilled_answers_last_token_is_scored():
    from poss.train.data import collate
    from poss.train.distill import record_example
    from poss.train.objective import make_batch

    V, H, end = 8, 4, 7
    g = torch.Generator().manual_seed(0)
    # the second record's answer was cut to 2 positions: its next token is the first one cut
    ex = [record_example({"prompt_ids": [1, 2, 3], "answer_ids": [4, 5, 6, end]}),
          record_example({"prompt_ids": [1, 2], "answer_ids": [6, 5, 4, 3, end]}, answer_tokens=2)]
    assert [e.next_token for e in ex] == [end, 4]
    b = collate(ex)
    f, head = torch.randn(2, b["input_ids"].shape[1], H, generator=g), torch.randn(V, H, generator=g)
    args = (b["input_ids"], b["loss_mask"], b["lengths"], f, head)
    whole = make_batch(*args, token_map=torch.arange(V), next_token=b["next_token"])
    # with every token in the draft vocabulary, every answer row is scored against the data's next token
    # rows predict 5, 6, 7 (the end token) and 5, 4 (the first cut token)
    assert whole.ce_keep.all() and int(whole.row_mask.sum()) == 3 + 2
    without = make_batch(*args, token_map=torch.arange(V))  # next token unknown: those rows are left out
    assert without.ce_keep.tolist() == [True, True, False, True, False]
    # the last rows are judged by their own next token like any other: with the even ids, 7 is out, 4 in
    even = make_batch(*args, token_map=torch.tensor([0, 2, 4, 6]), next_token=b["next_token"])
    assert even.ce_keep.tolist() == [False, True, False, False, True]


def test_left_out_rows_carry_no_loss_or_gradient():
    from poss.train.objective import HeadDistillation

    g0 = torch.Generator().manual_seed(2)
    M, H, K = 9, 8, 20
    gm = torch.randn(M, H, generator=g0, dtype=torch.float64, requires_grad=True)
    head = torch.randn(K, H, generator=g0, dtype=torch.float64)
    p = torch.softmax(torch.randn(M, K, generator=g0, dtype=torch.float64), -1)
    keep = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)
    top1 = torch.where(keep, p.argmax(-1), torch.full((M,), -1))
    loss, ce, _, correct = HeadDistillation.apply(gm, head, p, top1, keep, 0.1, 0.0, 4, 4)
    loss.backward()
    x = gm.detach().clone().requires_grad_()
    ref = -(p[keep] * torch.log_softmax(x[keep] @ head.t(), -1)).sum()
    (0.1 * ref).backward()
    torch.testing.assert_close(gm.grad, x.grad)
    assert (gm.grad[~keep] == 0).all()
    torch.testing.assert_close(ce.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    assert int(correct) == int(((x @ head.t()).argmax(-1) == top1)[keep].sum())


def test_trained_draft_keeps_its_token_map(tmp_path):
    from helpers.train_tiny import tiny_examples, tiny_target
    from poss.models.draft import PosSDraft
    from poss.train.loop import TrainConfig, Trainer

    torch.set_num_threads(1)
    runner = tiny_target(max_batch=2)
    token_map = torch.arange(0, 128, 2)
    cfg = TrainConfig(method="eagle2", epochs=1, batch_size=2, lr=1e-3, autocast="none")
    tr = Trainer(runner, cfg, tiny_examples(4), tiny_examples(2, seed=1), tmp_path / "e", target_name="tiny",
                 progress_bar=False, token_map=token_map)
    res = tr.fit()
    assert res["finished"] and 0 <= res["val"]["acc"][0] <= 1
    d = PosSDraft.load(tmp_path / "e" / "draft-fp16")
    assert d.config.draft_vocab == 64 and torch.equal(d.token_map, token_map)
    # HASS from it inherits the map
    cfg2 = TrainConfig(method="hass", steps=2, epochs=1, batch_size=2, lr=1e-3, autocast="none")
    tr2 = Trainer(runner, cfg2, tiny_examples(4), tiny_examples(2, seed=1), tmp_path / "h", target_name="tiny",
                  progress_bar=False, init_from=str(tmp_path / "e" / "draft"))
    assert torch.equal(tr2.draft.token_map, token_map)
    # drafting scores K rows and maps back to full ids
    d = d.attach_tensors(runner.embed, runner.lm_head, runner.inv_freq, 1, 16)
    z = d.logits(torch.randn(3, runner.hidden_size))
    assert z.shape == (3, 64)
    assert set(d.full_ids(z.argmax(-1)).tolist()) <= set(range(0, 128, 2))


def test_full_vocab_load_scores_every_row_with_the_same_weights(tmp_path):
    from helpers.train_tiny import tiny_target
    from poss.models.draft import PosSDraft
    from poss.testing import random_draft

    runner = tiny_target(max_batch=1)
    random_draft(runner, n=2, ppl=1, draft_vocab=40).save(tmp_path / "d")
    trained = PosSDraft.load(tmp_path / "d").attach(runner, max_batch=1, max_seq=16)
    full = PosSDraft.load(tmp_path / "d", vocab="full").attach(runner, max_batch=1, max_seq=16)
    assert full.token_map is None and full.config.draft_vocab == 0 and trained.config.draft_vocab == 40
    for (name, a), (_, b) in zip(trained.named_parameters(), full.named_parameters()):
        assert torch.equal(a, b), name
    x = torch.randn(5, runner.hidden_size)
    z_k, z_v = trained.logits(x), full.logits(x)
    assert z_k.shape == (5, 40) and z_v.shape == (5, runner.lm_head.shape[0])
    # the K rows score as before; the others are the target's head on the same features
    torch.testing.assert_close(z_v[:, trained.token_map], z_k)
    torch.testing.assert_close(z_v, x @ runner.lm_head.t())
    assert torch.equal(full.full_ids(torch.tensor([3, 7])), torch.tensor([3, 7]))
    with pytest.raises(ValueError, match="vocab must be one of trained, full, got 'all'"):
        PosSDraft.load(tmp_path / "d", vocab="all")


def test_generate_with_the_full_draft_vocab_gives_the_same_answer(tmp_path, capsys):
    from helpers.targets import tiny_chat_folder
    from poss.cli import main

    root = tiny_chat_folder(tmp_path, [("k", 2, 40)])
    base = ["generate", "--target", str(root / "target"), "--draft", str(root / "k"), "--prompt", "say hi",
            "--max-new-tokens", "12", "--threads", "1", "--dtype", "float32", "--num-nodes", "10", "--depth", "3",
            "--lookup", "0", "--datastore", "none", "--draft-vocab"]
    answers = []
    for vocab in ("trained", "full"):
        assert main(base + [vocab]) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] and answers[0].strip()
    assert main(base + ["all"]) == 2
    assert "--draft-vocab" in capsys.readouterr().err
