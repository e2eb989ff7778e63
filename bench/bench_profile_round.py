"""Where a round's time goes: per-phase milliseconds (draft, verify, commit, host) from the generator's
own profile, and the share of each kind of op from ``torch.profiler``, for a few tree sizes.

    PYTHONPATH=.:python python bench/bench_profile_round.py --draft drafts/poss2 --trees 1/0 8/3 16/4 60/6 \\
        --threads 1 --out out/profile_round.md
    PYTHONPATH=.:python pytest bench/bench_profile_round.py --benchmark-disable -q   (tiny random model, seconds)

Greedy, batch 1, one MT-Bench first turn, ``--new`` tokens per tree after a warm-up (end tokens
ignored, so every tree does the same number of tokens). The op table groups ``torch.profiler``'s self
CPU time: GEMMs (``aten::mm``/``addmm``/``linear``), tree attention, the other fused ``poss::`` ops, and
everything else (views, copies, allocation, top-k, softmax...): the part a leaner round could remove.
"""

import argparse
import sys
import time
from pathlib import Path

import pytest
import torch

GROUPS = (("GEMM", ("poss::linear", "poss::qlinear", "aten::mm", "aten::addmm", "aten::linear", "aten::matmul",
                    "aten::bmm")),
          ("tree attention", ("poss::tree_attention",)),
          ("other poss ops", ("poss::",)))


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(name == k or (k.endswith("::") and name.startswith(k)) for k in keys):
            return group
    return "everything else"


def op_shares(gen, prompt, new: int, tree) -> dict:
    """Self CPU time per op group, as fractions of the total."""
    gen.profile = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        gen.generate([prompt], new, tree=tree)
    totals = {}
    for e in prof.key_averages():
        # composite ops (decoder_layer, specialist_forward) only dispatch: their self time is small
        totals[group_of(e.key)] = totals.get(group_of(e.key), 0.0) + e.self_cpu_time_total
    whole = sum(totals.values()) or 1.0
    return {k: v / whole for k, v in totals.items()}


def phases(gen, prompt, new: int, tree) -> dict:
    gen.profile = {}
    t = time.perf_counter()
    res = gen.generate([prompt], new, tree=tree)
    wall = time.perf_counter() - t
    prof, gen.profile = gen.profile, None
    ms = {k: 1e3 * sum(v) / len(v) for k, v in prof.items()}
    st = res.stats[0]
    return {"ms": ms, "tau": st.tau, "rounds": st.rounds, "tokens_per_s": st.tokens / wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default=None, help="draft folder (default: the shipped PosS draft)")
    ap.add_argument("--trees", nargs="+", default=["1/0", "8/3", "16/4", "60/6"],
                    help="nodes/depth, or nodes/depth+K with a K-token prompt-lookup chain")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto", help="a float dtype, auto, or gguf (the GGUF file's own blocks)")
    ap.add_argument("--out", default=None, help="also write the Markdown here")
    a = ap.parse_args(argv)

    import poss
    from poss import hardware
    from poss.data.eval_sets import load_eval_set
    from poss.decode.params import TreeParams, tree_spec

    torch.set_num_threads(a.threads)
    draft = a.draft or poss.shipped_draft(a.target)
    gen = poss.load(a.target, draft=draft, dtype="gguf" if a.dtype == "gguf" else hardware.resolve_dtype(a.dtype),
                    tree=TreeParams())
    dtype = gen.runner.dtype
    gen.end_ids = set()
    prompt = gen.encode(load_eval_set("mt_bench")[0]["turns"][0])
    head = ("| tree | tau | tok/s | draft ms | verify ms | commit ms | host ms | round ms | "
            + " | ".join(f"{g} %" for g in [g for g, _ in GROUPS] + ["everything else"]) + " |")
    blocks = " on the GGUF blocks" if a.dtype == "gguf" else ""
    lines = [f"{hardware.header(dtype, a.threads)}{blocks}; draft `{Path(draft).name if draft else 'none'}`, batch 1, "
             f"{a.new} new tokens, one MT-Bench prompt", "", head, "|" + "---|" * (head.count("|") - 1)]
    for spec in a.trees:
        tree = tree_spec(spec)
        gen.generate([prompt], 8, tree=tree)  # warm-up at this shape
        p = phases(gen, prompt, a.new, tree)
        shares = op_shares(gen, prompt, min(a.new, 24), tree)
        ms = [p["ms"].get(k, 0.0) for k in ("draft", "verify", "commit", "host")]
        lines.append(f"| {spec} | {p['tau']:.2f} | {p['tokens_per_s']:.1f} | "
                     + " | ".join(f"{x:.1f}" for x in ms) + f" | {sum(ms):.1f} | "
                     + " | ".join(f"{100 * shares.get(g, 0.0):.0f}"
                                  for g in [g for g, _ in GROUPS] + ["everything else"])
                     + " |")
        print(lines[-1], file=sys.stderr, flush=True)
    md = "\n".join(lines) + "\n"
    print(md)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(md)
    return 0


# -- smoke (pytest): a tiny random model and draft ---------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gen():
    from poss.testing import make_generator, tiny_target

    gen = make_generator(tiny_target(), draft=True, n=3, ppl=2, aligned=True)
    gen.end_ids = set()
    return gen


def test_group_of_sorts_ops_by_kind():
    assert group_of("aten::addmm") == group_of("poss::linear") == group_of("poss::qlinear") == "GEMM"
    assert group_of("poss::tree_attention") == "tree attention"
    assert group_of("poss::kv_compact") == "other poss ops"
    assert group_of("aten::topk") == group_of("aten::mmx") == "everything else"


@pytest.mark.parametrize("spec", ["1/0", "8/3", "3/1+2"])
def test_round_tiny(benchmark, bench_threads, tiny_gen, spec):
    from poss.decode.params import tree_spec
    from poss.testing import eval_prompts

    tree, prompt = tree_spec(spec), eval_prompts(1)[0][:24]
    tiny_gen.generate([prompt], 4, tree=tree)  # warm-up at this shape
    p = benchmark.pedantic(phases, (tiny_gen, prompt, 12, tree), rounds=1, iterations=1)
    assert p["ms"]["verify"] > 0 and p["ms"]["draft"] > 0
    assert p["tokens_per_s"] > 0 and 1 <= p["rounds"] <= 12 and p["tau"] >= 1
    shares = op_shares(tiny_gen, prompt, 8, tree)
    assert sum(shares.values()) == pytest.approx(1.0) and shares.get("GEMM", 0) > 0


if __name__ == "__main__":
    sys.exit(main())
