"""Where one decode step of the target goes: its GEMMs alone, its attention alone, and the rest.

    PYTHONPATH=.:python python bench/bench_step_breakdown.py --prefix 200 --threads 1
    PYTHONPATH=.:python pytest bench/bench_step_breakdown.py --benchmark-disable -q   (tiny random model, seconds)

Times (lower quartile of --repeats) one single-token forward of the runner behind a --prefix-token
context, then the same step's weight GEMMs through ``poss_ext.ops.linear`` (with their achieved GB/s),
then its attention calls (one per layer); the remainder is the small fused ops and dispatch. Python
call overhead is inside the two partial timings, so "rest" is a lower bound.
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


def breakdown(runner, prefix: int, repeats: int) -> dict:
    """Milliseconds of one step of ``runner`` behind ``prefix`` tokens (which it prefills), of its
    weight GEMMs and of its attention calls; ``gemm_bytes`` the weights those GEMMs read."""
    import poss_ext

    r = runner
    r.prefill([list(range(100, 100 + prefix))])
    tok, pos = torch.tensor([[5]]), torch.tensor([[prefix]])
    par, pl = torch.tensor([[-1]], dtype=torch.int32), torch.tensor([prefix], dtype=torch.int32)
    step = lower_quartile_ms(lambda: r.forward(tok, pos, par, pl, check_capacity=False), repeats)
    H = r.hidden_size
    xs = {w.shape[1]: torch.randn(1, w.shape[1]).to(r.dtype) for p in r.layers for w in (p.w_o, p.w_down)}
    xs[H] = torch.randn(1, H).to(r.dtype)
    weights = [w for p in r.layers for w in (p.w_qkv, p.w_o, p.w_gate_up, p.w_down)] + [r.lm_head]
    gemm = lower_quartile_ms(lambda: [poss_ext.ops.linear(xs[w.shape[1]], w) for w in weights], repeats)
    q = torch.randn(1, r.num_heads, 1, r.head_dim).to(r.dtype)
    k, v = r.cache.layer(0)
    attn = lower_quartile_ms(lambda: [poss_ext.tree_attention(q, k[:1], v[:1], pl, par, r.head_dim ** -0.5)
                                      for _ in r.layers], repeats)
    return {"step_ms": step, "gemm_ms": gemm, "attention_ms": attn, "rest_ms": step - gemm - attn,
            "gemm_bytes": sum(w.numel() * w.element_size() for w in weights)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prefix", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args(argv)
    import poss
    from poss import hardware

    torch.set_num_threads(a.threads)
    gen = poss.load(a.target, dtype=a.dtype, context_limit=a.prefix + 8)
    b = breakdown(gen.runner, a.prefix, a.repeats)
    print(hardware.header(gen.runner.dtype, a.threads) + f", prefix {a.prefix}, read bandwidth "
          f"{hardware.read_bandwidth_gbs():.1f} GB/s")
    print(f"| step | GEMMs ({b['gemm_bytes'] / 1e6:.0f} MB) | GEMM GB/s | attention | rest |\n|---|---|---|---|---|")
    print(f"| {b['step_ms']:.2f} ms | {b['gemm_ms']:.2f} ms | {b['gemm_bytes'] / b['gemm_ms'] / 1e6:.1f} | "
          f"{b['attention_ms']:.2f} ms | {b['rest_ms']:.2f} ms |")


# -- smoke (pytest): a tiny random model --------------------------------------------------------------
def test_breakdown_tiny(benchmark, bench_threads):
    from poss.models.target import TargetRunner
    from poss.testing import tiny_target

    runner = TargetRunner(tiny_target(), max_batch=1, max_seq=48)
    b = benchmark.pedantic(breakdown, (runner, 40, 5), rounds=1, iterations=1)
    assert b["step_ms"] > 0 and b["gemm_ms"] > 0 and b["attention_ms"] > 0
    want = sum(w.numel() * w.element_size() for p in runner.layers for w in (p.w_qkv, p.w_o, p.w_gate_up, p.w_down))
    assert b["gemm_bytes"] == want + runner.lm_head.numel() * runner.lm_head.element_size()


if __name__ == "__main__":
    main()
