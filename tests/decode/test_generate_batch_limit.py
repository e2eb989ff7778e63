"""``Generator.speculate_max_batch``: a batched call above the limit decodes plainly, speculates again
once enough of its requests have ended, and stays token-identical to greedy decoding throughout."""

import pytest

from helpers.loop import (
    eval_prompts,
    make_generator,
    single_thread,  # noqa: F401  (autouse: one CPU thread)
    tiny_target,
)
from poss.decode.engine import DecodeEngine
from poss.decode.params import TreeParams

TREE = TreeParams(num_nodes=10, depth=3, beam_width=3)
# Per-request budgets, so one request ends first.
BUDGETS = [60, 40, 8]


@pytest.fixture(scope="module")
def gen():
    return make_generator(tiny_target(seed=3), draft=True, n=3, ppl=1, aligned=True)


def prompts():
    """Three prompts; the last (the short request) is one the draft gets right within 8 tokens."""
    p = eval_prompts(1)
    return [p[1], p[2], p[0]]


def run_with_limit(gen, limit, prompts):
    """One batch in which request i may generate ``BUDGETS[i]`` tokens, under the generator's
    ``speculate_max_batch = limit``: ``[(tokens, stats)]`` in prompt order."""
    gen.speculate_max_batch = limit
    try:
        engine = DecodeEngine(gen, TREE, speculate_max_batch=gen.speculation_limit(TREE))
        ids = [engine.add(p, n) for p, n in zip(prompts, BUDGETS)]
        out = {i: ([], None) for i in ids}
        while engine.has_work():
            for ev in engine.step():
                out[ev.id] = (out[ev.id][0] + ev.tokens, ev.stats)
        return [out[i] for i in ids]
    finally:
        gen.speculate_max_batch = None


def test_plain_rounds_above_the_limit_then_speculation_and_the_same_tokens(gen):
    want = [gen.generate([p], n, tree=TREE).token_ids[0] for p, n in zip(prompts(), BUDGETS)]
    res = run_with_limit(gen, 2, prompts())
    assert [tokens for tokens, _ in res] == want
    stats = [s for _, s in res]
    short = stats[2].accept_hist
    assert sum(short) == BUDGETS[2] - 1 and sum(short[1:]) == 0  # only plain rounds while 3 were live
    assert all(s.accept_hist[0] >= BUDGETS[2] - 1 for s in stats[:2])
    assert any(sum(s.accept_hist[1:]) for s in stats[:2])  # then speculation resumed


def test_without_a_limit_the_short_request_accepts_draft_tokens(gen):
    """So the first test's "only plain rounds" could fail."""
    res = run_with_limit(gen, None, prompts())
    assert sum(res[2][1].accept_hist[1:]) > 0


def test_auto_is_measured_once_per_tree(gen, monkeypatch):
    import poss.decode.autotune as autotune

    calls = []
    monkeypatch.setattr(autotune, "speculation_limit", lambda g, tree, max_batch: calls.append(tree) or 1)
    gen.speculate_max_batch, gen._limits = "auto", {}
    try:
        p = eval_prompts(1)[:2]
        gen.generate(p[:1], 4, tree=TREE)  # one request: nothing to measure
        assert calls == []
        a = gen.generate(p, 6, tree=TREE)
        gen.generate(p, 6, tree=TREE)
        assert calls == [TREE]
        assert all(sum(s.accept_hist[1:]) == 0 for s in a.stats)  # limit 1: both rows plain until one ends
        other = TreeParams(num_nodes=6, depth=2, beam_width=3)
        gen.generate(p, 4, tree=other)
        assert calls == [TREE, other]
    finally:
        gen.speculate_max_batch, gen._limits = None, {}


@pytest.mark.parametrize("bad", [0, -1, "sometimes", 2.5, True])
def test_bad_limit_is_a_clear_error(gen, bad):
    with pytest.raises(ValueError, match="speculate_max_batch"):
        gen.speculate_max_batch = bad
    assert gen.speculate_max_batch is None


def test_the_generate_flag_reaches_the_generator(monkeypatch):
    from poss.cli import build_parser
    from poss.cli import generate as cli

    seen = {}
    monkeypatch.setattr("poss.decode.loader.load", lambda *a, **kw: seen.update(kw))
    for flag, want in (([], "auto"), (["--speculate-max-batch", "off"], None), (["--speculate-max-batch", "4"], 4)):
        cli.load(build_parser().parse_args(["generate", "--prompt", "hi"] + flag))
        assert seen["speculate_max_batch"] == want
        assert seen["retune"] is False and seen["threads"] == "auto"
    cli.load(build_parser().parse_args(["chat", "--retune", "--threads", "1"]))
    assert seen["retune"] is True and seen["threads"] == 1
