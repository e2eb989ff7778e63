"""Edge cases of the loop: bad prompts, tiny budgets, early stops, stop strings, streaming, bf16."""

import pytest
import torch

from helpers.loop import (
    ByteTokenizer,
    assert_lossless_in_dtype,
    eval_prompts,
    hf_greedy,
    make_generator,
    single_thread,  # noqa: F401  (autouse: one CPU thread)
    tiny_target,
)
from poss.decode.engine import DecodeEngine
from poss.decode.generator import Generator
from poss.decode.params import TreeParams

PROMPTS = eval_prompts(1, max_len=24)


@pytest.fixture(scope="module")
def model():
    return tiny_target(seed=11)


@pytest.fixture(scope="module")
def gen(model):
    return make_generator(model, draft=True, n=3, ppl=2, aligned=True)


def test_empty_prompt_is_a_clear_error(gen):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        gen.generate([PROMPTS[0], []], 4)


@pytest.mark.parametrize("bad", [-3, 10 ** 6])
def test_a_token_id_outside_the_vocabulary_is_a_clear_error(gen, bad):
    with pytest.raises(ValueError, match=rf"prompt 1 has token id {bad}, outside the vocabulary"):
        gen.generate([PROMPTS[0], [5, bad]], 4)


def test_no_prompts_is_refused_before_an_auto_tree_is_sized(gen, monkeypatch):
    monkeypatch.setattr(gen, "auto_tree", lambda *a, **k: pytest.fail("sized a tree for no prompts"))
    with pytest.raises(ValueError, match="no prompts given"):
        gen.generate([], 4, tree="auto")


@pytest.mark.parametrize("extra", [0, 5])
def test_prompt_at_or_over_the_context_limit_is_a_clear_error(gen, extra):
    limit = gen.context_limit
    with pytest.raises(ValueError, match="context limit"):
        gen.generate([[5] * (limit + extra)], 4)


def test_generation_stops_at_the_context_limit(model):
    g = make_generator(model, draft=True, n=3, ppl=2, aligned=True)
    g.context_limit = len(PROMPTS[0]) + 10
    res = g.generate([PROMPTS[0]], 50)
    assert res.token_ids[0] == hf_greedy(model, PROMPTS[0], 10)[:len(res.token_ids[0])]
    assert res.stats[0].finish_reason in ("context", "eos") and len(PROMPTS[0]) + res.stats[0].tokens <= g.context_limit


def test_max_new_tokens_zero_and_one(gen, model):
    res = gen.generate(PROMPTS[:2], 0)
    assert res.token_ids == [[], []] and [s.tokens for s in res.stats] == [0, 0]
    res = gen.generate(PROMPTS[:2], 1)
    assert res.token_ids == [hf_greedy(model, p, 1) for p in PROMPTS[:2]]
    assert all(s.rounds == 0 and s.finish_reason in ("length", "eos") for s in res.stats)


@pytest.mark.parametrize("at", [0, 1, 3])
def test_end_token_in_the_first_round(model, at):
    ref = hf_greedy(model, PROMPTS[2], 8, eos_token_id=None)
    end = ref[at]
    g = make_generator(model, draft=True, n=3, ppl=2, aligned=True)
    g.end_ids = {end}
    res = g.generate([PROMPTS[2]], 30)
    assert res.token_ids[0] == ref[: ref.index(end) + 1]
    assert res.stats[0].finish_reason == "eos" and res.stats[0].rounds <= 1 + at


def test_batch_where_one_request_stops_immediately(model):
    first = hf_greedy(model, PROMPTS[0], 1)[0]
    g = make_generator(model, draft=True, n=3, ppl=2, aligned=True)
    g.end_ids = {first}
    res = g.generate(PROMPTS[:4], 40)
    assert res.token_ids[0] == [first] and res.stats[0].rounds == 0
    for p, got in zip(PROMPTS[1:4], res.token_ids[1:4]):
        assert got == hf_greedy(model, p, 40, eos_token_id=first)


def test_finished_requests_leave_the_batch(model):
    """Rounds of a request that stopped early are not run: its row is dropped from the batch."""
    g = make_generator(model, draft=True, n=3, ppl=2, aligned=True)
    g.end_ids = set()
    engine = DecodeEngine(g, TreeParams(30, 6, 5))
    ids = [engine.add(p, 2 if i == 1 else 40) for i, p in enumerate(PROMPTS[:3])]
    sizes, finals = [], {}
    while engine.has_work():
        finals.update({ev.id: ev for ev in engine.step() if ev.finished})
        sizes.append(engine.active)
    assert sizes[0] == 2 and sizes[-1] == 0  # the 2-token request left after its first round
    short = finals[ids[1]].stats
    assert short.tokens == 2 and short.rounds == 1
    assert all(finals[i].stats.tokens == 40 and finals[i].stats.rounds > 1 for i in (ids[0], ids[2]))


@pytest.fixture(scope="module")
def byte_gen():
    model = tiny_target(vocab=256, seed=2)
    runner_gen = make_generator(model, draft=True, n=3, ppl=2, aligned=True)
    return Generator(runner_gen.runner, tokenizer=ByteTokenizer(), draft=runner_gen.draft, end_ids=set())


def test_stop_strings_cut_the_text_and_stream_matches(byte_gen):
    prompt = list(b"Once upon a time")
    full = byte_gen.generate([prompt], 60).texts[0]
    stop = full[20:23]
    cut = full.find(stop)
    res = byte_gen.generate([prompt], 60, stop=[stop])
    assert res.texts[0] == full[:cut] and res.stats[0].finish_reason == "stop"
    pieces = list(byte_gen.stream(prompt, 60, stop=[stop]))
    assert "".join(pieces) == full[:cut] and len(pieces) >= 1
    assert stop not in "".join(pieces)
    # Without a matching stop string the stream is the whole text.
    assert "".join(byte_gen.stream(prompt, 60, stop=["\x00never\x00"])) == full


@pytest.mark.parametrize("draft_kw", [dict(n=3, ppl=2), dict(n=1, features="eagle3", feature_layers=(1, 0, 2)),
                                      dict(n=3, ppl=2, features="eagle3", feature_layers=(1, 0, 2))],
                         ids=["poss2", "eagle3", "poss2-eagle3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_speculative_matches_our_autoregressive_loop_in_its_dtype(dtype, draft_kw):
    """Greedy speculation equals our own AR loop in the same dtype, token for token, where poss::linear
    has a row-invariant kernel for it (bf16: AVX512-BF16, fp32: AVX2 + FMA); with the vendor GEMM a
    divergence is only allowed at a near-tie of the logits (tree and single-token GEMMs round differently).
    EAGLE-3 drafts (and PosS on EAGLE-3 features) run on a runner that also returns three layers."""
    model = tiny_target(seed=4)
    prompts = eval_prompts(2, max_len=32)[:8]
    ar = make_generator(model, draft=False, dtype=dtype)
    spec = make_generator(model, draft=True, aligned=True, dtype=dtype, **draft_kw)
    want = ar.generate(prompts, 64).token_ids
    got = spec.generate(prompts, 64).token_ids
    parted = assert_lossless_in_dtype(dtype, model, prompts, got, want)
    print(f"{dtype}: {len(prompts) - parted}/{len(prompts)} identical to the AR loop")
    assert parted <= 2


@pytest.mark.parametrize("kw,match", [(dict(num_nodes=0), "num_nodes"), (dict(num_nodes=300), "num_nodes"),
                                      (dict(depth=-1), "depth"), (dict(beam_width=0), "beam_width"),
                                      (dict(depth=40, beam_width=10), "256 nodes")])
def test_bad_tree_parameters_are_clear_errors(gen, kw, match):
    with pytest.raises(ValueError, match=match):
        gen.generate([PROMPTS[0]], 4, **kw)


def test_mismatched_per_request_parameters(gen):
    with pytest.raises(ValueError, match="temperature has 3 values for 2 prompts"):
        gen.generate(PROMPTS[:2], 4, temperature=[0.0, 0.5, 1.0])
