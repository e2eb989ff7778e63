"""The generation loop's mechanics on SmolLM2-135M (CPU): per-round time split into draft (all
specialist forwards + draft lm_head/top-k + build_tree), verify (target tree forward + tree_verify),
commit (kv_compact, bookkeeping scatters, the one read-back) and host (stop rules, batch
compaction), against the plain autoregressive loop on the same runner.

The draft is RANDOM (tau ~ 1): these numbers show where a round's time goes, not a speed-up.

Run the table:  PYTHONPATH=.:python python bench/bench_loop.py [--batch 1] [--new 48] [--threads 2]
pytest form:    PYTHONPATH=.:python pytest bench/bench_loop.py --benchmark-only   (tiny model, quick)
"""

import argparse
import statistics
import time

import torch

from poss.data import EVAL_SETS, load_eval_set


def eval_texts(n):
    """The first turns of the first two questions of each packaged eval set, the first ``n`` of them."""
    records = [r for name in sorted(EVAL_SETS) for r in load_eval_set(name)[:2]]
    return [r["turns"][0] for r in records][:n]


def random_draft(gen, n, ppl, seed=0):
    from poss.models.draft import PosSDraft
    from poss.models.draft_config import DraftConfig

    r = gen.runner
    cfg = DraftConfig.for_target(r.config, "smollm2-135m", r.fingerprint(), n_specialists=n,
                                 positions_per_specialist=ppl)
    torch.manual_seed(seed)
    return PosSDraft(cfg).to(r.dtype).eval().attach(r, 1, 64)


def measure(gen, prompts, new, batch, **kw):
    gen.profile = {}
    gen.generate(prompts[:batch], 4, **kw)  # warm-up (allocations, oneDNN primitives)
    gen.profile = {}
    t = time.perf_counter()
    tokens = rounds = 0
    for i in range(0, len(prompts), batch):
        res = gen.generate(prompts[i: i + batch], new, **kw)
        tokens += sum(s.tokens for s in res.stats)
        rounds += max(s.rounds for s in res.stats)
    wall = time.perf_counter() - t
    prof = {k: statistics.mean(v) * 1e3 for k, v in gen.profile.items()}
    prof["rounds"] = len(gen.profile.get("verify", []))
    prof["tokens"], prof["wall_s"] = tokens, wall
    gen.profile = None
    return prof


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--num-nodes", type=int, default=60)
    ap.add_argument("--depth", type=int, default=6)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import poss

    gen = poss.load("smollm2-135m", speculate_max_batch=None)  # time the tree rounds at any --batch
    gen.end_ids = set()  # run every request the full length
    prompts = [gen.encode(t) for t in eval_texts(args.prompts)]
    rows = []
    ar = measure(gen, prompts, args.new, args.batch, depth=0)
    rows.append(("autoregressive", ar))
    for n, ppl in ((1, 1), (3, 2)):
        gen.draft = random_draft(gen, n, ppl)
        rows.append((f"random draft N={n} ppl={ppl}",
                     measure(gen, prompts, args.new, args.batch, num_nodes=args.num_nodes, depth=args.depth)))
    gen.draft = None
    # The same loop on a tiny random Llama (hidden 256, 2 layers, vocab 300): the math is negligible,
    # so its round time is the orchestration cost (Python + op dispatch) the real rounds carry too.
    from poss.testing import make_generator, tiny_target

    tiny = make_generator(tiny_target(), draft=True, n=3, ppl=2)
    torch.set_num_threads(args.threads)
    tiny.end_ids = set()
    tiny_prompts = [[b % 300 for b in bytes(gen.tokenizer.decode(p), "utf-8")][:200] for p in prompts]
    rows.append(("tiny model, random draft N=3 (orchestration cost)",
                 measure(tiny, tiny_prompts, args.new, args.batch, num_nodes=args.num_nodes, depth=args.depth)))
    print(f"SmolLM2-135M fp32, CPU threads={args.threads}, batch={args.batch}, {args.prompts} prompts x "
          f"{args.new} new tokens, tree: {args.num_nodes} nodes, depth {args.depth}, top-k 10")
    print("| loop | ms/round: draft | verify | commit | host | total | rounds | tokens/round | tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, p in rows:
        total = sum(p.get(k, 0.0) for k in ("draft", "verify", "commit", "host"))
        print(f"| {name} | {p.get('draft', 0):.1f} | {p['verify']:.1f} | {p['commit']:.2f} | {p['host']:.2f} | "
              f"{total:.1f} | {p['rounds']} | {p['tokens'] / max(p['rounds'], 1):.2f} | "
              f"{p['tokens'] / p['wall_s']:.2f} |")


# -- pytest-benchmark form: one round of the loop on a tiny model ---------------------------------

def test_loop_round_tiny(benchmark):
    from poss.testing import eval_prompts, make_generator, tiny_target

    gen = make_generator(tiny_target(), draft=True, n=3, ppl=2, aligned=True)
    gen.end_ids = set()
    prompts = eval_prompts(1)[:4]
    benchmark.pedantic(lambda: gen.generate(prompts, 16), rounds=3, warmup_rounds=1)


if __name__ == "__main__":
    main()
