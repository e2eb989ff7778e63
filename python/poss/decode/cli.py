"""``poss generate`` and ``poss chat``: generation from the command line, with tokens/s and tau."""

import argparse
import sys

DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(p: argparse.ArgumentParser, chat: bool) -> None:
    """The generate / chat options (torch is not imported here, so ``--help`` stays fast)."""
    if not chat:
        p.add_argument("--prompt", action="append", required=True, help="a user message (repeat for a batch)")
    p.add_argument("--target", default="smollm2-135m", help="registry name, HF folder or .gguf file")
    p.add_argument("--draft", default=None, help="PosS draft folder (default: the shipped one for the target)")
    p.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding (the baseline)")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--max-new-tokens", type=int, default=256)
    s = p.add_argument_group("sampling (per request; temperature 0 is greedy)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus mass to keep (1: off)")
    s.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least this fraction as likely as the most likely one (0: off)")
    s.add_argument("--seed", type=int, default=None)
    t = p.add_argument_group("draft tree")
    t.add_argument("--num-nodes", type=int, default=60, help="nodes verified per round, root included")
    t.add_argument("--depth", type=int, default=6, help="draft positions below the root")
    t.add_argument("--beam-width", "--top-k-draft", dest="beam_width", type=int, default=10,
                   help="children kept per frontier node and frontier size per level")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _params(args):
    """``(SamplingParams, TreeParams)`` from the flags; ``ValueError`` names the bad one."""
    from poss.decode.params import SamplingParams, TreeParams

    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              min_p=args.min_p, seed=args.seed)
    tree = TreeParams(num_nodes=args.num_nodes, depth=args.depth, beam_width=args.beam_width)
    if args.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {args.max_new_tokens}")
    return sampling, tree


def _load(args):
    import torch

    from poss.decode.loader import load
    from poss.models.registry import shipped_draft

    draft = None
    if not args.no_draft:
        draft = args.draft or shipped_draft(args.target)
        if draft is None:
            print(f"poss: no trained draft exists for target {args.target!r} (none in drafts/); "
                  "generating without one. Pass --draft DIR, or --no-draft to silence this.", file=sys.stderr)
    return load(args.target, draft=draft, dtype=getattr(torch, args.dtype))


def _speed_line(stats) -> str:
    tokens = sum(s.tokens for s in stats)
    seconds = max(s.seconds for s in stats) or 1e-9
    rounds = sum(s.rounds for s in stats)
    tau = sum(s.tau * s.rounds for s in stats) / rounds if rounds else 0.0
    return f"[{tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tokens/s, tau {tau:.2f}]"


def _checked(args, command: str):
    """The call's options, or None after printing a one-line error (checked before any loading)."""
    try:
        sampling, tree = _params(args)
    except ValueError as e:
        print(f"poss {command}: {e}", file=sys.stderr)
        return None
    return dict(max_new_tokens=args.max_new_tokens, sampling=sampling, tree=tree, stop=args.stop)


def cmd_generate(args) -> int:
    options = _checked(args, "generate")
    if options is None:
        return 2
    gen = _load(args)
    if len(args.prompt) == 1:
        for piece in gen.stream(args.prompt[0], **options):
            print(piece, end="", flush=True)
        print()
        print(_speed_line(gen.last_result.stats), file=sys.stderr)
        return 0
    res = gen.generate(args.prompt, **options)
    for i, text in enumerate(res.texts):
        print(f"--- prompt {i}\n{text}")
    print(_speed_line(res.stats), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    options = _checked(args, "chat")
    if options is None:
        return 2
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
        for piece in gen.stream(messages, **options):
            print(piece, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": gen.last_result.texts[0]})
        print(_speed_line(gen.last_result.stats), file=sys.stderr)
    return 0
