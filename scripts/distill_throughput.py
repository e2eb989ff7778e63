"""Answer tokens/s of on-policy data generation: ``poss distill`` (our batched Generator) against the
``--regenerate`` path (HF ``generate``, one prompt at a time), in one run on the same prompts.

    python scripts/distill_throughput.py --prompts 32 --hf-prompts 8 --max-new-tokens 256 --threads 1 [--dtype auto]

Both paths run the target in the same dtype (``auto``: bf16 where the CPU has fast bf16 GEMMs).
"""

import argparse
import json
import tempfile
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=32, help="prompts for the batched path (one batch)")
    ap.add_argument("--hf-prompts", type=int, default=8, help="the first N of them for HF generate")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import poss
    from poss.hardware import describe
    from poss.train.data import load_sharegpt
    from poss.train.distill import distill, select_prompts
    from poss.train.regenerate import regenerate_conversation

    gen = poss.load(args.target, draft=None, dtype=args.dtype)
    dtype = gen.runner.dtype
    convs = load_sharegpt().messages
    _, train = select_prompts(convs, gen.encode, args.prompts, 0, 0, 384)
    hf = gen.runner.hf if hasattr(gen.runner, "hf") else None
    if hf is None:
        from poss.models.registry import load_model

        _, hf = load_model(args.target, dtype=dtype)

    t0 = time.perf_counter()
    n_hf = 0
    for i, _ in train[: args.hf_prompts]:
        first = next(m for m in convs[i] if m["role"] == "user")
        out = regenerate_conversation(gen.tokenizer, hf, [first, {"role": "assistant", "content": ""}],
                                      args.max_new_tokens)
        n_hf += len(gen.tokenizer(out[-1]["content"], add_special_tokens=False).input_ids)
    hf_s = time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as d:
        meta = distill(gen, convs, d, args.prompts, 0, args.prompts, args.max_new_tokens, 384, progress=False)
    ours = meta["throughput"]
    row = {**describe(dtype, args.threads), "max_new_tokens": args.max_new_tokens,
           "hf_regenerate": {"prompts": args.hf_prompts, "tokens": n_hf, "seconds": hf_s, "tok_s": n_hf / hf_s},
           "poss_distill": {"prompts": args.prompts, "tokens": ours["answer_tokens"], "seconds": ours["seconds"],
                            "tok_s": ours["tokens_per_s"]}}
    row["speedup"] = row["poss_distill"]["tok_s"] / row["hf_regenerate"]["tok_s"]
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
