"""``poss serve``: load the model once, then serve the OpenAI API with uvicorn until Ctrl-C."""

import argparse
import sys
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def add_serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and completions, streaming)")
    p.add_argument("--target", default="smollm2-135m", help="registry name, HF folder or .gguf file")
    p.add_argument("--draft", default=None, help="PosS draft folder (default: the shipped one for the target)")
    p.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding")
    p.add_argument("--served-model-name", default=None,
                   help="the `model` the API accepts (default: the target's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the batch (then 429)")
    p.add_argument("--default-max-tokens", type=int, default=512, help="max_tokens when a request gives none")
    p.add_argument("--max-body", type=int, default=1 << 20, help="largest request body in bytes (then 413)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-nodes", type=int, default=60)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--beam-width", "--top-k-draft", dest="beam_width", type=int, default=10,
                   help="draft candidates kept per tree level")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    return p


def model_name(target: str) -> str:
    path = Path(target)
    return path.stem if path.suffix == ".gguf" else path.name if path.exists() else target


def _check(args) -> str:
    for name in ("max_batch", "port", "default_max_tokens", "max_body"):
        if getattr(args, name) < (0 if name == "port" else 1):
            return f"--{name.replace('_', '-')} must be positive"
    if args.max_queue < 0:
        return "--max-queue must be >= 0"
    if args.threads is not None and args.threads < 1:
        return "--threads must be >= 1"
    if args.draft and args.no_draft:
        return "--draft and --no-draft exclude each other"
    return ""


def run_serve(args) -> int:
    err = _check(args)
    if err:
        print(f"poss serve: {err}", file=sys.stderr)
        return 2
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import uvicorn

    from poss.decode.loader import load
    from poss.decode.params import TreeParams
    from poss.models.registry import shipped_draft
    from poss.serve.app import create_app
    from poss.serve.backend import ContinuousBackend
    from poss.serve.engine import Engine
    from poss.serve.metrics import Metrics

    draft = None
    if not args.no_draft:
        draft = args.draft or shipped_draft(args.target)
        if draft is None:
            print(f"poss serve: no trained draft for target {args.target!r}; serving without one "
                  "(pass --draft DIR, or --no-draft to silence this)", file=sys.stderr)
    try:
        gen = load(args.target, draft=draft, dtype=getattr(torch, args.dtype), device=args.device)
        tree = TreeParams(num_nodes=args.num_nodes, depth=args.depth, beam_width=args.beam_width)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"poss serve: {exc}", file=sys.stderr)
        return 2
    name = args.served_model_name or model_name(args.target)
    backend = ContinuousBackend(gen, max_batch=args.max_batch, tree=tree)
    engine = Engine(backend, max_queue=args.max_queue, metrics=Metrics(max_tau=max(args.depth + 1, 1)))
    info = {"target": str(args.target), "draft": str(draft) if draft else None, "context_limit": backend.context_limit,
            "max_batch": args.max_batch, "num_nodes": args.num_nodes, "depth": args.depth}
    url = f"http://{args.host}:{args.port}/v1"

    def started():
        print(f"poss serve: {name} at {url} (draft: {draft or 'none'}; max batch {args.max_batch}); "
              "Ctrl-C stops", file=sys.stderr, flush=True)

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
