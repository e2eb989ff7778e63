"""The verify round's lm_head: all B*N tree rows at once, or only the rows a greedy walk reaches.

A greedy verify needs the target's logits only on the accepted path (plus the node where it stops).
Computing them all is one GEMM of B*N rows over the lm_head (SmolLM2: 49,152 x 576), which is
compute-bound on a CPU once B*N passes about 8; the walk does one GEMM of B rows per level, each
about one pass over the weights. This times both with our ``poss_ext.ops.linear`` and prints where the
walk starts to pay (``poss.decode.verify.LAZY_LM_HEAD_MIN_ROWS``).

    PYTHONPATH=.:python python bench/bench_lm_head_walk.py --threads 1     # a table
    PYTHONPATH=.:python python bench/bench_lm_head_walk.py --threads 1 --e2e   # + decoding, walk on / off
    PYTHONPATH=.:python pytest bench/bench_lm_head_walk.py --benchmark-only
"""

import argparse
import time

import pytest
import torch

import poss_ext

VOCAB, HIDDEN = 49152, 576


def lm_head(dtype):
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)).to(dtype)


def full(w, batch: int, nodes: int):
    poss_ext.ops.linear(torch.ones(batch * nodes, HIDDEN, dtype=w.dtype), w)


def walk(w, batch: int, levels: int):
    x = torch.ones(batch, HIDDEN, dtype=w.dtype)
    for _ in range(levels):
        poss_ext.ops.linear(x, w).float().max(1)  # as poss.decode.verify.greedy_walk picks a level's tokens


def ms(f, *args, repeats: int = 10) -> float:
    f(*args)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(*args)
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[len(times) // 4]


@pytest.mark.parametrize("batch,nodes", [(1, 60), (1, 8), (16, 5)])
def test_full_lm_head(benchmark, bench_threads, batch, nodes):
    benchmark(full, lm_head(torch.bfloat16), batch, nodes)


@pytest.mark.parametrize("batch,levels", [(1, 2), (16, 2)])
def test_walked_lm_head(benchmark, bench_threads, batch, levels):
    benchmark(walk, lm_head(torch.bfloat16), batch, levels)


def e2e(threads: int, prompts: int = 3, new: int = 96, trees=((60, 6), (16, 4)), repeats: int = 2) -> None:
    """SmolLM2-135M with the shipped PosS-2 draft on MT-Bench prompts: tokens/s and ms per round with
    the walk (the default threshold) and without it, interleaved in one run; outputs must agree."""
    import poss
    from bench_e2e import ours
    from poss.data.eval_sets import load_eval_set
    from poss.decode import verify
    from poss.decode.params import TreeParams
    from poss.models.draft import PosSDraft
    from poss.models.registry import shipped_drafts

    gen = poss.load("smollm2-135m", dtype="auto")
    folder = next(f for f in shipped_drafts("smollm2-135m") if f.name == "poss2")
    gen.draft = PosSDraft.load(folder, dtype=gen.runner.dtype).attach(gen.runner, 1, 256)
    ids = [gen.encode(r["turns"][0]) for r in load_eval_set("mt_bench")[:prompts]]
    default = verify.LAZY_LM_HEAD_MIN_ROWS
    print(f"\n{prompts} MT-Bench prompts x {new} tokens, PosS-2, batch 1, {repeats} interleaved repeats\n")
    print("| tree | lm_head | tok/s | draft ms | verify ms | tau |\n|---|---|---|---|---|---|")
    seen = {}
    try:
        for _ in range(repeats):
            for T, d in trees:
                for walk in (True, False):
                    verify.LAZY_LM_HEAD_MIN_ROWS = default if walk else 1 << 30  # 1 << 30: never walk
                    r = ours(gen, ids, new, "", TreeParams(num_nodes=T, depth=d))
                    assert seen.setdefault(T, r["token_ids"]) == r["token_ids"], "the walk changed the output"
                    print(f"| {T}/{d} | {'walked rows' if walk else 'all rows'} | {r['tokens_per_s']:.1f} | "
                          f"{r['round_ms']['draft']:.1f} | {r['round_ms']['verify']:.1f} | {r['tau']:.2f} |")
    finally:
        verify.LAZY_LM_HEAD_MIN_ROWS = default


def main() -> None:
    from poss.hardware import header

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--levels", type=int, default=2, help="walk levels (accepted length + 1; tau ~ 2 here)")
    ap.add_argument("--e2e", action="store_true", help="also decode with the real model, walk on and off")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    w = lm_head(dtype)
    print(header(dtype, a.threads))
    print(f"\n| batch | nodes | rows | full ms | walk ms ({a.levels} levels) | walk / full |\n"
          "|---|---|---|---|---|---|")
    for batch, nodes in [(1, 4), (1, 8), (1, 12), (1, 13), (1, 16), (1, 32), (1, 60), (4, 5), (16, 5), (16, 8)]:
        f, g = ms(full, w, batch, nodes), ms(walk, w, batch, a.levels)
        print(f"| {batch} | {nodes} | {batch * nodes} | {f:.2f} | {g:.2f} | {g / f:.2f} |")
    if a.e2e:
        e2e(a.threads)


if __name__ == "__main__":
    main()
