"""Answer tokens/s of on-policy data generation: ``poss distill`` (continuous batching through our
DecodeEngine) against fixed batches of the same size through ``Generator.generate`` (each batch runs
until its longest answer ends) and against the ``--regenerate`` path (HF ``generate``, one prompt at a
time), in one run on the same prompts.

    PYTHONPATH=.:python python bench/bench_distill_throughput.py --prompts 32 --hf-prompts 8 --max-new-tokens 256 \\
        --threads 1 [--dtype auto]
    PYTHONPATH=.:python python bench/bench_distill_throughput.py --prompts 96 --batch-size 32 --hf-prompts 0 \\
        --max-new-tokens 256 --threads 1
    PYTHONPATH=.:python pytest bench/bench_distill_throughput.py --benchmark-disable -q   (tiny random model, seconds)

Both paths run the target in the same dtype (``auto``: bf16 where the CPU has fast bf16 GEMMs).
"""

import argparse
import json
import tempfile
import time

import torch


def measure(gen, hf, convs, prompts: int, hf_prompts: int, max_new_tokens: int, max_prompt_tokens: int = 384,
            batch_size: int = 0) -> dict:
    """Answer tokens and seconds of each path on the first ``prompts`` eligible first turns of ``convs``:
    ``poss distill`` with ``batch_size`` rows (0: all prompts in one batch), the same prompts in fixed
    batches of that size, and HF ``generate`` on the first ``hf_prompts`` (0: no HF row). Raises when the
    two batchings give different answers (greedy rows do not depend on their batch)."""
    from poss.train.distill import distill, read_records, select_prompts
    from poss.train.regenerate import regenerate_conversation

    batch_size = batch_size or prompts
    _, train = select_prompts(convs, gen.encode, prompts, 0, 0, max_prompt_tokens)
    row = {"max_new_tokens": max_new_tokens, "batch_size": batch_size}
    if hf_prompts:
        t0 = time.perf_counter()
        n_hf = 0
        for i, _ in train[:hf_prompts]:
            first = next(m for m in convs[i] if m["role"] == "user")
            out = regenerate_conversation(gen.tokenizer, hf, [first, {"role": "assistant", "content": ""}],
                                          max_new_tokens)
            n_hf += len(gen.tokenizer(out[-1]["content"], add_special_tokens=False).input_ids)
        hf_s = time.perf_counter() - t0
        row["hf_regenerate"] = {"prompts": min(hf_prompts, len(train)), "tokens": n_hf, "seconds": hf_s,
                                "tok_s": n_hf / hf_s}

    gen.keep_features = True  # as distill runs it
    fixed, t0 = [], time.perf_counter()
    for s in range(0, len(train), batch_size):
        fixed += gen.generate([p for _, p in train[s:s + batch_size]], max_new_tokens=max_new_tokens).token_ids
    fixed_s = time.perf_counter() - t0
    row["fixed_batches"] = {"prompts": len(train), "tokens": sum(map(len, fixed)), "seconds": fixed_s,
                            "tok_s": sum(map(len, fixed)) / fixed_s}

    with tempfile.TemporaryDirectory() as d:
        meta = distill(gen, convs, d, prompts, 0, batch_size, max_new_tokens, max_prompt_tokens, progress=False)
        ours = {r["key"]: r["answer_ids"] for r in read_records(d)}
    if [ours[k] for k in range(len(train))] != fixed:
        raise AssertionError("continuous and fixed batches gave different greedy answers")
    thr = meta["throughput"]
    row["poss_distill"] = {"prompts": prompts, "tokens": thr["answer_tokens"], "seconds": thr["seconds"],
                           "tok_s": thr["tokens_per_s"]}
    row["continuous_over_fixed"] = row["poss_distill"]["tok_s"] / row["fixed_batches"]["tok_s"]
    if hf_prompts:
        row["speedup"] = row["poss_distill"]["tok_s"] / row["hf_regenerate"]["tok_s"]
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=32, help="prompts for the batched paths")
    ap.add_argument("--batch-size", type=int, default=0, help="rows per batch (0: all the prompts at once)")
    ap.add_argument("--hf-prompts", type=int, default=8, help="the first N of them for HF generate (0: none)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import poss
    from poss.hardware import describe
    from poss.train.data import load_sharegpt

    gen = poss.load(args.target, draft=None, dtype=args.dtype)
    dtype = gen.runner.dtype
    hf = gen.runner.hf if hasattr(gen.runner, "hf") else None
    if hf is None:
        from poss.models.registry import load_model

        _, hf = load_model(args.target, dtype=dtype)
    row = measure(gen, hf, load_sharegpt().messages, args.prompts, args.hf_prompts, args.max_new_tokens,
                  batch_size=args.batch_size)
    print(json.dumps({**describe(dtype, args.threads), **row}, indent=1))


# -- smoke (pytest): a tiny random model with a byte tokenizer ---------------------------------------
def test_both_paths_tiny(benchmark, bench_threads):
    from poss.testing import byte_chat_tokenizer, make_generator, tiny_target

    model = tiny_target()
    model.generation_config.eos_token_id = None  # every answer runs the full length on both paths
    gen = make_generator(model)
    gen.tokenizer = byte_chat_tokenizer()
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma"]
    convs = [[{"role": "user", "content": f"please explain {w} in detail"}, {"role": "assistant", "content": "ok"}]
             for w in words]
    row = benchmark.pedantic(measure, (gen, model, convs, 4, 2, 8, 40), {"batch_size": 3}, rounds=1, iterations=1)
    assert row["poss_distill"]["prompts"] == 4 and row["poss_distill"]["tokens"] == 4 * 8
    assert row["fixed_batches"]["tokens"] == 4 * 8 and row["continuous_over_fixed"] > 0
    assert row["hf_regenerate"]["prompts"] == 2 and row["hf_regenerate"]["tokens"] > 0
    assert row["speedup"] > 0


if __name__ == "__main__":
    main()
