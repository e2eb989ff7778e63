"""Interleaved A/B timing of the bench_models variants, for shared machines.

pytest-benchmark times one variant after another, so load that comes and goes lands on whichever
variant runs at the time. Here every variant runs in alternating blocks of 5 calls within one
process; the min and the median over all blocks are reported with the speedups.

Run: ``PYTHONPATH=.:python python bench/ab_models.py [--threads 1] [--target]``
"""

import argparse
import time

import torch

import bench_models as bm  # beside this script, which Python puts first on sys.path
from poss.models.draft import PosSDraft
from poss.models.draft_config import DraftConfig


def timings(fns, blocks, per_block=5):
    res = {k: [] for k in fns}
    for f in fns.values():
        f(), f()
    for _ in range(blocks):
        for k, f in fns.items():
            for _ in range(per_block):
                t = time.perf_counter()
                f()
                res[k].append((time.perf_counter() - t) * 1e3)
    return {k: (min(v), sorted(v)[len(v) // 2]) for k, v in res.items()}


def report(title, stats, ours):
    cells = "  ".join(f"{k} min {a:.2f} / med {b:.2f} ms" for k, (a, b) in stats.items())
    speed = ", ".join(f"vs {k} {a / stats[ours][0]:.2f}x (min) {b / stats[ours][1]:.2f}x (med)"
                      for k, (a, b) in stats.items() if k != ours)
    print(f"{title}: {cells} | {ours} {speed}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--target", action="store_true", help="also time the SmolLM2 target step")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    d = PosSDraft(DraftConfig(**bm.SMOL, n_specialists=2, positions_per_specialist=2)).eval()
    D = bm.SMOL["head_dim"]
    emb = torch.randn(bm.SMOL["vocab"], bm.SMOL["hidden"]) * 0.02
    d.attach_tensors(emb, emb, 1.0 / 1e5 ** (torch.arange(0, D, 2).float() / D), 1, bm.PREFIX + 64)
    d.caches.k.normal_()
    d.caches.v.normal_()
    with torch.inference_mode():
        for T in (1, 10, 60):
            a = bm.specialist_inputs(T)
            fns = {"fused": lambda a=a: d.step(0, *a), "hf_layer": bm.hf_layer_step(d, T),
                   "eager_packed": lambda a=a: d.step(0, *a, eager=True)}
            report(f"threads={args.threads} specialist T={T}", timings(fns, 8), "fused")
    if args.target:
        from poss.models.registry import load_model

        _, model = load_model("smollm2-135m")
        model.config._attn_implementation = "eager"
        for T in (1, 60):
            fns = {"runner": bm.runner_step(model, T), "hf_eager": bm.hf_step(model, T)}
            report(f"threads={args.threads} target step T={T}", timings(fns, 4, 3), "runner")


if __name__ == "__main__":
    main()
