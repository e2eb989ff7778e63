"""``poss generate``: text for one or more prompts, with tokens/s and tau; the loading and checks ``poss chat``
shares."""

import re
import sys

from poss.cli.args import (
    Formatter,
    UsageError,
    add_draft,
    add_dtype,
    add_sampling,
    add_speculate_max_batch,
    add_target,
    add_threads,
    add_tree,
    check_model,
    int_at_least,
    nonempty_text,
    tree_from_args,
)


def add_model_and_decoding(p) -> None:
    """The flags generate and chat share (torch is not imported here, so ``--help`` stays fast)."""
    add_target(p)
    add_draft(p)
    add_dtype(p, "run")
    add_threads(p)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the target and draft steps (~30 s to compile; +2-8 %% tokens/s on the dev CPU)")
    p.add_argument("--max-new-tokens", type=int_at_least(0), default=256, help="tokens generated per answer at most")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_sampling(p)
    add_tree(p)


def add_parser(sub):
    p = sub.add_parser("generate", help="generate text for one or more prompts", formatter_class=Formatter)
    p.add_argument("--prompt", action="append", required=True, type=nonempty_text,
                   help="a user message (repeat for a batch)")
    add_speculate_max_batch(p, "prompts")
    add_model_and_decoding(p)
    return p


def check_arguments(args) -> None:
    """Every check that needs no model: raises ``UsageError`` naming the flag."""
    if args.temperature == 0:
        given = [f"--{n.replace('_', '-')} {getattr(args, n)}"
                 for n, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)) if getattr(args, n) != off]
        if given:
            raise UsageError(f"{', '.join(given)}: sampling filters need --temperature > 0 "
                             "(temperature 0 is greedy)")
    check_model(args)


def _params(args):
    """``(SamplingParams, TreeParams)`` from the flags; ``UsageError`` names the bad flag."""
    from poss.decode.params import SamplingParams

    try:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  min_p=args.min_p, seed=args.seed)
    except ValueError as e:
        raise UsageError(re.sub(r"\b(temperature|top_k|top_p|min_p|seed)\b",
                                lambda m: "--" + m.group(1).replace("_", "-"), str(e))) from None
    return sampling, tree_from_args(args)


def options(args) -> dict:
    """The call's options, checked before any loading (``UsageError`` on a bad flag)."""
    check_arguments(args)
    sampling, tree = _params(args)
    opts = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, tree=tree, stop=args.stop)
    if tree == "auto":
        opts["beam_width"] = args.beam_width
        if args.lookup != "auto":
            opts["lookup"] = args.lookup
    return opts


def load(args):
    """The generator for the flags (loads the models; call it after every check)."""
    from poss.cli.args import chosen_draft, model_dtype
    from poss.decode.loader import load as load_generator

    limit = getattr(args, "speculate_max_batch", "auto")  # chat has one conversation: no flag
    return load_generator(args.target, draft=chosen_draft(args, "poss"), dtype=model_dtype(args),
                          compile=args.compile, speculate_max_batch=None if limit == "off" else limit,
                          retune=args.retune, datastore=args.datastore, draft_vocab=args.draft_vocab,
                          threads=args.threads or "auto")


def speed_line(result, gen=None) -> str:
    """``[tokens, seconds, tokens/s, tau; the tree (and where auto took it from); the dtype auto picked
    and its timings, when it timed the formats; the weight formats when some run on GGUF blocks; threads]``."""
    import torch

    from poss.decode.autotune import tree_label

    stats = result.stats
    tokens = sum(s.tokens for s in stats)
    seconds = max(s.seconds for s in stats) or 1e-9
    rounds = sum(s.rounds for s in stats)
    tau = sum(s.tau * s.rounds for s in stats) / rounds if rounds else 0.0
    line = f"[{tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tokens/s, tau {tau:.2f}"
    if getattr(result, "tree", None) is not None:
        line += f"; tree {tree_label(result.tree)}"
        auto = getattr(gen, "auto_choice", None)
        if auto is not None and auto.tree == result.tree:
            line += f" (auto: {auto.source})"
    choice = getattr(gen, "dtype_choice", None)
    if choice is not None and choice.ms:  # dtype auto was timed: what it picked, and the timings
        line += f"; dtype {choice.label()}"
    runner = getattr(gen, "runner", None)
    formats = runner.weight_formats() if hasattr(runner, "weight_formats") else {}
    if any(f.startswith("q") for f in formats):  # --dtype gguf: say which weights ran on the file's blocks
        line += "; weights " + ", ".join(f"{f} x{n}" for f, n in sorted(formats.items()))
    threads = torch.get_num_threads()
    return line + f"; {threads} thread{'s' if threads > 1 else ''}]"


def check_context(gen, prompts, flag: str) -> None:
    """A prompt that leaves no room to generate is a usage error naming it. ``gen`` needs only
    ``encode`` and ``context_limit``: a loaded generator, or :class:`TokenizerOnly` before loading."""
    for i, prompt in enumerate(prompts):
        n = len(gen.encode(prompt))
        if n >= gen.context_limit:
            which = f"{flag} {i + 1}" if len(prompts) > 1 else flag
            raise UsageError(f"{which} is {n} tokens, at or over the model's context of {gen.context_limit} "
                             "tokens: no room to generate; shorten it")


class TokenizerOnly:
    """The target's tokenizer and context length, without its weights: what :func:`check_context` needs
    to refuse a prompt before the model loads. A GGUF target is converted first (once, cached), as
    loading would."""

    def __init__(self, target):
        from transformers import AutoConfig, AutoTokenizer

        from poss.decode.generator import Generator
        from poss.models.registry import resolve
        from poss.models.target import sliding_window

        path = str(resolve(target))
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        # The generator's own rule (Generator.__init__): the model's positions, within its sliding window.
        self.context_limit = int(getattr(config, "max_position_embeddings", None) or 4096)
        self.context_limit = min(self.context_limit, sliding_window(config) or self.context_limit)
        self._encode = Generator.encode  # the chat template exactly as generation applies it

    def encode(self, prompt):
        return self._encode(self, prompt)


def run(args) -> int:
    opts = options(args)
    check_context(TokenizerOnly(args.target), args.prompt, "--prompt")
    gen = load(args)
    if len(args.prompt) == 1:
        for piece in gen.stream(args.prompt[0], **opts):
            print(piece, end="", flush=True)
        print()
        print(speed_line(gen.last_result, gen), file=sys.stderr)
        return 0
    res = gen.generate(args.prompt, **opts)
    for i, text in enumerate(res.texts):
        print(f"--- prompt {i}\n{text}")
    print(speed_line(res, gen), file=sys.stderr)
    return 0
