"""The lookup datastore (poss.decode.datastore): its n-gram index against a brute-force search, its
file, its checks, and the loop with it: greedy token-identical to HF, sampling exact."""

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.loop import eval_prompts, hf_greedy, make_generator, single_thread, tiny_target  # noqa: F401
from helpers.sampling import PROMPT, V, chi2_pvalue, exact_distribution, sample
from poss.decode.datastore import SEPARATOR, Datastore, shipped_datastore_path
from poss.decode.draft_tree import Tree
from poss.decode.loader import load_datastore
from poss.decode.lookup import add_lookup
from poss.decode.params import TreeParams


def reference(docs, context, k, min_ngram=2, max_ngram=6):
    """The definition, by brute force: the longest n whose window ends some document's position (with
    a token after it), the latest such position over the documents in order, then up to k tokens of
    that document."""
    for n in range(min(max_ngram, len(context)), min_ngram - 1, -1):
        found = None
        for d, doc in enumerate(docs):
            for e in range(n, len(doc)):
                if doc[e - n:e] == list(context[len(context) - n:]):
                    found = (d, e)
        if found is not None:
            d, e = found
            return docs[d][e:e + k]
    return []


docs_strategy = st.lists(st.lists(st.integers(0, 4) | st.integers(0, 2**31 - 1), max_size=30), max_size=5)


@settings(max_examples=200, deadline=None)
@given(docs_strategy, st.lists(st.integers(0, 4), max_size=12), st.integers(0, 7), st.integers(1, 3),
       st.integers(0, 4))
def test_continuation_matches_the_brute_force_definition(docs, context, k, min_ngram, extra):
    store = Datastore.from_documents(docs, min_ngram=min_ngram, max_ngram=min_ngram + extra)
    want = reference(docs, context, k, min_ngram, min_ngram + extra) if k > 0 else []
    assert store.continuation(context, k) == want


def test_the_longest_ngram_wins_and_chains_stop_at_their_document():
    store = Datastore.from_documents([[1, 2, 3, 4, 5], [9, 3, 7, 7], [8, 2, 3, 6]])
    assert store.continuation([0, 1, 2, 3], 4) == [4, 5]  # 3-gram (1, 2, 3) beats the later 2-gram (2, 3)
    assert store.continuation([5, 2, 3], 4) == [6]  # the latest (2, 3), cut at its document's end
    assert store.continuation([4, 5], 3) == []  # (4, 5) ends a document: nothing follows it
    assert store.continuation([3], 3) == []  # shorter than min_ngram
    assert len(store) == 13


@pytest.mark.parametrize("big", [False, True], ids=["uint16", "int32"])
def test_a_saved_datastore_loads_with_the_same_text_and_meta(tmp_path, big):
    docs = [[1, 2, 3, 65534 if not big else 70000], [4, 5]]
    store = Datastore.from_documents(docs, meta={"target_fingerprint": "abc"})
    store.save(tmp_path / "s.npz")
    with np.load(tmp_path / "s.npz") as f:
        assert f["tokens"].dtype == (np.int32 if big else np.uint16)
    back = Datastore.load(tmp_path / "s.npz")
    assert back.tokens.tolist() == store.tokens.tolist() == docs[0] + [SEPARATOR] + docs[1] + [SEPARATOR]
    assert back.meta == {"target_fingerprint": "abc"} and back.fingerprint == store.fingerprint
    assert back.continuation([1, 2], 5) == docs[0][2:]


def test_bad_input_names_what_was_expected(tmp_path):
    with pytest.raises(ValueError, match="1-D integer"):
        Datastore(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="1-D integer"):
        Datastore(np.zeros(3))
    with pytest.raises(ValueError, match=r"ids in \[0, 2\*\*31\)"):
        Datastore([1, -5, 2])
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        Datastore([1, 2], min_ngram=3, max_ngram=2)
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not a poss datastore"):
        Datastore.load(tmp_path / "other.npz")


class FakeRunner:
    def __init__(self, fingerprint):
        self._f = fingerprint

    def fingerprint(self):
        return self._f


def test_load_datastore_checks_the_target(tmp_path):
    Datastore.from_documents([[1, 2, 3]], meta={"target_fingerprint": "aaaa"}).save(tmp_path / "s.npz")
    assert load_datastore(tmp_path / "s.npz", "x", FakeRunner("aaaa")).continuation([1, 2], 1) == [3]
    with pytest.raises(ValueError, match="made by target weights aaaa"):
        load_datastore(tmp_path / "s.npz", "x", FakeRunner("bbbb"))
    with pytest.raises(ValueError, match="datastore: no file"):
        load_datastore(tmp_path / "missing.npz", "x", FakeRunner("aaaa"))
    assert load_datastore(None, "smollm2-135m", FakeRunner("aaaa")) is None
    assert load_datastore("auto", "not-a-registry-name", FakeRunner("aaaa")) is None
    # the shipped file belongs to the registry's weights: other weights under the name get none
    assert load_datastore("auto", "smollm2-135m", FakeRunner("bbbb")) is None


def test_add_lookup_asks_the_datastore_only_where_the_context_has_no_match():
    i32 = dict(dtype=torch.int32)
    tree = Tree(torch.tensor([[5, 1], [6, 1]]), torch.tensor([[-1, 0], [-1, 0]], **i32),
                torch.tensor([[0, 1], [0, 1]], **i32))
    store = Datastore.from_documents([[2, 6, 8, 9], [7, 5, 4, 4]])
    out = add_lookup(tree, [[5, 3, 7, 5], [2, 6]], 3, store)
    # row 0: its context continues 5 with [3, 7, 5]; row 1: no earlier 6, so the datastore's (2, 6) -> [8, 9]
    assert out.tokens.tolist() == [[5, 1, 3, 7, 5], [6, 1, 8, 9, 6]]
    assert out.parents.tolist() == [[-1, 0, 0, 2, 3], [-1, 0, 0, 2, 0]]
    assert add_lookup(tree, [[5, 3, 7, 5], [2, 6]], 3).tokens[1].tolist() == [6, 1, 6, 6, 6]


def test_the_shipped_datastore_is_the_shipped_training_answers():
    import lzma
    from pathlib import Path

    path = shipped_datastore_path("smollm2-135m")
    assert path is not None, "python/poss/data/datastores/smollm2-135m.npz is missing"
    store = Datastore.load(path)
    drafts = Path(__file__).resolve().parents[2] / "drafts"
    configs = [json.loads(c.read_text()) for c in drafts.glob("*/config.json")]
    fingerprints = {c["target_fingerprint"] for c in configs if c["target_name"] == "smollm2-135m"}
    assert fingerprints == {store.meta["target_fingerprint"]}
    data = Path(__file__).resolve().parents[2] / "data"
    longest = {}
    for name in store.meta["source"]:
        with lzma.open(data / name / "records.jsonl.xz", "rt") as f:
            for r in map(json.loads, f):
                assert r["split"] in ("train", "val")
                if r["split"] == "train" and len(r["answer_ids"]) > len(longest.get(r["source_index"], ())):
                    longest[r["source_index"]] = r["answer_ids"]
    want = [t for k in sorted(longest) for t in longest[k] + [SEPARATOR]]
    assert store.tokens.tolist() == want  # training answers only: the held-out ones stay unseen


def distill_folder(path, fingerprint, records, packed=False):
    """A minimal ``poss distill`` folder: meta.json and records (``records.jsonl.xz`` when ``packed``)."""
    import lzma

    path.mkdir()
    (path / "meta.json").write_text(json.dumps({"recipe": {"target_fingerprint": fingerprint}}))
    text = "".join(json.dumps(r) + "\n" for r in records)
    if packed:
        (path / "records.jsonl.xz").write_bytes(lzma.compress(text.encode()))
    else:
        (path / "records.jsonl").write_text(text)
    return path


def test_poss_datastore_build_keeps_each_prompts_longest_training_answer(tmp_path, capsys):
    from poss.cli import main

    def rec(src, split, ids):
        return {"source_index": src, "split": split, "answer_ids": ids}

    short = distill_folder(tmp_path / "cap4", "abcd", [rec(2, "train", [7, 8, 9, 1]), rec(0, "train", [5, 6]),
                                                      rec(9, "val", [4, 4, 4])])
    long = distill_folder(tmp_path / "cap8", "abcd", [rec(2, "train", [7, 8, 9, 1, 2, 3]), rec(1, "train", [3])],
                          packed=True)
    out = tmp_path / "sub" / "store.npz"
    assert main(["datastore", "build", str(short), str(long), "--out", str(out)]) == 0
    store = Datastore.load(out)
    # Prompts 0, 1, 2 in source order; prompt 2's longer answer (its cut copy dropped); no held-out answer.
    assert store.tokens.tolist() == [5, 6, SEPARATOR, 3, SEPARATOR, 7, 8, 9, 1, 2, 3, SEPARATOR]
    assert store.meta == {"target_fingerprint": "abcd", "source": ["cap4", "cap8"], "documents": 3, "split": "train"}
    assert "3 answers" in capsys.readouterr().out

    other = distill_folder(tmp_path / "other", "ffff", [rec(0, "train", [1, 2])])
    assert main(["datastore", "build", str(short), str(other), "--out", str(tmp_path / "x.npz")]) == 2
    assert "different targets" in capsys.readouterr().err
    assert main(["datastore", "build", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.npz")]) == 2
    assert "FOLDER" in capsys.readouterr().err
    assert main(["datastore", "build", str(short), "--out", str(tmp_path / "x.txt")]) == 2
    assert "--out" in capsys.readouterr().err
    assert not (tmp_path / "x.npz").exists()


@pytest.fixture(scope="module")
def target():
    model = tiny_target()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("draft", [True, False], ids=["poss2-plus-datastore", "datastore-only"])
def test_greedy_with_a_datastore_matches_hf(target, draft):
    prompts = eval_prompts(n_per_set=2)
    # The target's own continuations of other prompts (what `poss datastore build` collects), and
    # random text whose chains the target rejects.
    others = eval_prompts(n_per_set=3)[-4:]
    g = torch.Generator().manual_seed(0)
    docs = [p + hf_greedy(target, p, 64) for p in others]
    docs += [torch.randint(0, target.config.vocab_size, (200,), generator=g).tolist()]
    gen = make_generator(target, draft=draft, n=3, ppl=2, aligned=False)
    gen.end_ids = set()
    gen.datastore = Datastore.from_documents(docs)
    calls = []
    ask = gen.datastore.continuation
    gen.datastore.continuation = lambda ctx, k: calls.append(ask(ctx, k)) or calls[-1]
    tree = TreeParams(num_nodes=6, depth=2, beam_width=4, lookup=6) if draft else TreeParams(1, 0, lookup=6)
    res = gen.generate(prompts, 64, tree=tree)
    for p, got in zip(prompts, res.token_ids):
        assert got == hf_greedy(target, p, 64)
    assert any(calls), "the datastore proposed no chain: the test does not reach it"


def test_sampling_with_a_datastore_follows_the_target():
    model = tiny_target(vocab=V, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    probs = exact_distribution(model)
    gen = make_generator(model, draft=True, n=3, ppl=1, aligned=True)
    # PROMPT's last token occurs nowhere earlier in it, so the chains are the datastore's: confident
    # proposals whatever the target's probabilities ((7, 5) -> [15, 13, 11], then (5, x) -> [3x, 5x])
    gen.datastore = Datastore.from_documents([PROMPT[-2:] + [t, (t * 3) % V, (t * 5) % V] for t in range(V)])
    counts, _ = sample(gen, 40, tree=TreeParams(num_nodes=12, depth=3, beam_width=4, lookup=3))
    assert counts[probs == 0].sum() == 0
    assert chi2_pvalue(counts, probs) > 1e-3


def test_index_cache_gives_the_same_continuations_and_survives_a_bad_file(tmp_path):
    rng = np.random.default_rng(3)
    tokens = np.concatenate([rng.integers(0, 50, 400), [-1], rng.integers(0, 50, 300)])
    fresh = Datastore(tokens, min_ngram=2, max_ngram=4)
    first = Datastore(tokens, min_ngram=2, max_ngram=4, index_cache=tmp_path)
    (cached,) = tmp_path.glob("*.npz")
    again = Datastore(tokens, min_ngram=2, max_ngram=4, index_cache=tmp_path)  # read back, not rebuilt
    contexts = [list(rng.integers(0, 50, 6)) for _ in range(200)] + [list(tokens[i:i + 5]) for i in range(0, 690, 7)]
    for ctx in contexts:
        want = fresh.continuation(ctx, 5)
        assert first.continuation(ctx, 5) == want and again.continuation(ctx, 5) == want
    for n in range(2, 5):
        assert np.array_equal(again._keys[n], fresh._keys[n]) and np.array_equal(again._ends[n], fresh._ends[n])
    cached.write_bytes(b"not an npz")  # a cut or foreign file is rebuilt, never trusted
    rebuilt = Datastore(tokens, min_ngram=2, max_ngram=4, index_cache=tmp_path)
    assert all(rebuilt.continuation(ctx, 5) == fresh.continuation(ctx, 5) for ctx in contexts)
    other = Datastore(tokens, min_ngram=3, max_ngram=4, index_cache=tmp_path)  # another range, another file
    assert len(list(tmp_path.glob("*.npz"))) == 2 and other.fingerprint != fresh.fingerprint
