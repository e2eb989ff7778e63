"""GGUF block weights against bf16 at SmolLM2-135M's decode shapes, and our AR loop in both.

Kernels: ``poss_ext.ops.qlinear`` in q8_0 / q4_0 / q4_1 (each CPU kernel this machine has, or the
best), with fp32 activations and with int8 ones (``x_int8=True``, kernel names ``<kernel>-i8``),
against ``poss_ext.ops.linear`` in bf16, over one layer's projections (q|k|v 960 x 576, o
576 x 576, gate|up 3072 x 576, down 576 x 1536) stacked 30 times and the 49152 x 576 lm_head, at
M = 1 / 5 / 8 / 16 rows: microseconds per pass and the weight GB/s. ``--e2e``: our AR loop on the real
SmolLM2-135M-Instruct in bf16 and with ``dtype="gguf"`` (its own Q4_1 blocks, Q8_0 lm_head), prompt by
prompt in turn (bench_e2e.interleaved), tokens/s.

    PYTHONPATH=.:python python bench/bench_qlinear.py --threads 1
    PYTHONPATH=.:python python bench/bench_qlinear.py --threads 1 --kernels avx512 avx2 --rows 1 8
    PYTHONPATH=.:python python bench/bench_qlinear.py --threads 1 --rows 1 8 --acts fp32 int8 --formats q4_1
    PYTHONPATH=.:python python bench/bench_qlinear.py --threads 1 --rows 1 8 --acts int8 --clock cpu
    PYTHONPATH=.:python python bench/bench_qlinear.py --threads 1 --rows 1 2 4 8 --acts int8 --formats q4_1 q8_0 \\
        --clock cpu --parts
    PYTHONPATH=.:python python bench/bench_qlinear.py --threads 1 --e2e --prompts 4 --new 64
"""

import argparse
import time

import numpy as np
import torch

import poss_ext

LAYERS, H, F, V = 30, 576, 1536, 49152
SHAPES = [(960, H), (H, H), (2 * F, H), (H, F)]  # one layer's fused projections, [N, K]
GGML = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}
INTERLEAVED = ("q8_0x8", "q4_0x8", "q4_1x8")  # the 4-bit blocks with rows interleaved by 8, as the loader keeps them


def weights(fmt: str):
    """The layers' projections and the lm_head, bf16 tensors or (format) uint8 blocks."""
    import gguf.quants
    from gguf import GGMLQuantizationType

    g = np.random.default_rng(0)
    one = [g.standard_normal(s).astype(np.float32) * 0.05 for s in SHAPES + [(V, H)]]
    if fmt == "bf16":
        ts = [torch.from_numpy(w).bfloat16() for w in one]
    else:
        base = fmt.removesuffix("x8")
        ts = [torch.from_numpy(gguf.quants.quantize(w, GGMLQuantizationType[GGML[base]])) for w in one]
        if base != fmt:
            ts = [poss_ext.ops.interleave_rows8(t, base) for t in ts]
    # distinct copies per layer, so a pass streams from memory as a decode step does
    return [t.clone() for _ in range(LAYERS) for t in ts[:4]] + [ts[4]]


def one_pass(x_by_k, ws, fmt, x_int8=False):
    for w in ws:
        x = x_by_k[w.shape[1] if fmt == "bf16" else w.shape[1] * 32 // poss_ext.ops.QFORMAT_BLOCK_BYTES[fmt]]
        if fmt == "bf16":
            poss_ext.ops.linear(x, w)
        else:
            poss_ext.ops.qlinear(x, w, fmt, x_int8=x_int8)


def time_pass(ws, fmt, rows, repeats=10, x_int8=False, clock=time.perf_counter):
    x = {k: torch.randn(rows, k).bfloat16() for k in (H, F)}
    one_pass(x, ws, fmt, x_int8)
    times = []
    for _ in range(repeats):
        t = clock()
        one_pass(x, ws, fmt, x_int8)
        times.append(clock() - t)
    times.sort()
    best = times[len(times) // 4]  # lower quartile: a shared machine's uncontended cost
    return best, sum(w.numel() * w.element_size() for w in ws) / best / 1e9


def kernels_table(kernels, rows, formats, acts=("fp32", "int8"), clock=time.perf_counter, parts=False):
    """One line per format and kernel; ``parts``: the layers and the lm_head on lines of their own."""
    print(f"{'format':8} {'kernel':10} " + ("part     " if parts else "")
          + " ".join(f"{'M=' + str(m):>18}" for m in rows))
    for fmt in ["bf16"] + formats:
        ws = weights(fmt)
        runs = [("linear", False)] if fmt == "bf16" else [(k, a == "int8") for k in kernels for a in acts]
        groups = [("layers  ", ws[:-1]), ("lm_head ", ws[-1:])] if parts else [("", ws)]
        for k, x_int8 in runs:
            if fmt != "bf16":
                poss_ext.ops.force_cpu_qlinear_kernel(k)
                k = poss_ext.ops.cpu_qlinear_kernel(x_int8) + ("-i8" if x_int8 else "")
            for part, part_ws in groups:
                cells = []
                for m in rows:
                    s, gbs = time_pass(part_ws, fmt, m, x_int8=x_int8, clock=clock)
                    cells.append(f"{s * 1e3:7.2f} ms {gbs:5.1f} GB/s")
                print(f"{fmt:8} {k:10} {part}" + " ".join(f"{c:>18}" for c in cells))
        poss_ext.ops.force_cpu_qlinear_kernel("")


def e2e(prompts_n, new):
    import poss
    from bench_e2e import interleaved
    from poss.data.eval_sets import load_eval_set

    bf16 = poss.load("smollm2-135m", dtype=torch.bfloat16, datastore=None)
    q = poss.load("smollm2-135m", dtype="gguf", datastore=None)
    print("gguf weights:", q.runner.weight_formats())
    prompts = [bf16.encode(r["turns"][0]) for r in load_eval_set("mt_bench")[:prompts_n]]
    # interleaved runs its configs on one generator: swap the runner in per row
    rows = []
    for p in prompts:
        for name, gen in (("AR bf16", bf16), ("AR gguf", q)):
            rows.append((name, interleaved(gen, [p], new, [(name, "ours", None, None, None)])[0]))
    for name in ("AR bf16", "AR gguf"):
        rs = [r for n, r in rows if n == name]
        toks = sum(r["tokens"] for r in rs)
        secs = sum(r["seconds"] for r in rs)
        print(f"{name}: {toks / secs:.1f} tok/s ({toks} tokens, {secs:.1f} s)")
    same = sum(a["token_ids"] == b["token_ids"] for (_, a), (_, b) in zip(rows[0::2], rows[1::2]))
    print(f"gguf AR identical to bf16 AR on {same}/{len(prompts)} prompts (need not be: bf16 rounds the weights)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 5, 8, 16])
    ap.add_argument("--formats", nargs="*", default=list(GGML), choices=[*GGML, *INTERLEAVED])
    ap.add_argument("--kernels", nargs="*", default=None, help="qlinear kernels (default: the best only)")
    ap.add_argument("--acts", nargs="*", default=["fp32", "int8"], choices=["fp32", "int8"],
                    help="qlinear activations: fp32 (x_int8=False) and / or int8 (x_int8=True)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this thread's CPU time (time.thread_time), which leaves out the time a shared "
                         "machine runs something else on the core; --threads 1 only")
    ap.add_argument("--parts", action="store_true", help="time the layers and the lm_head apart")
    ap.add_argument("--e2e", action="store_true", help="our AR loop on SmolLM2-135M, bf16 vs gguf")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.e2e:
        e2e(args.prompts, args.new)
    else:
        if args.clock == "cpu" and args.threads != 1:
            ap.error("--clock cpu times this thread only: use it with --threads 1")
        clock = time.thread_time if args.clock == "cpu" else time.perf_counter
        # "": the best kernel for each activation path (the fp32 path's name would force the AVX2 int8 one).
        kernels_table(args.kernels or [""], args.rows, args.formats, args.acts, clock, args.parts)


if __name__ == "__main__":
    main()
