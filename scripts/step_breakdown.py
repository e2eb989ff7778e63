"""Where one decode step of the target goes: its GEMMs alone, its attention alone, and the rest.

    PYTHONPATH=.:python python scripts/step_breakdown.py --prefix 200 --threads 1

Times (lower quartile of --repeats) one single-token forward of the runner behind a --prefix-token
context, then the same step's weight GEMMs through ``poss_ext.ops.linear`` (with their achieved GB/s),
then its 30 attention calls; the remainder is the small fused ops and dispatch. Python call overhead
is inside the two partial timings, so "rest" is a lower bound.
"""

import argparse
import time

import torch


def lower_quartile_ms(f, repeats: int) -> float:
    f()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return 1e3 * ts[len(ts) // 4]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prefix", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args(argv)
    import poss
    import poss_ext
    from poss import hardware

    torch.set_num_threads(a.threads)
    gen = poss.load(a.target, dtype=a.dtype, context_limit=a.prefix + 8)
    r = gen.runner
    r.prefill([list(range(100, 100 + a.prefix))])
    tok, pos = torch.tensor([[5]]), torch.tensor([[a.prefix]])
    par, pl = torch.tensor([[-1]], dtype=torch.int32), torch.tensor([a.prefix], dtype=torch.int32)
    step = lower_quartile_ms(lambda: r.forward(tok, pos, par, pl, check_capacity=False), a.repeats)
    H = r.hidden_size
    xs = {w.shape[1]: torch.randn(1, w.shape[1]).to(r.dtype) for p in r.layers for w in (p.w_o, p.w_down)}
    xs[H] = torch.randn(1, H).to(r.dtype)
    weights = [w for p in r.layers for w in (p.w_qkv, p.w_o, p.w_gate_up, p.w_down)] + [r.lm_head]
    gemm = lower_quartile_ms(lambda: [poss_ext.ops.linear(xs[w.shape[1]], w) for w in weights], a.repeats)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    q = torch.randn(1, r.num_heads, 1, r.head_dim).to(r.dtype)
    k, v = r.cache.layer(0)
    attn = lower_quartile_ms(lambda: [poss_ext.tree_attention(q, k[:1], v[:1], pl, par, r.head_dim ** -0.5)
                                      for _ in r.layers], a.repeats)
    print(hardware.header(r.dtype, a.threads) + f", prefix {a.prefix}, read bandwidth "
          f"{hardware.read_bandwidth_gbs():.1f} GB/s")
    print(f"| step | GEMMs ({nbytes / 1e6:.0f} MB) | GEMM GB/s | attention | rest |\n|---|---|---|---|---|")
    print(f"| {step:.2f} ms | {gemm:.2f} ms | {nbytes / gemm / 1e6:.1f} | {attn:.2f} ms | "
          f"{step - gemm - attn:.2f} ms |")


if __name__ == "__main__":
    main()
