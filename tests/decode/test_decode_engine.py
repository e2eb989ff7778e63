"""Continuous batching (:class:`poss.decode.engine.DecodeEngine`): requests that join a running batch at
different rounds decode exactly what ``generate`` gives each alone (greedy, with and without a draft,
caches growing on the way), a seeded sampled request gives the same tokens alone and among others, and
a cancelled row leaves the batch at the next step with nothing left behind."""

import pytest

from helpers.loop import (
    eval_prompts,
    make_generator,
    single_thread,  # noqa: F401  (autouse: one CPU thread)
    tiny_target,
)
from poss.decode.engine import DecodeEngine
from poss.decode.params import SamplingParams, TreeParams

TREE = TreeParams(num_nodes=10, depth=3, beam_width=3)


@pytest.fixture(scope="module")
def model():
    return tiny_target(seed=3)


@pytest.fixture(scope="module", params=[False, True], ids=["no-draft", "draft"])
def gen(request, model):
    return make_generator(model, draft=request.param, n=3, ppl=1, aligned=True)


def run(engine, schedule, max_steps=500):
    """Step ``engine``; ``schedule[k]`` = list of (key, add-kwargs) added before step k. Returns
    {key: (tokens, final event)} and the batch sizes seen after every step."""
    ids, out, sizes = {}, {}, []
    for k in range(max_steps):
        for key, kw in schedule.get(k, []):
            ids[engine.add(**kw)] = key
        for ev in engine.step():
            toks, _ = out.get(ids[ev.id], ([], None))
            out[ids[ev.id]] = (toks + ev.tokens, ev if ev.finished else None)
        sizes.append(engine.active)
        if not engine.has_work() and k >= max(schedule):
            break
    return out, sizes


def test_requests_joining_at_different_rounds_decode_what_generate_gives_alone(gen):
    prompts = eval_prompts(1)[:6]
    budgets = [12, 30, 8, 40, 25, 60]  # later, longer requests make the caches grow mid-run
    want = [gen.generate([p], n, tree=TREE) for p, n in zip(prompts, budgets)]
    engine = DecodeEngine(gen, TREE, max_batch=3)
    schedule = {0: [(0, dict(prompt_ids=prompts[0], max_new_tokens=budgets[0]))],
                2: [(1, dict(prompt_ids=prompts[1], max_new_tokens=budgets[1])),
                    (2, dict(prompt_ids=prompts[2], max_new_tokens=budgets[2]))],
                3: [(3, dict(prompt_ids=prompts[3], max_new_tokens=budgets[3]))],  # waits: batch full
                5: [(4, dict(prompt_ids=prompts[4], max_new_tokens=budgets[4])),
                    (5, dict(prompt_ids=prompts[5], max_new_tokens=budgets[5]))]}
    out, sizes = run(engine, schedule)
    for i, w in enumerate(want):
        tokens, final = out[i]
        assert tokens == w.token_ids[0], f"request {i}"
        assert final.finish_reason == w.stats[0].finish_reason
        assert final.stats.tokens == len(tokens)
        assert final.stats.accept_hist == w.stats[0].accept_hist  # the same rounds, row by row
    assert max(sizes) == 3 and sizes[-1] == 0
    assert engine.batch.size == 0 and not engine._live  # nothing left behind


def test_requests_with_prompt_lookup_in_the_batch_decode_what_generate_gives_alone(gen):
    """Rows of one batch pad their lookup chains to a common length, so their rounds may differ from
    a lone request's; their tokens may not."""
    tree = TreeParams(num_nodes=10, depth=3, beam_width=3, lookup=5)
    prompts = eval_prompts(1)[:4]
    budgets = [40, 25, 60, 33]
    want = [gen.generate([p], n, tree=tree) for p, n in zip(prompts, budgets)]
    engine = DecodeEngine(gen, tree, max_batch=3)
    schedule = {0: [(i, dict(prompt_ids=prompts[i], max_new_tokens=budgets[i])) for i in range(2)],
                3: [(i, dict(prompt_ids=prompts[i], max_new_tokens=budgets[i])) for i in range(2, 4)]}
    out, _ = run(engine, schedule)
    for i, w in enumerate(want):
        assert out[i][0] == w.token_ids[0], f"request {i}"
        assert out[i][1].finish_reason == w.stats[0].finish_reason
    assert any(k > 3 and c for w in want for k, c in enumerate(w.stats[0].accept_hist)), "no lookup was accepted"


def test_a_seeded_sampled_request_is_the_same_alone_and_among_others(model):
    gen = make_generator(model, draft=True, n=3, ppl=1, aligned=True)
    prompts = eval_prompts(1)
    mine = dict(prompt_ids=prompts[0], max_new_tokens=30,
                sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=11))
    alone, _ = run(DecodeEngine(gen, TREE), {0: [("me", mine)]})
    others = {0: [("a", dict(prompt_ids=prompts[1], max_new_tokens=40,
                             sampling=SamplingParams(temperature=1.0, seed=5)))],
              1: [("b", dict(prompt_ids=prompts[2], max_new_tokens=20))],
              2: [("me", mine)],
              3: [("c", dict(prompt_ids=prompts[3], max_new_tokens=40, sampling=SamplingParams(temperature=0.7)))]}
    among, _ = run(DecodeEngine(gen, TREE, max_batch=4), others)
    assert among["me"][0] == alone["me"][0] and len(alone["me"][0]) > 0
    again, _ = run(DecodeEngine(gen, TREE),
                   {0: [("me", {**mine, "sampling": SamplingParams(temperature=0.9, top_p=0.95, seed=12)})]})
    assert again["me"][0] != alone["me"][0]  # the seed matters


class IdTokenizer:
    """Decodes token id i to ``<i>``: a served text spells its tokens, so it can be compared token by token."""

    eos_token_id = eos_token = chat_template = None

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __len__(self):
        return self.vocab

    def get_vocab(self):
        return {}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def served_tokens(gen, requests):
    """``{request id: token ids}`` of ``requests`` (:class:`GenRequest`) served together by ``poss serve``'s
    engine (its worker thread on the continuous-batching backend)."""
    import asyncio
    import re

    pytest.importorskip("prometheus_client")
    from poss.serve.backend import ContinuousBackend
    from poss.serve.engine import Engine

    async def serve():
        engine = Engine(ContinuousBackend(gen, max_batch=len(requests), tree=TREE))
        engine.start()
        try:
            handles = [engine.submit(r) for r in requests]
            out = {}
            for h in handles:
                events = [ev async for ev in h.events()]
                assert events[-1].finish_reason in ("stop", "length"), events[-1].error
                out[h.request.id] = "".join(ev.text for ev in events)
            return out
        finally:
            engine.stop()

    return {rid: [int(t) for t in re.findall(r"<(\d+)>", text)] for rid, text in asyncio.run(serve()).items()}


def test_a_seeded_request_samples_the_same_through_generate_and_serve_alone_and_in_a_batch(model):
    from poss.decode.generator import Generator
    from poss.serve.backend import GenRequest

    base = make_generator(model, draft=True, n=3, ppl=1, aligned=True)
    gen = Generator(base.runner, tokenizer=IdTokenizer(base.runner.embed.shape[0]), draft=base.draft,
                    end_ids=base.end_ids)
    prompts = eval_prompts(1)
    n = 30
    mine = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    others = [SamplingParams(temperature=1.0, seed=5), SamplingParams(), SamplingParams(temperature=0.7)]
    alone = gen.generate([prompts[0]], n, mine, tree=TREE).token_ids[0]
    batch = gen.generate([prompts[1], prompts[0], prompts[2], prompts[3]], n, [others[0], mine] + others[1:],
                         tree=TREE).token_ids[1]

    def request(rid, prompt, sp):
        return GenRequest(rid, list(prompt), n, temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed)

    served_alone = served_tokens(gen, [request("me", prompts[0], mine)])["me"]
    served_batch = served_tokens(gen, [request("a", prompts[1], others[0]), request("me", prompts[0], mine),
                                       request("b", prompts[2], others[1]), request("c", prompts[3], others[2])])["me"]
    assert len(alone) > 1
    assert batch == alone and served_alone == alone and served_batch == alone
    other_seed = gen.generate([prompts[0]], n, SamplingParams(temperature=0.9, top_p=0.95, seed=12), tree=TREE)
    assert other_seed.token_ids[0] != alone  # the seed matters


def test_cancel_mid_way_then_a_new_request_is_served_with_no_ghost_rows(gen):
    prompts = eval_prompts(1)
    engine = DecodeEngine(gen, TREE, max_batch=2)
    gone = engine.add(prompts[0], 60)
    stay = engine.add(prompts[1], 40)
    got = {gone: [], stay: []}
    for _ in range(3):
        for ev in engine.step():
            got[ev.id] += ev.tokens
    assert engine.active == 2 and not engine.batch.requests[0].finished
    assert engine.cancel(gone) and not engine.cancel(gone)  # a second cancel is a no-op
    late = engine.add(prompts[2], 25)  # waits for the cancelled row's slot
    got[late] = []
    finals = {}
    while engine.has_work():
        for ev in engine.step():
            got[ev.id] += ev.tokens
            if ev.finished:
                finals[ev.id] = ev
                assert ev.id != gone or not ev.tokens
        assert engine.active <= 2
        assert all(not r.finished for r in engine.batch.requests)  # finished rows leave at once
        assert gone not in [r.index for r in engine.batch.requests]
    assert finals[gone].finish_reason == "cancelled"
    assert got[stay] == gen.generate([prompts[1]], 40, tree=TREE).token_ids[0]
    assert got[late] == gen.generate([prompts[2]], 25, tree=TREE).token_ids[0]
    assert engine.active == 0 and engine.pending == 0 and not engine._live
    # a waiting request cancelled before it ran ends at the next step, without a prefill
    w = engine.add(prompts[3], 10)
    assert engine.cancel(w) and engine.pending == 0
    evs = engine.step()
    assert [(e.id, e.finish_reason, e.tokens) for e in evs] == [(w, "cancelled", [])]


def test_zero_and_one_token_requests_and_bad_requests(gen):
    prompts = eval_prompts(1)
    engine = DecodeEngine(gen, TREE)
    a, b, _ = engine.add(prompts[0], 0), engine.add(prompts[1], 1), engine.add(prompts[2], 5)
    evs = {e.id: e for e in engine.step()}
    assert evs[a].finished and evs[a].finish_reason == "length" and evs[a].tokens == []
    assert evs[b].finished and evs[b].tokens == gen.generate([prompts[1]], 1, tree=TREE).token_ids[0]
    assert engine.active == 1  # only c runs the round
    with pytest.raises(ValueError, match="empty"):
        engine.add([], 5)
    with pytest.raises(ValueError, match="context limit"):
        engine.add([5] * gen.context_limit, 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add(prompts[0], -1)


def test_continuous_backend_events_text_and_refusals(model):
    """The serve backend on the engine: text pieces add up to ``generate``'s text, a refused request
    fails alone, a failing round fails what it held and the backend keeps serving."""
    from poss.serve.backend import ContinuousBackend, GenRequest

    gen = make_generator(model, draft=True, n=3, ppl=1, aligned=True)
    prompts = eval_prompts(1)
    backend = ContinuousBackend(gen, max_batch=2, tree=TREE)
    backend.add(GenRequest("a", prompts[0], 20))
    backend.add(GenRequest("too-long", [5] * gen.context_limit, 5))
    assert backend.free_slots() == 1
    events = []
    while backend.has_work():
        events += backend.step()
    finals = {e.id: e for e in events if e.finished}
    assert finals["too-long"].finish_reason == "error" and "context limit" in finals["too-long"].error
    want = gen.generate([prompts[0]], 20, tree=TREE)
    assert finals["a"].stats.completion_tokens == len(want.token_ids[0])
    assert finals["a"].finish_reason == {"eos": "stop"}.get(want.stats[0].finish_reason, "length")
    backend.add(GenRequest("b", prompts[1], 10))
    real_round, gen.round = gen.round, None  # a round that fails
    try:
        evs = backend.step()
    finally:
        gen.round = real_round
    assert [(e.id, e.finish_reason) for e in evs] == [("b", "error")]
    assert backend.active() == 0 and not backend.has_work()
    backend.add(GenRequest("c", prompts[2], 8))
    while backend.has_work():
        evs = backend.step()
    assert (evs[-1].id == "c"
            and evs[-1].stats.completion_tokens == len(gen.generate([prompts[2]], 8, tree=TREE).token_ids[0]))


def test_batches_over_the_speculation_limit_take_plain_rounds_and_stay_greedy(model):
    """Three live requests with a limit of 2: plain rounds (one token each) until the short one ends,
    then the other two speculate again, the draft catching up on the pairs it missed."""
    gen = make_generator(model, draft=True, n=3, ppl=1, aligned=True)
    prompts = eval_prompts(1)[:3]
    budgets = [8, 40, 60]
    want = [gen.generate([p], n, tree=TREE) for p, n in zip(prompts, budgets)]
    engine = DecodeEngine(gen, TREE, max_batch=3, speculate_max_batch=2)
    out, sizes = run(engine, {0: [(i, dict(prompt_ids=p, max_new_tokens=n))
                                  for i, (p, n) in enumerate(zip(prompts, budgets))]})
    assert sizes[0] == 3
    for i, w in enumerate(want):
        assert out[i][0] == w.token_ids[0], f"request {i}"
    short = out[0][1].stats.accept_hist
    assert sum(short) == budgets[0] - 1 and sum(short[1:]) == 0  # only plain rounds while 3 were live
    hists = [out[i][1].stats.accept_hist for i in (1, 2)]
    assert all(h[0] >= budgets[0] - 1 for h in hists)
    assert any(sum(h[1:]) for h in hists)  # then speculation resumed


@pytest.mark.parametrize("bad", [0, -1, "sometimes", 2.5])
def test_bad_speculation_limit_is_a_clear_error(model, bad):
    gen = make_generator(model, draft=True, n=3, ppl=1, aligned=True)
    with pytest.raises(ValueError, match="speculate_max_batch"):
        DecodeEngine(gen, TREE, speculate_max_batch=bad)


def test_batch_limit_is_the_last_size_where_the_tree_still_wins():
    from poss.decode.autotune import batch_limit

    assert batch_limit({2: (10.0, 12.0), 4: (20.0, 21.0), 8: (30.0, 25.0), 16: (40.0, 50.0)}) == 4
    assert batch_limit({2: (10.0, 9.0), 4: (20.0, 30.0)}) == 1
    assert batch_limit({2: (10.0, 12.0), 4: (20.0, 21.0)}) is None


def test_measure_batches_times_both_round_kinds_at_each_size(model, monkeypatch):
    from poss.decode import autotune

    gen = make_generator(model, draft=True, n=3, ppl=1, aligned=True)
    seen = []
    run_greedy = autotune.run_greedy

    def recording(g, prompts, *a, **k):
        seen.append([list(p) for p in prompts])
        return run_greedy(g, prompts, *a, **k)

    monkeypatch.setattr(autotune, "run_greedy", recording)
    prompts = eval_prompts(1)[:2]  # token ids
    got = autotune.measure_batches(gen, TREE, prompts, batches=(2, 3), new_tokens=6)
    assert sorted(got) == [2, 3] and all(ar > 0 and spec > 0 for ar, spec in got.values())
    assert gen.profile is None and gen.end_ids == make_generator(model).end_ids  # the generator untouched
    # distinct requests (copies of one prompt would accept alike), reused in turn past the list's end
    firsts = [list(p) for p in prompts]
    assert seen[0] == firsts and seen[-1] == [firsts[0], firsts[1], firsts[0]]
