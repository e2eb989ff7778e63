"""Answer tokens/s of on-policy data generation: ``poss distill`` (our batched Generator) against the
``--regenerate`` path (HF ``generate``, one prompt at a time), in one run on the same prompts.

    PYTHONPATH=.:python python bench/bench_distill_throughput.py --prompts 32 --hf-prompts 8 --max-new-tokens 256 \\
        --threads 1 [--dtype auto]
    PYTHONPATH=.:python pytest bench/bench_distill_throughput.py --benchmark-disable -q   (tiny random model, seconds)

Both paths run the target in the same dtype (``auto``: bf16 where the CPU has fast bf16 GEMMs).
"""

import argparse
import json
import tempfile
import time

import torch


def measure(gen, hf, convs, prompts: int, hf_prompts: int, max_new_tokens: int, max_prompt_tokens: int = 384) -> dict:
    """Answer tokens and seconds of both paths on the first ``prompts`` eligible first turns of ``convs``
    (HF ``generate`` on the first ``hf_prompts`` of them), and the ratio of their tokens/s."""
    from poss.train.distill import distill, select_prompts
    from poss.train.regenerate import regenerate_conversation

    _, train = select_prompts(convs, gen.encode, prompts, 0, 0, max_prompt_tokens)
    t0 = time.perf_counter()
    n_hf = 0
    for i, _ in train[:hf_prompts]:
        first = next(m for m in convs[i] if m["role"] == "user")
        out = regenerate_conversation(gen.tokenizer, hf, [first, {"role": "assistant", "content": ""}],
                                      max_new_tokens)
        n_hf += len(gen.tokenizer(out[-1]["content"], add_special_tokens=False).input_ids)
    hf_s = time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as d:
        meta = distill(gen, convs, d, prompts, 0, prompts, max_new_tokens, max_prompt_tokens, progress=False)
    ours = meta["throughput"]
    row = {"max_new_tokens": max_new_tokens,
           "hf_regenerate": {"prompts": min(hf_prompts, len(train)), "tokens": n_hf, "seconds": hf_s,
                             "tok_s": n_hf / hf_s},
           "poss_distill": {"prompts": prompts, "tokens": ours["answer_tokens"], "seconds": ours["seconds"],
                            "tok_s": ours["tokens_per_s"]}}
    row["speedup"] = row["poss_distill"]["tok_s"] / row["hf_regenerate"]["tok_s"]
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=32, help="prompts for the batched path (one batch)")
    ap.add_argument("--hf-prompts", type=int, default=8, help="the first N of them for HF generate")
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
    row = measure(gen, hf, load_sharegpt().messages, args.prompts, args.hf_prompts, args.max_new_tokens)
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
    row = benchmark.pedantic(measure, (gen, model, convs, 4, 2, 8, 40), rounds=1, iterations=1)
    assert row["poss_distill"]["prompts"] == 4 and row["poss_distill"]["tokens"] == 4 * 8
    assert row["hf_regenerate"]["prompts"] == 2 and row["hf_regenerate"]["tokens"] > 0
    assert row["speedup"] > 0


if __name__ == "__main__":
    main()
