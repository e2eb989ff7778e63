"""Time a list of trees, prompt-lookup chains included, against our AR loop, alternated in one process.

    PYTHONPATH=.:python python bench/bench_tree_sweep.py --trees 4/1+4 3/1+6 6/2+4 --prompts 8 --repeats 3
    PYTHONPATH=.:python python bench/bench_tree_sweep.py --target qwen2.5-coder-0.5b --draft coder-eagle2 \
        --prompt-set humaneval164 --trees 2/1+4 --datastore FILE.npz --datastore-ab
    PYTHONPATH=.:python pytest bench/bench_tree_sweep.py --benchmark-disable -q   (tiny random model, seconds)

Each repeat times our AR loop and then every tree (``NODES/DEPTH`` or ``NODES/DEPTH+K``), prompt by
prompt, on the same first turns of ``--prompt-set`` (MT-Bench by default), greedy, batch 1, ``--new``
tokens each (end tokens ignored), with the shipped draft ``--draft`` of ``--target``. The table gives,
per tree, the median over repeats of tokens/s and of its ratio to the AR loop of the same repeat (a
shared machine drifts between repeats, less within one), the spread of that ratio, tau and the ms per
round. It is for ranking trees close to each other: ``auto`` (:mod:`poss.decode.autotune`) times only
its own candidates. Chains come from the context, then from ``--datastore``
(:mod:`poss.decode.datastore`; by default the one ``poss.load`` ships for the target);
``--datastore-ab`` times each chained tree also without it, right after it.
"""

import argparse
import statistics
import sys

import pytest
import torch

from bench_e2e import interleaved, shape_of


def sweep(gen, draft, prompts, new: int, configs, repeats: int, log=None):
    """``configs`` = ``[(name, tree, datastore)]``, each timed against our AR loop ``repeats`` times, prompt
    by prompt in turn (:func:`bench_e2e.interleaved`). Returns ``(runs, ar_rates)``: per config name one
    ``(tokens/s, ratio to that repeat's AR loop, tau, ms per round by phase, token ids)`` per repeat, and
    the AR loop's tokens/s per repeat."""
    runs = {name: [] for name, _, _ in configs}
    ar_rates = []
    for rep in range(repeats):
        ar, *rows = interleaved(gen, prompts, new, [("our AR loop", "ours", None, None, None)]
                                + [(name, "draft", draft, t, datastore) for name, t, datastore in configs])
        ar_rates.append(ar["tokens_per_s"])
        for r in rows:
            ratio = r["tokens_per_s"] / ar["tokens_per_s"]
            runs[r["name"]].append((r["tokens_per_s"], ratio, r["tau"], r["round_ms"], r["token_ids"]))
            if log:
                log(f"repeat {rep + 1}: {r['name']} {r['tokens_per_s']:.1f} tok/s = {ratio:.2f}x AR "
                    f"({ar['tokens_per_s']:.1f})")
        runs.setdefault("our AR loop", []).append((ar["tokens_per_s"], 1.0, 1.0, ar["round_ms"], ar["token_ids"]))
    return runs, ar_rates


def table(runs) -> str:
    """The Markdown rows of :func:`sweep`'s configs (not the AR loop), best median ratio first."""
    lines = ["| tree | tok/s | x our AR (median, min-max) | tau | ms per round: draft / verify / commit |",
             "|---|---|---|---|---|"]
    rows = [(name, rs) for name, rs in runs.items() if name != "our AR loop"]
    for name, rs in sorted(rows, key=lambda kv: -statistics.median(x[1] for x in kv[1])):
        ratios = [x[1] for x in rs]
        ms = {k: statistics.median(x[3].get(k, 0.0) for x in rs) for k in ("draft", "verify", "commit")}
        lines.append(f"| {name} | {statistics.median(x[0] for x in rs):.1f} | {statistics.median(ratios):.2f} "
                     f"({min(ratios):.2f}-{max(ratios):.2f}) | {rs[0][2]:.2f} | "
                     f"{ms['draft']:.1f} / {ms['verify']:.1f} / {ms['commit']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs="+", required=True, metavar="N/D[+K]")
    ap.add_argument("--draft", default="poss2", help="a shipped draft folder name")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--datastore-ab", action="store_true",
                    help="time every chained tree also without the datastore (rows 'no datastore')")
    ap.add_argument("--datastore", default="auto",
                    help="the datastore chains fall back to: 'auto' (the one shipped for the target), or a .npz "
                         "from `poss datastore build`")
    ap.add_argument("--target", default="smollm2-135m", help="registry target whose shipped drafts run")
    ap.add_argument("--prompt-set", default="mt_bench", help="packaged eval set whose first turns are the prompts "
                    "(humaneval164 for the coder)")
    a = ap.parse_args(argv)
    from poss.decode.params import tree_spec

    try:
        trees = [tree_spec(t) for t in a.trees]
    except ValueError as e:
        ap.error(f"--trees: expected NODES/DEPTH or NODES/DEPTH+K such as 4/1+4, got {a.trees} ({e})")
    import poss
    from poss import hardware
    from poss.data.eval_sets import load_eval_set
    from poss.models.draft import PosSDraft
    from poss.models.registry import shipped_drafts

    torch.set_num_threads(a.threads)
    dt = hardware.resolve_dtype(a.dtype)
    folder = next((f for f in shipped_drafts(a.target) if f.name == a.draft), None)
    if folder is None:
        ap.error(f"--draft: no draft named {a.draft!r} is shipped for --target {a.target!r}")
    gen = poss.load(a.target, dtype=dt, datastore=a.datastore)
    draft = PosSDraft.load(folder, dtype=dt).attach(gen.runner, 1, 256)
    prompts = [gen.encode(r["turns"][0]) for r in load_eval_set(a.prompt_set)[:a.prompts]]
    store = gen.datastore
    # (name, tree, datastore): with --datastore-ab, each chained tree also without the datastore
    configs = [(shape_of(t), t, store) for t in trees]
    if a.datastore_ab:
        configs += [(f"{shape_of(t)}, no datastore", t, None) for t in trees if t.lookup]
        configs.sort(key=lambda c: trees.index(c[1]))  # each tree's pair back to back
    runs, ar_rates = sweep(gen, draft, prompts, a.new, configs, a.repeats,
                           log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"{hardware.header(dt, a.threads)}; target `{a.target}`, draft `{a.draft}`, {a.prompts} {a.prompt_set} "
          f"prompts x {a.new} new tokens, batch 1, greedy, {a.repeats} repeats, chains from the context then "
          f"{'the datastore ' + a.datastore if store is not None else 'nowhere else'}; "
          f"our AR loop {statistics.median(ar_rates):.1f} tok/s (median)\n")
    print(table(runs))
    return 0


# -- smoke (pytest): a tiny random model and draft ---------------------------------------------------
def test_sweep_tiny(benchmark, bench_threads):
    from poss.decode.params import tree_spec
    from poss.testing import eval_prompts, make_generator, tiny_target

    gen = make_generator(tiny_target(), draft=True, n=3, ppl=2, aligned=True)
    gen.end_ids = set()
    draft, prompts = gen.draft, eval_prompts(1)[:2]
    configs = [(spec, tree_spec(spec), None) for spec in ("4/1+4", "6/2")]
    runs, ar_rates = benchmark.pedantic(sweep, (gen, draft, prompts, 12, configs, 2), rounds=1, iterations=1)
    assert len(ar_rates) == 2 and gen.draft is draft
    ar_ids = runs["our AR loop"][0][4]
    for name in ("4/1+4", "6/2"):
        assert len(runs[name]) == 2 and all(r[1] > 0 and r[2] >= 1 for r in runs[name])
        assert all(r[4] == ar_ids for r in runs[name])  # lossless: every tree gives the AR loop's tokens
    md = table(runs)
    assert md.count("\n") == 3 and "| 4/1+4 |" in md and "| 6/2 |" in md and "our AR loop" not in md


def test_a_bad_spec_is_a_usage_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--trees", "4/1", "four"])
    assert e.value.code == 2 and "--trees" in capsys.readouterr().err


if __name__ == "__main__":
    sys.exit(main())
