"""The end-to-end loop on synthetic weights in Llama-3-8B shapes (no download): per-op time, achieved
GB/s against the device's measured read bandwidth, and what a 60-node verify round costs against a
decode step.

    PYTHONPATH=.:python python bench/bench_gpu_e2e.py            (CUDA, bf16, Llama-3-8B shapes: ~16 GB of weights)
    PYTHONPATH=.:python python bench/bench_gpu_e2e.py --compile  (the steps through torch.compile: CUDA graphs)
    PYTHONPATH=.:python pytest bench/bench_gpu_e2e.py --benchmark-disable -q   (tiny shapes on the CPU, seconds)

scripts/gpu_check.sh runs the first two on a lent GPU machine.

Weights are random (the draft agrees with the target by chance only, tau ~ 1): the figures are costs,
not speed-ups. Shapes: hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256, 32 layers.
"""

import argparse
import json
import time

import torch

LLAMA3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                 vocab_size=128256, num_hidden_layers=32, rope_theta=500000.0)
TINY = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
            vocab_size=1000, num_hidden_layers=2, rope_theta=10000.0)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, dev, repeats=10, warmup=2) -> float:
    """Median seconds of ``fn()`` (device-synchronised)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def read_bandwidth(dev, megabytes) -> float:
    x = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32, device=dev)
    return x.numel() * 4 / timeit(lambda: x.sum(), dev, repeats=5) / 1e9


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def build(shapes, dev, dtype, max_seq):
    from transformers import LlamaConfig, LlamaForCausalLM

    from poss.models.target import TargetRunner

    cfg = LlamaConfig(**shapes, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    runner = TargetRunner(model, max_batch=1, max_seq=max_seq, dtype=dtype)
    del model
    return runner


def random_draft(runner, dev, dtype):
    from poss.models.draft import PosSDraft
    from poss.models.draft_config import DraftConfig

    cfg = DraftConfig.for_target(runner.config, "synthetic", runner.fingerprint(), n_specialists=3,
                                 positions_per_specialist=2, fc_bias=True)
    torch.manual_seed(1)
    with torch.device(dev):
        d = PosSDraft(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.02)
    return d.to(dtype).eval().attach(runner, 1, 64)


def per_op(runner, dev, ctx, T) -> dict:
    """Milliseconds and GB/s of one decoder layer, the final norm and the lm_head for T new nodes."""
    import poss_ext
    from poss.models.tree import chain_parents

    H, p = runner.hidden_size, runner.layers[0]
    x = torch.randn(1, T, H, device=dev, dtype=runner.dtype) * 0.1
    parents = chain_parents([T], T, dev)  # a chain of T nodes below the prefix: a tree's cost at its size
    positions = (ctx + torch.arange(T, device=dev)).view(1, T)
    prefix = torch.tensor([ctx], dtype=torch.int32, device=dev)
    k, v = runner.cache.layer(0)
    layer = lambda: poss_ext.ops.decoder_layer(  # noqa: E731
        x, p.in_norm_w, p.w_qkv, p.b_qkv, p.w_o, p.post_norm_w, p.w_gate_up, p.w_down, k[:1], v[:1], prefix,
        parents, positions, runner.inv_freq, runner.num_heads, runner.num_kv_heads, runner.eps)
    f = poss_ext.ops.rms_norm(x, runner.final_norm_w, runner.eps)
    out = {}
    for name, fn, b in (("decoder_layer", layer, nbytes(*vars(p).values())),
                        ("final rms_norm", lambda: poss_ext.ops.rms_norm(x, runner.final_norm_w, runner.eps), 0),
                        ("lm_head", lambda: f @ runner.lm_head.t(), nbytes(runner.lm_head))):
        s = timeit(fn, dev)
        out[name] = {"ms": 1e3 * s, "gbs": b / s / 1e9 if b else None}
    return out


def loop(runner, draft, dev, ctx, new, compile=False) -> dict:
    """Generator rounds: plain decoding, then the draft at 60 nodes / depth 6 (ms per round by phase).
    ``compile``: the target forward and draft step through ``torch.compile`` (CUDA graphs on a GPU)."""
    from poss.decode.generator import Generator
    from poss.decode.loader import compile_steps

    gen = Generator(runner, draft=draft, end_ids=set())
    if compile:
        compile_steps(gen)
    ids = torch.randint(10, runner.lm_head.shape[0] - 10, (ctx,), generator=torch.Generator().manual_seed(0))
    prompt = ids.tolist()
    res = {}
    for name, d, kw in (("decode step", None, dict(depth=0)), ("60/6 round", draft, dict(num_nodes=60, depth=6))):
        gen.draft = d
        for _ in range(3 if compile else 1):  # warm-up (compiling: the recompiles and graph captures too)
            gen.generate([prompt], 4, **kw)
        gen.profile = {}
        t = time.perf_counter()
        r = gen.generate([prompt], new, **kw)
        wall = time.perf_counter() - t
        prof = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in gen.profile.items()}
        prof["round"] = sum(prof.values())
        res[name] = {"ms": prof, "rounds": r.stats[0].rounds, "tokens_per_s": r.stats[0].tokens / wall}
        gen.profile = None
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke test of this script)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--json", default=None)
    ap.add_argument("--compile", action="store_true", help="torch.compile the steps (mode reduce-overhead on CUDA)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    from poss.hardware import resolve_dtype

    dtype = resolve_dtype(args.dtype or ("bf16" if dev.type == "cuda" else "float32"))
    shapes = TINY if args.tiny else LLAMA3_8B
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    t0 = time.perf_counter()
    peak = read_bandwidth(dev, 64 if args.tiny else 4096)
    runner = build(shapes, dev, dtype, args.context + args.new + 256)
    wb = nbytes(runner.lm_head, runner.final_norm_w) + sum(nbytes(*vars(p).values()) for p in runner.layers)
    print(f"{name}, {str(dtype).replace('torch.', '')}, {'tiny' if args.tiny else 'Llama-3-8B'} shapes "
          f"({wb / 1e9:.2f} GB of weights per step), context {args.context}; measured read bandwidth {peak:.0f} GB/s "
          f"(built in {time.perf_counter() - t0:.0f} s){'; steps torch.compiled' if args.compile else ''}")
    out = {"device": name, "dtype": str(dtype), "weight_bytes": wb, "read_bandwidth_gbs": peak, "ops": {}}
    print("\n| op | T | ms | GB/s | % of read bandwidth |\n|---|---|---|---|---|")
    for T in (1, 60):
        ops = per_op(runner, dev, args.context, T)
        out["ops"][T] = ops
        for op, r in ops.items():
            g = f"{r['gbs']:.0f} | {100 * r['gbs'] / peak:.0f}%" if r["gbs"] else " | "
            print(f"| {op} | {T} | {r['ms']:.3f} | {g} |")
    draft = random_draft(runner, dev, dtype)
    res = loop(runner, draft, dev, args.context, args.new, compile=args.compile)
    out["loop"], out["compiled"] = res, args.compile
    step, rnd = res["decode step"]["ms"], res["60/6 round"]["ms"]
    ar_gbs = wb / (step["round"] / 1e3) / 1e9
    print(f"\ndecode step {step['round']:.2f} ms ({1e3 / step['round']:.1f} tok/s): {ar_gbs:.0f} GB/s of weights, "
          f"{100 * ar_gbs / peak:.0f}% of measured read bandwidth")
    print("60/6 round: " + ", ".join(f"{k} {v:.2f} ms" for k, v in rnd.items()))
    ver = rnd.get("verify", 0) + rnd.get("commit", 0)
    print(f"ratios to one decode step: verify+commit {ver / step['round']:.2f}x, whole round "
          f"{rnd['round'] / step['round']:.2f}x (a draft must average more tokens per round than this to pay)")
    out["ratio_verify_to_step"] = ver / step["round"]
    out["ratio_round_to_step"] = rnd["round"] / step["round"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(f"total {time.perf_counter() - t0:.0f} s")


# -- smoke (pytest): the same code on tiny shapes, on the CPU ------------------------------------------
def test_tiny_shapes_cpu(benchmark, bench_threads, tmp_path, capsys):
    """The whole report (per-op table, both loops, the ratios, the JSON) on tiny shapes; the loop is timed."""
    out = tmp_path / "e2e.json"
    benchmark.pedantic(main, (["--tiny", "--device", "cpu", "--context", "32", "--new", "8", "--json", str(out)],),
                       rounds=1, iterations=1)
    text = capsys.readouterr().out
    assert "ratios to one decode step" in text and "| decoder_layer | 60 |" in text
    res = json.loads(out.read_text())
    assert set(res["ops"]["1"]) == {"decoder_layer", "final rms_norm", "lm_head"}
    assert all(r["ms"] > 0 for ops in res["ops"].values() for r in ops.values())
    # 8 new tokens: the prefill gives the first, then one per round without a draft, at least one with it
    assert res["loop"]["decode step"]["rounds"] == 7
    assert 1 <= res["loop"]["60/6 round"]["rounds"] <= 7 and res["ratio_round_to_step"] > 0


if __name__ == "__main__":
    main()
