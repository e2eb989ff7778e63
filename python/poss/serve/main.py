"""``poss serve``: load the model once, then serve the OpenAI API with uvicorn until Ctrl-C."""

import argparse
import sys
from pathlib import Path

from poss.cli_args import (
    DATASTORE_HELP,
    DRAFT_VOCAB_HELP,
    LOOKUP_HELP,
    RETUNE_HELP,
    Formatter,
    UsageError,
    check_draft,
    check_target,
    datastore_arg,
    int_at_least,
    int_or_auto,
    target_help,
)
from poss.models.draft_config import DRAFT_VOCABS

DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and completions, streaming)",
                       formatter_class=Formatter)
    p.add_argument("--target", default="smollm2-135m", help=target_help())
    p.add_argument("--draft", default=None, help="PosS draft folder (default: the shipped one for the target)")
    p.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding")
    p.add_argument("--served-model-name", default=None,
                   help="the `model` the API accepts (default: the target's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int_at_least(0, 65535), default=8000, help="TCP port (0: any free one)")
    p.add_argument("--max-batch", type=int_at_least(1), default=8, help="requests decoded together")
    p.add_argument("--max-queue", type=int_at_least(0), default=64, help="requests waiting beyond the batch (then 429)")
    p.add_argument("--default-max-tokens", type=int_at_least(1), default=512,
                   help="max_tokens when a request gives none")
    p.add_argument("--max-body", type=int_at_least(1), default=1 << 20, help="largest request body in bytes (then 413)")
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help="torch CPU threads (default: the cores other work leaves free, by the load average)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="the models' dtype; auto: bfloat16 on CUDA or a CPU with AMX/AVX512-BF16, else float32")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--num-nodes", type=int_or_auto(1, 256), default="auto",
                   help="tree nodes verified per round, root included (auto: this machine's timing from `poss tune` "
                        "/ --retune, else the draft's tree shipped for this CPU class and dtype)")
    p.add_argument("--depth", type=int_or_auto(0), default="auto", help="draft positions below the root")
    p.add_argument("--beam-width", "--top-k-draft", dest="beam_width", type=int_at_least(1), default=10,
                   help="draft candidates kept per tree level")
    p.add_argument("--lookup", type=int_or_auto(0), default="auto", help=LOOKUP_HELP)
    p.add_argument("--speculate-max-batch", type=int_or_auto(1, words=("auto", "off")), default="auto",
                   help="speculate only while at most this many requests are live; larger batches decode "
                        "plainly (auto: this machine's timing from --retune, else the draft's shipped default; "
                        "off: always speculate)")
    p.add_argument("--datastore", type=datastore_arg, default="auto", help=DATASTORE_HELP)
    p.add_argument("--draft-vocab", choices=DRAFT_VOCABS, default="trained", help=DRAFT_VOCAB_HELP)
    p.add_argument("--retune", action="store_true", help=RETUNE_HELP)
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level")
    return p


def model_name(target: str) -> str:
    path = Path(target)
    return path.stem if path.suffix == ".gguf" else path.name if path.exists() else target


def _check(args) -> None:
    """Every check that needs no model (the numeric flags are checked by their types)."""
    if args.draft and args.no_draft:
        raise UsageError("--draft and --no-draft exclude each other")
    check_target(args.target)
    check_draft(args.draft)


def run_serve(args) -> int:
    _check(args)
    import torch
    import uvicorn

    from poss.cli_args import chosen_draft
    from poss.decode.autotune import tree_label
    from poss.decode.loader import load
    from poss.decode.params import tree_from_flags
    from poss.serve.app import create_app
    from poss.serve.backend import ContinuousBackend
    from poss.serve.engine import Engine
    from poss.serve.metrics import Metrics

    draft = chosen_draft(args, "poss serve")
    try:
        gen = load(args.target, draft=draft, dtype=args.dtype, device=args.device, datastore=args.datastore,
                   draft_vocab=args.draft_vocab, threads=args.threads or "auto")
        flags = tree_from_flags(args.num_nodes, args.depth, args.beam_width, args.lookup)
        if args.retune:  # the tree sizes, then the batch limit of the tree served, within about a minute
            from poss.decode.autotune import MachineBusy, tune

            try:
                print(f"poss serve: {tune(gen, max_batch=args.max_batch, tree=None if flags == 'auto' else flags)}",
                      file=sys.stderr)
            except MachineBusy as exc:
                print(f"poss serve: --retune: {exc}", file=sys.stderr)
        tree = gen.resolve_tree(flags, beam_width=args.beam_width,
                                **({} if args.lookup == "auto" else {"lookup": args.lookup}))
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"poss serve: {exc}", file=sys.stderr)
        return 2
    name = args.served_model_name or model_name(args.target)
    limit = None if args.speculate_max_batch == "off" else args.speculate_max_batch
    try:
        backend = ContinuousBackend(gen, max_batch=args.max_batch, tree=tree, speculate_max_batch=limit)
    except ValueError as exc:
        print(f"poss serve: {exc}", file=sys.stderr)
        return 2
    engine = Engine(backend, max_queue=args.max_queue, metrics=Metrics(max_tau=max(tree.depth + tree.lookup + 1, 1)))
    info = {"target": str(args.target), "draft": str(draft) if draft else None, "context_limit": backend.context_limit,
            "max_batch": args.max_batch, "num_nodes": tree.num_nodes, "depth": tree.depth,
            "speculate_max_batch": backend.engine.speculate_max_batch if backend.speculative else 0}
    url = f"http://{args.host}:{args.port}/v1"

    def started():
        spec = info["speculate_max_batch"]
        spec = "never" if spec == 0 else "always" if spec is None else f"up to batch {spec}"
        auto = gen.auto_choice
        how = f", auto: {auto.source}" if auto is not None and auto.tree == tree else ""
        print(f"poss serve: {name} at {url} (draft: {draft or 'none'}, tree {tree_label(tree)}{how}, speculating "
              f"{spec}; max batch {args.max_batch}; {torch.get_num_threads()} threads); Ctrl-C stops",
              file=sys.stderr, flush=True)

    app = create_app(engine, name, default_max_tokens=args.default_max_tokens, max_body=args.max_body,
                     model_info=info, on_started=started)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5,
                            lifespan="on")
    server = uvicorn.Server(config)
    try:
        server.run()  # Ctrl-C / SIGTERM: uvicorn stops accepting, the lifespan stops the engine
    except KeyboardInterrupt:  # uvicorn re-raises the signal after its graceful shutdown
        pass
    print("poss serve: stopped", file=sys.stderr, flush=True)
    return 0 if server.started else 1
