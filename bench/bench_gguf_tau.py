"""The tau a draft keeps on the GGUF file's own blocks (``dtype="gguf"``) against the float target it was
trained on, at fixed trees, with tokens/s and the verify's ms a round beside it (issue 54).

The draft stays in its float dtype on both targets (as ``poss.load`` attaches it); each target decodes
the same MT-Bench first turns at each tree, one tree after another, batch 1, greedy, exactly ``--new``
tokens (end tokens ignored).

Run (the table in docs/benchmarks.md's GGUF section):
    PYTHONPATH=.:python python bench/bench_gguf_tau.py --prompts 8 --new 128 --threads 1 --trees 2/1 8/3 60/6
Smoke (tiny random model, seconds):
    PYTHONPATH=.:python pytest bench/bench_gguf_tau.py --benchmark-disable -q
"""

import argparse
import json
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch

from bench_e2e import ours, tree_of


def tau_rows(gens: Dict[str, object], prompts: Sequence[List[int]], new: int,
             trees: Sequence[Tuple[int, int]]) -> List[Dict]:
    """One :func:`bench_e2e.ours` row per (target name, tree): ``gens`` maps a name (e.g. the dtype) to a
    generator with the draft attached; rows carry ``target`` and the ``tree``."""
    from poss.decode.params import TreeParams

    rows = []
    for name, gen in gens.items():
        for T, d in trees:
            r = ours(gen, prompts, new, f"{name} {T}/{d}", TreeParams(num_nodes=T, depth=d), "draft")
            r["target"] = name
            rows.append(r)
    return rows


def main(argv=None):
    import poss
    from poss.data.eval_sets import load_eval_set
    from poss.models.draft import PosSDraft
    from poss.models.registry import shipped_drafts

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft", default="poss2", help="a shipped SmolLM2 draft folder name")
    ap.add_argument("--float-dtype", default="bfloat16")
    ap.add_argument("--trees", nargs="+", default=["2/1", "8/3", "60/6"], metavar="NODES/DEPTH")
    ap.add_argument("--out", default="out/gguf_tau.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = next(f for f in shipped_drafts("smollm2-135m") if f.name == args.draft)
    gens = {}
    for dt in (args.float_dtype, "gguf"):
        gen = poss.load("smollm2-135m", dtype=dt, threads=args.threads)
        gen.draft = PosSDraft.load(folder, dtype=gen.runner.dtype).attach(gen.runner, 1, 256)
        gens[dt] = gen
    questions = load_eval_set("mt_bench")[:args.prompts]
    prompts = [gens["gguf"].encode(q["turns"][0]) for q in questions]
    rows = tau_rows(gens, prompts, args.new, [tree_of(t) for t in args.trees])
    print("| tree | target | tau | tokens/s | verify ms |\n|---|---|---|---|---|")
    for r in rows:
        verify = r["round_ms"]["verify"]
        print(f"| {r['tree']} | {r['target']} | {r['tau']:.3f} | {r['tokens_per_s']:.1f} | {verify:.1f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "threads": args.threads, "draft": args.draft}, indent=1))


def test_tau_rows_tiny(benchmark, bench_threads):
    """Two targets on the same weights: the same answers and tau at every tree (the comparison is fair)."""
    from poss.testing import eval_prompts, make_generator, tiny_target

    model = tiny_target()
    model.generation_config.eos_token_id = None
    a = make_generator(model, draft=True, n=2, ppl=2, aligned=True)
    b = make_generator(model)
    b.draft = a.draft
    prompts = eval_prompts(n_per_set=1)[:2]
    rows = benchmark.pedantic(tau_rows, ({"a": a, "b": b}, prompts, 12, [(4, 2), (8, 3)]), rounds=1, iterations=1)
    assert [r["target"] for r in rows] == ["a", "a", "b", "b"]
    assert [r["tau"] for r in rows[:2]] == [r["tau"] for r in rows[2:]]
    assert [r["token_ids"] for r in rows[:2]] == [r["token_ids"] for r in rows[2:]]


if __name__ == "__main__":
    main()
