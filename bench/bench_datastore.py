"""Host cost of the lookup datastore (:mod:`poss.decode.datastore`): loading the shipped file (the
index is built then; its size in memory goes into ``extra_info``) and one
:meth:`~poss.decode.datastore.Datastore.continuation` per round.

    PYTHONPATH=.:python pytest bench/bench_datastore.py --benchmark-only

The lookups run on the shipped file's own text: contexts cut from held-in answers, so most of them
hit, as in a generation that repeats the target's phrases (a miss tries every n, the slowest case,
and is timed too).
"""

import pytest

from poss.decode.datastore import Datastore, shipped_datastore_path

PATH = shipped_datastore_path("smollm2-135m")
needs_file = pytest.mark.skipif(PATH is None, reason="the shipped smollm2-135m datastore is not installed")


@pytest.fixture(scope="module")
def store():
    return Datastore.load(PATH)


@needs_file
def test_load(benchmark):
    store = benchmark.pedantic(Datastore.load, (PATH,), rounds=3, iterations=1)
    arrays = [store.tokens, *store._keys.values(), *store._ends.values()]
    benchmark.extra_info["megabytes_in_memory"] = round(sum(a.nbytes for a in arrays) / 1e6, 1)


@needs_file
def test_continuation_hits(benchmark, store):
    text = store.tokens[:20000].tolist()
    contexts = [[int(x) for x in text[i - 300:i]] for i in range(300, len(text), 997) if -1 not in text[i - 6:i]]
    assert sum(bool(store.continuation(c, 5)) for c in contexts) >= len(contexts) // 2

    def run():
        for c in contexts:
            store.continuation(c, 5)

    benchmark(run)
    benchmark.extra_info["lookups_per_call"] = len(contexts)


@needs_file
def test_continuation_miss(benchmark, store):
    context = [49151, 49150] * 150  # ids the answers never hold next to each other
    assert store.continuation(context, 5) == []
    benchmark(store.continuation, context, 5)
