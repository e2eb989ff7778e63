"""``poss generate`` and ``poss chat``: generation from the command line, with tokens/s and tau."""

import argparse
import re
import sys

from poss.cli_args import (
    DATASTORE_HELP,
    DRAFT_VOCAB_HELP,
    LOOKUP_HELP,
    RETUNE_HELP,
    UsageError,
    check_draft,
    check_target,
    datastore_arg,
    float_in,
    int_at_least,
    int_or_auto,
    target_help,
)
from poss.models.draft_config import DRAFT_VOCABS

DTYPES = ("auto", "float32", "bfloat16", "gguf")
_TREE_FLAGS = {"num_nodes": "--num-nodes", "depth": "--depth", "beam_width": "--beam-width", "lookup": "--lookup"}


def add_arguments(p: argparse.ArgumentParser, chat: bool) -> None:
    """The generate / chat options (torch is not imported here, so ``--help`` stays fast)."""
    if not chat:
        p.add_argument("--prompt", action="append", required=True, help="a user message (repeat for a batch)")
        p.add_argument("--speculate-max-batch", type=int_or_auto(1, words=("auto", "off")), default="auto",
                       help="speculate only while at most this many prompts are live; larger batches decode "
                            "plainly (auto: measured once on this machine; off: always speculate)")
    p.add_argument("--target", default="smollm2-135m", help=target_help())
    p.add_argument("--draft", default=None,
                   help="PosS draft folder (config.json + model.safetensors); default: the one shipped for the target")
    p.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding (the baseline)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights and activations; auto: bfloat16 on CUDA or a CPU with AMX/AVX512-BF16, else float32; "
                        "gguf: the GGUF file's own Q8_0/Q4_0/Q4_1 blocks (CPU), other weights as auto")
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help="torch CPU threads (default: torch's choice); on a busy 2-core machine 1 thread can be "
                        "several times faster than 2")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the target and draft steps (~30 s to compile; +2-8 %% tokens/s on the dev CPU)")
    p.add_argument("--max-new-tokens", type=int_at_least(0), default=256, help="tokens generated per answer at most")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s = p.add_argument_group("sampling (per request; temperature 0 is greedy and the filters need > 0)")
    s.add_argument("--temperature", type=float_in(0), default=0.0, help="0: greedy; > 0: sample")
    s.add_argument("--top-k", type=int_at_least(0), default=0, help="keep the k most likely tokens (0: off)")
    s.add_argument("--top-p", type=float_in(0, 1, low_open=True), default=1.0, help="nucleus mass to keep (1: off)")
    s.add_argument("--min-p", type=float_in(0, 1), default=0.0,
                   help="keep tokens at least this fraction as likely as the most likely one (0: off)")
    s.add_argument("--seed", type=int, default=None, help="makes sampling reproducible (default: a fresh seed)")
    t = p.add_argument_group("draft tree (auto: the size with the most expected tokens/s on this machine, timed "
                             "once per machine, dtype and draft, then cached; a size given alone takes 60 / 6 for "
                             "the other)")
    t.add_argument("--num-nodes", type=int_or_auto(1, 256), default="auto",
                   help="nodes verified per round, root included")
    t.add_argument("--depth", type=int_or_auto(0), default="auto", help="draft positions below the root")
    t.add_argument("--beam-width", "--top-k-draft", dest="beam_width", type=int_at_least(1), default=10,
                   help="children kept per frontier node and frontier size per level")
    t.add_argument("--lookup", type=int_or_auto(0), default="auto", help=LOOKUP_HELP)
    t.add_argument("--datastore", type=datastore_arg, default="auto", help=DATASTORE_HELP)
    t.add_argument("--draft-vocab", choices=DRAFT_VOCABS, default="trained", help=DRAFT_VOCAB_HELP)
    t.add_argument("--retune", action="store_true", help=RETUNE_HELP)


def check_arguments(args) -> None:
    """Every check that needs no model: raises ``UsageError`` naming the flag."""
    if args.temperature == 0:
        given = [f"--{n.replace('_', '-')} {getattr(args, n)}"
                 for n, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)) if getattr(args, n) != off]
        if given:
            raise UsageError(f"{', '.join(given)}: sampling filters need --temperature > 0 "
                             "(temperature 0 is greedy)")
    if args.draft is not None and args.no_draft:
        raise UsageError("--draft and --no-draft exclude each other")
    check_target(args.target)
    check_draft(args.draft)


def _params(args):
    """``(SamplingParams, TreeParams)`` from the flags; ``UsageError`` names the bad flag."""
    from poss.decode.params import SamplingParams, tree_from_flags

    try:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  min_p=args.min_p, seed=args.seed)
    except ValueError as e:
        raise UsageError(re.sub(r"\b(temperature|top_k|top_p|min_p|seed)\b",
                                lambda m: "--" + m.group(1).replace("_", "-"), str(e))) from None
    try:
        tree = tree_from_flags(args.num_nodes, args.depth, args.beam_width, args.lookup)
    except ValueError as e:
        raise UsageError(re.sub(r"\b(num_nodes|depth|beam_width|lookup)\b", lambda m: _TREE_FLAGS[m.group(1)],
                                str(e))) from None
    return sampling, tree


def _load(args):
    import torch

    from poss.cli_args import chosen_draft
    from poss.decode.loader import load
    from poss.hardware import resolve_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = "gguf" if args.dtype == "gguf" else resolve_dtype(args.dtype, "cpu")  # gguf: the file's own blocks
    limit = getattr(args, "speculate_max_batch", "auto")  # chat has one conversation: no flag
    return load(args.target, draft=chosen_draft(args, "poss"), dtype=dtype,
                compile=args.compile, speculate_max_batch=None if limit == "off" else limit,
                retune=args.retune, datastore=args.datastore, draft_vocab=args.draft_vocab)


def _speed_line(stats) -> str:
    tokens = sum(s.tokens for s in stats)
    seconds = max(s.seconds for s in stats) or 1e-9
    rounds = sum(s.rounds for s in stats)
    tau = sum(s.tau * s.rounds for s in stats) / rounds if rounds else 0.0
    return f"[{tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tokens/s, tau {tau:.2f}]"


def _options(args):
    """The call's options, checked before any loading (``UsageError`` on a bad flag)."""
    check_arguments(args)
    sampling, tree = _params(args)
    options = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, tree=tree, stop=args.stop)
    if tree == "auto":
        options["beam_width"] = args.beam_width
        if args.lookup != "auto":
            options["lookup"] = args.lookup
    return options


def _check_context(gen, prompts, flag: str) -> None:
    """A prompt that leaves no room to generate is a usage error naming it."""
    for i, prompt in enumerate(prompts):
        n = len(gen.encode(prompt))
        if n >= gen.context_limit:
            which = f"{flag} {i + 1}" if len(prompts) > 1 else flag
            raise UsageError(f"{which} is {n} tokens, at or over the model's context of {gen.context_limit} "
                             "tokens: no room to generate; shorten it")


def cmd_generate(args) -> int:
    options = _options(args)
    gen = _load(args)
    _check_context(gen, args.prompt, "--prompt")
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


def chat_loop(gen, options, read=None, out=None, err=None) -> int:
    """The chat session: one answer per line read until an empty line, Ctrl-D or Ctrl-C at the prompt
    (all exit 0). Ctrl-C during an answer stops that answer (what was shown stays in the conversation)
    and returns to the prompt; a message over the context is reported and dropped."""
    read = read or input  # looked up per call, so a patched ``input`` is honoured
    out = out or sys.stdout
    err = err or sys.stderr
    messages = []
    print("poss chat: empty line or Ctrl-D to quit, Ctrl-C to stop an answer, /reset to start over.", file=err)
    while True:
        try:
            line = read("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=out, flush=True)
            return 0
        if not line:
            return 0
        if line == "/reset":
            messages = []
            continue
        messages.append({"role": "user", "content": line})
        try:
            _check_context(gen, [messages], "your message")
        except UsageError as e:
            messages.pop()
            print(f"poss chat: {e}", file=err)
            continue
        print("assistant> ", end="", flush=True, file=out)
        shown = []
        stream = gen.stream(messages, **options)
        try:
            for piece in stream:
                shown.append(piece)
                print(piece, end="", flush=True, file=out)
        except KeyboardInterrupt:
            stream.close()
            print(file=out, flush=True)
            print("[answer stopped]", file=err)
            if shown:
                messages.append({"role": "assistant", "content": "".join(shown)})
            else:
                messages.pop()
            continue
        print(file=out)
        messages.append({"role": "assistant", "content": gen.last_result.texts[0]})
        print(_speed_line(gen.last_result.stats), file=err)


def cmd_chat(args) -> int:
    options = _options(args)
    gen = _load(args)
    return chat_loop(gen, options)
