"""``poss generate`` and ``poss chat``: generation from the command line, with tokens/s and tau."""

import argparse
import sys
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(p: argparse.ArgumentParser, chat: bool) -> None:
    if not chat:
        p.add_argument("--prompt", action="append", required=True, help="a user message (repeat for a batch)")
    p.add_argument("--target", default="smollm2-135m", help="registry name, HF folder or .gguf file")
    p.add_argument("--draft", default=None, help="PosS draft folder (default: the shipped one for the target)")
    p.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding (the baseline)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--num-nodes", type=int, default=60)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--top-k-draft", type=int, default=10)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=None)


def _load(args):
    from poss.api import load, shipped_draft

    draft = None
    if not args.no_draft:
        draft = args.draft or shipped_draft(args.target)
        if draft is None:
            print(f"poss: no trained draft exists for target {args.target!r} (none in drafts/); "
                  "generating without one. Pass --draft DIR, or --no-draft to silence this.", file=sys.stderr)
    return load(args.target, draft=draft, dtype=DTYPES[args.dtype])


def _options(args) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, num_nodes=args.num_nodes, depth=args.depth, top_k_draft=args.top_k_draft,
                seed=args.seed, stop=args.stop)


def _speed_line(stats) -> str:
    tokens = sum(s.tokens for s in stats)
    seconds = max(s.seconds for s in stats) or 1e-9
    rounds = sum(s.rounds for s in stats)
    tau = sum(s.tau * s.rounds for s in stats) / rounds if rounds else 0.0
    return f"[{tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tokens/s, tau {tau:.2f}]"


def cmd_generate(args) -> int:
    gen = _load(args)
    if len(args.prompt) == 1:
        for piece in gen.stream(args.prompt[0], **_options(args)):
            print(piece, end="", flush=True)
        print()
        print(_speed_line(gen.last_result.stats), file=sys.stderr)
        return 0
    res = gen.generate(args.prompt, **_options(args))
    for i, text in enumerate(res.texts):
        print(f"--- prompt {i}\n{text}")
    print(_speed_line(res.stats), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    gen = _load(args)
    messages = []
    print("poss chat: empty line or Ctrl-D to quit, /reset to start over.", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        if line == "/reset":
            messages = []
            continue
        messages.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        for piece in gen.stream(messages, **_options(args)):
            print(piece, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": gen.last_result.texts[0]})
        print(_speed_line(gen.last_result.stats), file=sys.stderr)
    return 0
