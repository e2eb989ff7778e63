"""Tree size by measurement (poss.decode.cost_model, poss.decode.autotune): the selection logic on synthetic costs and
acceptance profiles (deterministic), and a lossless generate with the tree it picks on a tiny model."""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.loop import (
    eval_prompts,
    hf_greedy,
    make_generator,
    single_thread,  # noqa: F401  (autouse: one CPU thread)
    tiny_target,
)
from poss import hardware
from poss.decode import autotune, cost_model
from poss.decode.autotune import auto_tree
from poss.decode.cost_model import (
    Calibration,
    choose,
    draft_model,
    draft_ms,
    expected_tokens,
    fit_acceptance,
    score_table,
)
from poss.decode.params import TreeParams


def cal(verify, draft, acc, s=1.0, beta=0.5):
    return Calibration(dict(verify), list(draft), list(acc), s, beta)


def test_expected_tokens_model():
    acc = [0.5, 0.4, 0.3]
    assert expected_tokens(acc, 1, 0) == 1.0
    # one node per level (a chain): 1 + a1 + a1*a2 with a_i = p_i
    assert expected_tokens(acc, 4, 3, beta=0.5) == pytest.approx(1 + 0.5 + 0.5 * 0.4 + 0.5 * 0.4 * 0.3)
    # wider trees accept more, deeper trees accept more, never more than depth + 1
    assert expected_tokens(acc, 16, 3) > expected_tokens(acc, 4, 3)
    assert expected_tokens(acc, 16, 3) > expected_tokens(acc, 16, 2)
    assert expected_tokens([1.0], 60, 6) == pytest.approx(7.0)
    # beyond the trained positions the last accuracy repeats; a tree shallower than its depth is capped
    assert expected_tokens(acc, 3, 6) == expected_tokens(acc, 3, 2)


FLAT = {1: 30.0, 4: 31.0, 8: 32.0, 16: 34.0, 32: 38.0, 60: 45.0}  # a GPU-like verify: nearly free nodes
STEEP = {1: 30.0, 4: 45.0, 8: 60.0, 16: 90.0, 32: 150.0, 60: 250.0}  # a small CPU: every node costs
DRAFT = [(T, d, 2.0 * d) for T, d in cost_model.CALIBRATION if d]  # 2 ms a level, whatever its width


def test_cheap_verify_and_good_draft_pick_a_big_deep_tree():
    t = choose(cal(FLAT, DRAFT, [0.8] * 6))
    assert t.num_nodes >= 32 and t.depth >= 5


def test_expensive_verify_picks_a_small_tree():
    t = choose(cal(STEEP, DRAFT, [0.8] * 6))
    assert 1 < t.num_nodes <= 8


def test_weak_draft_or_expensive_draft_falls_back_to_plain_decoding():
    assert choose(cal(STEEP, DRAFT, [0.05] * 6)) == TreeParams(num_nodes=1, depth=0)
    assert choose(cal(FLAT, [(T, d, 100.0) for T, d, _ in DRAFT], [0.2] * 6)) == TreeParams(num_nodes=1, depth=0)


def test_choice_is_the_best_row_and_deterministic():
    c = cal(STEEP, DRAFT, [0.6, 0.5, 0.4, 0.4, 0.3, 0.3])
    rows = score_table(c)
    assert rows[0]["tokens_per_s"] == max(r["tokens_per_s"] for r in rows)
    assert (rows[0]["num_nodes"], rows[0]["depth"]) == (choose(c).num_nodes, choose(c).depth)
    assert choose(c) == choose(cal(STEEP, DRAFT, [0.6, 0.5, 0.4, 0.4, 0.3, 0.3]))
    assert all(r["depth"] < r["num_nodes"] or r["num_nodes"] == 1 for r in rows)


def test_draft_cost_model_by_depth_and_beam_width():
    # first level 1.5 ms; a further level 1.0 ms over a 3-node beam, 3.0 over the full 10; the widest
    # depth-3 tree spends 0.7 ms more (a specialist's catch-up)
    timed = [(4, 1, 1.5), (4, 2, 2.5), (16, 2, 4.5), (16, 3, 1.5 + 2 * 3.0 + 0.7)]
    first, level, catch_up = draft_model(timed)
    assert first == 1.5 and level == pytest.approx({3: 1.0, 10: 3.0})
    assert catch_up == pytest.approx({1: 0, 2: 0, 3: 0.7})
    c = cal(STEEP, timed, [0.5])
    assert draft_ms(c, 4, 0) == 0.0 and draft_ms(c, 60, 1) == 1.5
    assert draft_ms(c, 4, 2) == pytest.approx(2.5) and draft_ms(c, 16, 2) == pytest.approx(4.5)
    assert draft_ms(c, 4, 3) == pytest.approx(1.5 + 2 * 1.0 + 0.7)
    assert draft_ms(c, 8, 2) == pytest.approx(1.5 + 1.0 + 2.0 * 4 / 7)  # beam 7: between 3 and 10
    assert draft_ms(c, 60, 6) == pytest.approx(1.5 + 5 * 3.0 + 0.7)  # deeper than timed: the last catch-up
    assert draft_ms(c, 60, 2, beam_width=4) == pytest.approx(1.5 + 1.0 + 2.0 / 7)  # a narrower beam asked for


def test_a_cheap_narrow_level_lets_a_small_tree_go_deeper():
    # The same timings, except what a level over a 3-node beam costs: cheap, a 4-node tree drafts two
    # levels; as dear as a full-width level, one.
    verify = {1: 30.0, 2: 31.0, 4: 32.0, 6: 60.0, 8: 70.0, 16: 90.0, 32: 150.0, 60: 250.0}
    acc = [0.6, 0.6, 0.5, 0.5, 0.5, 0.5]
    wide = [(4, 1, 1.0), (4, 2, 13.0), (6, 2, 13.0), (8, 2, 13.0), (16, 2, 13.0), (16, 3, 25.0)]
    cheap = [(4, 2, 2.0)] + [x for x in wide if x[:2] != (4, 2)]
    assert (choose(cal(verify, wide, acc)).num_nodes, choose(cal(verify, wide, acc)).depth) == (4, 1)
    assert (choose(cal(verify, cheap, acc)).num_nodes, choose(cal(verify, cheap, acc)).depth) == (4, 2)


def test_a_timed_tree_is_scored_with_its_measured_tau():
    c = cal(STEEP, DRAFT, [0.5, 0.4, 0.3])
    c.measured_tau = [(4, 1, 2.2), (16, 3, 1.2)]
    rows = {(r["num_nodes"], r["depth"]): r for r in score_table(c)}
    assert rows[(4, 1)]["measured"] and rows[(4, 1)]["tokens_per_round"] == 2.2
    assert rows[(16, 3)]["tokens_per_round"] == 1.2
    model = expected_tokens(c.acc, 8, 2, 10, c.s, c.beta)
    assert not rows[(8, 2)]["measured"] and rows[(8, 2)]["tokens_per_round"] == model
    # another beam drafts another 16-node tree: the model; the 4-node tree is the same at beam 4
    rows4 = {(r["num_nodes"], r["depth"]): r for r in score_table(c, beam_width=4)}
    assert rows4[(16, 3)]["tokens_per_round"] == expected_tokens(c.acc, 16, 3, 4, c.s, c.beta)
    assert rows4[(4, 1)]["tokens_per_round"] == 2.2
    assert choose(c) == TreeParams(num_nodes=4, depth=1)


def test_fit_recovers_the_acceptance_parameters():
    acc = [0.3, 0.25, 0.2, 0.2, 0.2, 0.2]
    pts = [(T, d, expected_tokens(acc, T, d, 10, 1.5, 0.35)) for T, d in cost_model.CALIBRATION]
    s, beta = fit_acceptance(acc, pts)
    assert s == pytest.approx(1.5, abs=0.051) and beta == pytest.approx(0.35, abs=0.051)
    assert fit_acceptance(acc, [(1, 0, 1.0)]) == (cost_model.DEFAULT_S, cost_model.DEFAULT_BETA)


def test_calibration_round_trips_through_json():
    c = cal(STEEP, DRAFT, [0.3])
    c.measured_tau = [(8, 2, 1.4)]
    assert Calibration.from_json(json.loads(json.dumps(c.to_json()))) == c and c.draft_ms == DRAFT


NEW = 48
PROMPTS = eval_prompts(n_per_set=1)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_auto_tree_is_measured_cached_and_lossless(target, tmp_path, monkeypatch):
    monkeypatch.setenv("POSS_CACHE", str(tmp_path))
    gen = make_generator(target, draft=True, n=3, ppl=2, aligned=True)
    gen.draft.config.training = {"val": {"acc": [0.5, 0.4, 0.3]}}
    prompts = PROMPTS[:2]
    c = autotune.calibrate(gen, new_tokens=12, prompts=prompts)
    assert set(c.verify_ms) == set(cost_model.SIZES) and {d for _, d, _ in c.draft_ms} == set(cost_model.DEPTHS)
    timed = [(T, d) for T, d in cost_model.CALIBRATION if d]
    assert all(v > 0 for v in c.verify_ms.values()) and [(T, d) for T, d, _ in c.measured_tau] == timed
    assert c.acc == [0.5, 0.4, 0.3] and c.key["threads"] == 1 and c.key["dtype"] == "float32"
    files = list((tmp_path / "autotune").glob("*.json"))
    assert len(files) == 1
    # the second call reads the cache (no timing: generate must not run)
    monkeypatch.setattr(autotune, "measure", lambda *a, **k: pytest.fail("measured twice"))
    tree, source = auto_tree(gen)
    assert tree == choose(c) and source == "timed on this machine"
    for p in PROMPTS:
        assert gen.generate([p], NEW, tree=tree).token_ids[0] == hf_greedy(target, p, NEW)


def close_small_trees():
    """A calibration whose three prompts put 4/1 ahead of 4/2 by a hair (2/1 just behind)."""
    c = cal({1: 10.0, 2: 10.2, 4: 10.5, 6: 13.0, 8: 16.0, 16: 25.0, 32: 45.0, 60: 80.0},
            [(2, 1, 1.0), (4, 1, 1.0), (4, 2, 2.0)], [0.6, 0.5, 0.5], s=0.6, beta=0.2)
    c.rounds = [(2, 1, 133, 100), (4, 1, 147, 100), (4, 2, 152, 100)]
    c.measured_tau = [(T, d, n / r) for T, d, n, r in c.rounds]
    return c


class DraftedGen:
    draft = object()


def test_refine_pools_the_best_trees_tau_over_more_prompts(monkeypatch):
    """Three prompts put 4/1 ahead of 4/2 by a hair; more text on the contenders reverses it."""
    c = close_small_trees()
    assert choose(c) == TreeParams(4, 1)
    top = [(r["num_nodes"], r["depth"]) for r in score_table(c) if r["depth"]][:autotune.REFINE_TOP]
    assert (4, 2) in top
    asked = []

    def fake_time(gen, prompts, new_tokens, configs, deadline=None):
        asked.append((len(prompts), list(configs)))
        return {}, {}, {k: ([380, 190, 570] if k == (4, 2) else [300, 200, 600]) for k in configs}, len(prompts)

    monkeypatch.setattr(autotune, "time_configs", fake_time)
    r = autotune.refine(DraftedGen(), c, ["p"] * 6, 64, rows=0)
    assert asked == [(6, top)] and r.lookup == []
    taus = {(T, d): tau for T, d, tau in r.measured_tau}
    assert taus[(4, 2)] == (152 + 380) / (100 + 190) and taus[(4, 1)] == (147 + 300) / (100 + 200)
    assert r.verify_ms == c.verify_ms and r.draft_ms == c.draft_ms
    assert choose(r) == TreeParams(4, 2)


def refined_with_chains(monkeypatch, gain: float, rows_per_round: float):
    """The calibration of the test above refined with chains that fill each tree to 8 rows, whose tau
    is ``gain`` x their plain tree's over ``rows_per_round`` rows; returns it and the configs timed."""
    c = close_small_trees()
    asked = []

    def fake_time(gen, prompts, new_tokens, configs, deadline=None):
        asked.append(list(configs))
        return {}, {}, {k: ([int(300 * gain), 200, int(200 * (rows_per_round - 1))] if len(k) == 3
                            else [300, 200, 200 * (k[0] - 1)]) for k in configs}, len(prompts)

    monkeypatch.setattr(autotune, "time_configs", fake_time)
    return autotune.refine(DraftedGen(), c, ["p"] * 4, 64, rows=8), asked[0]


def test_chains_fill_trees_to_the_row_budget():
    assert [cost_model.chain_tokens(T, 8) for T in (2, 3, 4, 6, 8, 16)] == [6, 5, 4, 2, 2, 2]
    assert cost_model.chain_tokens(4, 6) == 2


def test_refine_times_the_best_trees_and_the_small_depth_1_trees_with_a_chain(monkeypatch):
    r, asked = refined_with_chains(monkeypatch, 1.5, 5.0)
    plain = [c for c in asked if len(c) == 2]
    top2 = plain[:autotune.LOOKUP_TREES]
    always = [(2, 1), (3, 1), (4, 1)]
    assert list(autotune.LOOKUP_ALWAYS) == always
    assert set(always) <= set(plain) and len(plain) == len(set(plain))
    chained = [(T, d, 8 - T if T < 6 else 2) for T, d in dict.fromkeys(top2 + always)]
    assert [c for c in asked if len(c) == 3] == chained
    assert sorted(r.lookup) == sorted((*c, 1.5, 5.0) for c in chained)


def test_a_chain_that_pays_is_chosen_one_that_only_adds_rows_is_not(monkeypatch):
    r, _ = refined_with_chains(monkeypatch, 1.0, 5.0)  # same tau, more rows: never better
    assert choose(r).lookup == 0
    r, _ = refined_with_chains(monkeypatch, 2.0, 6.0)
    # By hand: refining pools 300 tokens in 200 rounds into every plain tree, so 3/1 (timed only now)
    # makes 300 / 200 = 1.5 tokens a round, 4/1 (147 + 300) / 300 = 1.49, 4/2 1.507, 2/1 1.443; a
    # chain doubles that over 6 rows: verify(6) = 13.0 ms plus 1.0 ms of drafting at depth 1 (2.0 at
    # depth 2). 3/1 + 5: 3.0 / 14 ms = 214 tokens/s; 4/1 + 4: 213; 2/1 + 6: 206; 4/2 + 4: 201; the best
    # plain tree, 4/2: 1.507 / 12.5 ms = 121.
    best = choose(r)
    assert (best.num_nodes, best.depth, best.lookup) == (3, 1, 5)
    row = score_table(r)[0]
    assert row["tokens_per_round"] == pytest.approx(2.0 * 1.5)
    assert row["ms_per_round"] == pytest.approx(13.0 + 1.0)


def test_refinement_times_only_the_contenders_again(target, tmp_path, monkeypatch):
    monkeypatch.setenv("POSS_CACHE", str(tmp_path))
    gen = make_generator(target, draft=True, n=3, ppl=2, aligned=True)
    gen.draft.config.training = {"val": {"acc": [0.5, 0.4, 0.3]}}
    c = autotune.calibrate(gen, new_tokens=12, prompts=PROMPTS[:1], more_prompts=PROMPTS[1:3], more_tokens=20)
    tokens = {(T, d): n for T, d, n, _ in c.rounds}
    again = sorted(k for k, n in tokens.items() if n != 11)  # 11 tokens a prompt after the first
    # the contenders, plus the chained trees' plain runs where they were not contenders
    assert set(autotune.LOOKUP_ALWAYS) <= set(again)
    assert autotune.REFINE_TOP <= len(again) <= autotune.REFINE_TOP + len(autotune.LOOKUP_ALWAYS)
    assert all(tokens[k] in (2 * 19, 11 + 2 * 19) for k in again)
    rows = autotune.lookup_rows(gen)
    assert {(T, d) for T, d, K, _, _ in c.lookup} <= set(again) and (2, 1, rows - 2) in [x[:3] for x in c.lookup]
    # a drafted round verifies the tree and its chain's K rows, spare draft tokens filling what the chain left
    assert all(ratio > 0 and K == cost_model.chain_tokens(T, rows) and per_round == T + K
               for T, d, K, ratio, per_round in c.lookup)
    assert c.key["n_prompts"] == 1 and c.key["n_more_prompts"] == 2
    assert {(T, d): n / r for T, d, n, r in c.rounds} == {(T, d): tau for T, d, tau in c.measured_tau}


def test_auto_tree_without_draft_is_plain_decoding(target):
    gen = make_generator(target, draft=False)
    assert auto_tree(gen) == (TreeParams(num_nodes=1, depth=0), "no draft")


def test_cache_key_names_machine_dtype_and_models(target):
    gen = make_generator(target, draft=True, dtype=torch.bfloat16)
    k = autotune.cache_key(gen)
    assert k["dtype"] == "bfloat16" and k["threads"] == torch.get_num_threads()
    assert len(k["target"]) == 16 and len(k["draft"]) == 16
    other = make_generator(target, draft=True, dtype=torch.bfloat16, seed=1)
    assert autotune.cache_path(autotune.cache_key(other)) != autotune.cache_path(k)
    # a datastore changes what the lookup chains are worth: its timings are kept apart
    from poss.decode.datastore import Datastore

    assert k["datastore"] is None
    gen.datastore = Datastore.from_documents([[1, 2, 3, 4]])
    keyed = autotune.cache_key(gen)
    assert keyed["datastore"] == gen.datastore.fingerprint and autotune.cache_path(keyed) != autotune.cache_path(k)
    # so does the draft's head: the same weights scoring K rows or all of them (PosSDraft.load's vocab)
    reduced = make_generator(target, draft=True, dtype=torch.bfloat16, draft_vocab=40)
    full = make_generator(target, draft=True, dtype=torch.bfloat16, draft_vocab=40)
    full.draft.token_map, full.draft.config.draft_vocab = None, 0
    kr, kf = autotune.cache_key(reduced), autotune.cache_key(full)
    assert kr["draft"] == kf["draft"] and (kr["draft_vocab"], kf["draft_vocab"]) == (40, 0)
    assert autotune.cache_path(kr) != autotune.cache_path(kf)
    # and compiling the steps: an eager calibration does not size the tree of a compiled generator
    from poss.decode.loader import compile_steps

    compiled = compile_steps(make_generator(target, draft=True, dtype=torch.bfloat16))
    kc = autotune.cache_key(compiled)
    assert (k["compiled"], kc["compiled"]) == (False, True)
    assert autotune.cache_path(kc) != autotune.cache_path(k)


def test_auto_default_tree_is_resolved_once_and_overridable(target, monkeypatch):
    gen = make_generator(target, draft=True)
    picked = TreeParams(num_nodes=8, depth=3, beam_width=4)
    calls = []

    def fake_auto(g, beam_width=10):
        calls.append(beam_width)
        return autotune.AutoTree(TreeParams(picked.num_nodes, picked.depth, beam_width), "fake")

    monkeypatch.setattr(autotune, "auto_tree", fake_auto)
    assert gen.resolve_tree() == TreeParams()  # a bare Generator keeps the fixed default
    gen.default_tree = "auto"
    assert gen.resolve_tree() == TreeParams(8, 3, 10)
    assert gen.resolve_tree("auto", beam_width=4) == picked
    assert gen.resolve_tree() == TreeParams(8, 3, 10) and calls == [10, 4]  # kept per beam width
    # naming a size leaves auto for the fixed defaults of the rest
    assert gen.resolve_tree(num_nodes=16) == TreeParams(num_nodes=16, depth=6)
    assert gen.resolve_tree("auto", depth=2) == TreeParams(num_nodes=60, depth=2)
    p = PROMPTS[0]
    assert gen.generate([p], NEW).token_ids[0] == hf_greedy(target, p, NEW)
    with pytest.raises(ValueError, match="tree must be a TreeParams or 'auto'"):
        gen.resolve_tree("big")
    with pytest.raises(TypeError, match="tree must be a TreeParams or 'auto'"):
        gen.resolve_tree((60, 6))


# -- timings taken on a busy machine: warned about, recorded, and forgotten on request ---------------
def _fake_measure(calls):
    def measure(gen, prompts, new_tokens=32, **kw):
        calls.append(len(prompts))
        return cal({1: 10.0, 4: 11.0}, [(4, 1, 1.0)], [0.5])
    return measure


def test_forget_drops_only_this_generators_timings(target, tmp_path, monkeypatch):
    monkeypatch.setenv("POSS_CACHE", str(tmp_path))
    gen = make_generator(target, draft=True, n=3, ppl=2, aligned=True)
    other = make_generator(target, draft=True, n=3, ppl=2, aligned=True, seed=1)  # another draft's weights
    folder = tmp_path / "autotune"
    folder.mkdir()
    mine, theirs = autotune.cache_key(gen), autotune.cache_key(other)
    files = {
        "calibration": autotune.cache_path(mine),
        "batch limit": autotune.cache_path({**mine, "batch_limit_for": [4, 2, 10], "batches": [2, 4]}),
        "other draft": autotune.cache_path(theirs),
    }
    files["calibration"].write_text(json.dumps({"key": {**mine, "seconds": 1.0}}))
    files["batch limit"].write_text(json.dumps({"key": {**mine, "batch_limit_for": [4, 2, 10]}, "limit": 1}))
    files["other draft"].write_text(json.dumps({"key": {**theirs, "seconds": 1.0}}))
    (folder / "broken.json").write_text("{not json")
    assert autotune.forget(gen) == 2
    assert sorted(p.name for p in folder.glob("*.json")) == sorted(["broken.json", files["other draft"].name])
    # with its file gone, the next calibration measures again (and caches the new result)
    calls = []
    monkeypatch.setattr(autotune, "measure", _fake_measure(calls))
    autotune.calibrate(gen, prompts=PROMPTS[:1])
    assert calls == [1] and files["calibration"].exists()


def test_a_busy_machine_warns_and_the_load_is_recorded(target, tmp_path, monkeypatch):
    import os
    import warnings

    monkeypatch.setenv("POSS_CACHE", str(tmp_path))
    gen = make_generator(target, draft=True, n=3, ppl=2, aligned=True)
    monkeypatch.setattr(autotune, "measure", _fake_measure([]))
    monkeypatch.setattr(hardware, "usable_cores", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.5, 2.0, 1.0))
    monkeypatch.setattr(hardware, "own_load", lambda: 0.0)
    monkeypatch.setattr(hardware, "others_busy_now", lambda *a, **k: None)  # the load average alone decides
    with pytest.warns(RuntimeWarning, match=r"busy \(load average 3.5 on 2 cores\).*poss tune"):
        c = autotune.calibrate(gen, prompts=PROMPTS[:1])
    assert c.key["loadavg"] == 3.5
    assert json.loads(autotune.cache_path(autotune.cache_key(gen)).read_text())["key"]["loadavg"] == 3.5
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 2.0, 1.0))  # one core still free: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert autotune.calibrate(gen, prompts=PROMPTS[:1], refresh=True).key["loadavg"] == 1.9
        # the load of this process's own threads (a benchmark's earlier rows) is not someone else's
        monkeypatch.setattr(os, "getloadavg", lambda: (2.4, 2.0, 1.0))
        monkeypatch.setattr(hardware, "own_load", lambda: 1.9)
        assert autotune.calibrate(gen, prompts=PROMPTS[:1], refresh=True).key["loadavg"] == 2.4


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_own_load_is_this_process_cpu_time_over_at_least_a_minute():
    # A fresh process (younger than a minute): its share is its CPU seconds / 60, whatever else it did.
    code = ("import resource, time\nfrom poss.hardware import own_load\n"
            "t = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
            "got = own_load()\nu = resource.getrusage(resource.RUSAGE_SELF)\n"
            "print(got, (u.ru_utime + u.ru_stime) / 60)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    got, want = map(float, out.stdout.split())
    assert want >= 0.5 / 60 and got == pytest.approx(want, rel=0.05)


def test_block_timings_are_keyed_by_the_qlinear_kernel():
    """Timings on GGUF blocks depend on the int8 kernel that runs them (POSS_QLINEAR or a force may pick
    another than the best): the calibration's key names it, with the kernels' revision."""
    import poss_ext
    from helpers.qlinear_kernels import kernel

    best = autotune._qlinear_revision()
    assert best.startswith(poss_ext.ops.cpu_qlinear_kernel(True) + "-r")
    with kernel("scalar"):
        assert autotune._qlinear_revision().startswith("scalar-r") and autotune._qlinear_revision() != best
