"""``poss serve``: load the model once, then serve the OpenAI API with uvicorn until Ctrl-C."""

import sys
from pathlib import Path

from poss.cli.args import (
    Formatter,
    add_device,
    add_draft,
    add_dtype,
    add_speculate_max_batch,
    add_target,
    add_threads,
    add_tree,
    check_model,
    int_at_least,
    set_threads,
    tree_from_args,
)


def add_parser(sub):
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and completions, streaming)",
                       formatter_class=Formatter)
    add_target(p)
    add_draft(p)
    p.add_argument("--served-model-name", default=None,
                   help="the `model` the API accepts (default: the target's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int_at_least(0, 65535), default=8000, help="TCP port (0: any free one)")
    p.add_argument("--max-batch", type=int_at_least(1), default=8, help="requests decoded together")
    p.add_argument("--max-queue", type=int_at_least(0), default=64, help="requests waiting beyond the batch (then 429)")
    p.add_argument("--default-max-tokens", type=int_at_least(1), default=512,
                   help="max_tokens when a request gives none")
    p.add_argument("--max-body", type=int_at_least(1), default=1 << 20, help="largest request body in bytes (then 413)")
    add_threads(p)
    add_dtype(p, "run")
    add_device(p, "cpu")
    add_speculate_max_batch(p, "requests")
    add_tree(p)  # auto: this machine's `poss tune` timing, else the draft's shipped tree
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level")
    return p


def model_name(target: str) -> str:
    path = Path(target)
    return path.stem if path.suffix == ".gguf" else path.name if path.exists() else target


def run(args) -> int:
    check_model(args)  # the numeric flags are checked by their types
    set_threads(args)
    import torch
    import uvicorn

    from poss.cli.args import chosen_draft
    from poss.decode.autotune import tree_label
    from poss.decode.loader import load
    from poss.serve.app import create_app
    from poss.serve.backend import ContinuousBackend
    from poss.serve.engine import Engine
    from poss.serve.metrics import Metrics

    tree = tree_from_args(args)  # a tree over the kernel's limits is refused before loading
    draft = chosen_draft(args, "poss serve")
    try:
        gen = load(args.target, draft=draft, dtype=args.dtype, device=args.device, datastore=args.datastore,
                   draft_vocab=args.draft_vocab, threads=args.threads or "auto")
        if args.retune:  # the tree sizes, then the batch limit of the tree served, within about a minute
            from poss.decode.autotune import MachineBusy, tune

            try:
                print(f"poss serve: {tune(gen, max_batch=args.max_batch, tree=None if tree == 'auto' else tree)}",
                      file=sys.stderr)
            except MachineBusy as exc:
                print(f"poss serve: --retune: {exc}", file=sys.stderr)
        tree = gen.resolve_tree(tree, beam_width=args.beam_width,
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
