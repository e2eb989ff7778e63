"""What a round's drafting costs per specialist layout and tree depth: EAGLE-2 (one layer), PosS-2 (three
specialists, two positions each) and the depth-aware PosS 1,5 (one specialist for position 1, one for
positions 2-6, each with its own fc), at depth 1, 2 and 6, on the draft shapes of SmolLM2-135M and
Qwen2.5-Coder-0.5B, and the draft vocabulary's share of it (K rows of the lm_head scored per position).

A round runs only the specialists its depth reaches, so at depth 1 every layout runs one layer and at
depth 2 PosS 1,5 runs two (each once, as EAGLE-2 runs its one layer twice). The drafts and the target
are random with the real widths (hidden, heads, FFN, vocabulary) and one target layer: drafting does
not depend on the target's depth, and random weights cost what trained ones do.

Run the table:  PYTHONPATH=.:python python bench/bench_draft_layout.py [--threads 1] [--rounds 40]
pytest form:    PYTHONPATH=.:python pytest bench/bench_draft_layout.py --benchmark-only   (tiny shapes)
"""

import argparse
import statistics

import torch

# (hidden, heads, kv_heads, ffn, vocab, rope_theta, draft vocabularies to compare)
TARGETS = {
    "smollm2-135m": (576, 9, 3, 1536, 49152, 1e5, (8192,)),
    "qwen2.5-coder-0.5b": (896, 14, 2, 4864, 151936, 1e6, (8192, 16384, 32768, 0)),
}
LAYOUTS = {"EAGLE-2": dict(n=1), "PosS-2": dict(n=3, ppl=2), "PosS 1,5 (own fc)": dict(n=2, schedule=[1, 5],
                                                                                       fc_per_specialist=True)}
TREES = {1: (2, 1), 2: (4, 2), 6: (60, 6)}  # depth: (num_nodes, beam_width)
MAX_SEQ = 512


def synthetic_target(hidden, heads, kv_heads, ffn, vocab, rope_theta, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                      rope_theta=rope_theta, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg).eval()


def generator(model, dtype, max_seq=None):
    from poss.decode.generator import Generator
    from poss.models.target import TargetRunner

    runner = TargetRunner(model, max_batch=1, max_seq=max_seq or MAX_SEQ, dtype=dtype)
    return Generator(runner, draft=None, end_ids=set())


def attach_draft(gen, n=1, ppl=1, schedule=(), fc_per_specialist=False, draft_vocab=0, seed=0):
    from poss.models.draft import PosSDraft
    from poss.models.draft_config import DraftConfig

    r = gen.runner
    cfg = DraftConfig.for_target(r.config, "synthetic", r.fingerprint(), n_specialists=n,
                                 positions_per_specialist=ppl, schedule=list(schedule),
                                 fc_per_specialist=fc_per_specialist, draft_vocab=draft_vocab)
    torch.manual_seed(seed)
    d = PosSDraft(cfg)
    if draft_vocab:
        d.token_map.copy_(torch.randperm(cfg.vocab)[:draft_vocab].sort().values)
    gen.draft = d.to(r.dtype).eval().attach(r, 1, MAX_SEQ)


def draft_ms(gen, prompt, depth, rounds):
    """Mean draft milliseconds per round over ``rounds`` rounds (after a warm-up call)."""
    from poss.decode.params import TreeParams

    nodes, beam = TREES[depth]
    tree = TreeParams(num_nodes=nodes, depth=depth, beam_width=beam)
    gen.generate([prompt], 4, tree=tree)  # warm-up: allocations, oneDNN primitives
    gen.profile = {}
    gen.generate([prompt], rounds, tree=tree)  # a random draft is accepted ~never: one token a round
    ms = 1e3 * statistics.mean(gen.profile["draft"])
    gen.profile = None
    return ms


def table(target, threads, rounds, dtype=torch.bfloat16, shapes=None):
    """Rows ``(target, layout, draft vocabulary, depth, ms per round, ratio to EAGLE-2)``."""
    hidden, heads, kv, ffn, vocab, theta, vocabs = shapes or TARGETS[target]
    torch.set_num_threads(threads)
    gen = generator(synthetic_target(hidden, heads, kv, ffn, vocab, theta), dtype)
    prompt = list(range(11, 11 + 48))
    rows = []
    for k in vocabs:
        base = {}
        for name, kw in LAYOUTS.items():
            attach_draft(gen, draft_vocab=k, **kw)
            for depth in TREES:
                ms = draft_ms(gen, prompt, depth, rounds)
                base.setdefault(depth, ms)
                rows.append((target, name, k or vocab, depth, ms, ms / base[depth]))
    return rows


def test_draft_layout_table(benchmark):
    """Tiny shapes: every layout and depth runs and is timed (the real shapes: run this file)."""
    shapes = (128, 2, 1, 256, 300, 1e6, (64, 0))  # head dim 64, the smallest the kernels take
    rows = benchmark.pedantic(lambda: table("tiny", 1, 6, torch.float32, shapes), rounds=1, iterations=1)
    assert len(rows) == 2 * len(LAYOUTS) * len(TREES)
    assert all(r[4] > 0 for r in rows) and all(r[5] == 1.0 for r in rows if r[1] == "EAGLE-2")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=40, help="draft rounds timed per layout and depth")
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = ap.parse_args(argv)
    from poss.hardware import describe

    rows = [r for t in args.targets for r in table(t, args.threads, args.rounds, getattr(torch, args.dtype))]
    print("| target | layout | draft vocabulary | depth | draft ms / round | vs EAGLE-2 |")
    print("|---|---|---|---|---|---|")
    for t, name, k, depth, ms, ratio in rows:
        print(f"| {t} | {name} | {k:,} | {depth} | {ms:.2f} | {ratio:.2f}× |")
    m = describe(args.dtype, args.threads)
    print(f"\n{m['cpu']} ({m['torch_cpu_capability']}), {args.threads} thread(s), {args.dtype}, "
          f"{args.rounds} rounds each")


if __name__ == "__main__":
    main()
