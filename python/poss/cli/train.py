"""``poss train``: train one draft (EAGLE-2, HASS, PosS-n or EAGLE-3), or score one with ``--validate``."""

import json
import sys
from pathlib import Path

from poss.cli.args import (
    Formatter,
    UsageError,
    add_device,
    add_dtype,
    add_target,
    add_threads,
    check_draft,
    check_target,
    float_in,
    int_at_least,
    layer_indices,
    position_counts,
    set_threads,
)


def add_parser(sub):
    p = sub.add_parser("train", help="train an EAGLE-2 / HASS / PosS-n / EAGLE-3 draft for a target",
                       formatter_class=Formatter)
    add_target(p)
    p.add_argument("--method", choices=("eagle2", "hass", "poss", "eagle3"), default="poss",
                   help="the draft objective; eagle3: one EAGLE-3 layer over three target layers, trained with "
                        "EAGLE-3's training-time test")
    p.add_argument("--steps", "--ttt-steps", type=int_at_least(1), default=None,
                   help="training steps (draft positions; EAGLE-3's training-time-test steps); eagle2 1, hass 3, "
                        "poss 6, eagle3 7")
    p.add_argument("--draft-features", choices=("last", "eagle3"), default=None,
                   help="what the draft reads: the target's final-norm feature (last; EAGLE-2, HASS, PosS) or "
                        "three target layers fused by fc, EAGLE-3's layer and its own head (eagle3; implied by "
                        "--method eagle3; with --method poss: PosS specialists on EAGLE-3 features)")
    p.add_argument("--feature-layers", type=layer_indices, default=None, metavar="I,J,K",
                   help="with EAGLE-3 features: the target hidden-state indices fused (i = the input of decoder "
                        "layer i); default EAGLE-3's 2, L/2, L-3")
    p.add_argument("--positions-per-specialist", type=int_at_least(1), default=1,
                   help="PosS-n: n positions per specialist")
    p.add_argument("--out", default=None, help="run directory: checkpoints, metrics.jsonl, final draft/")
    p.add_argument("--init-from", default=None, nargs="+", metavar="DRAFT",
                   help="trained single-layer draft copied into every specialist; with two folders, specialist 0 "
                        "starts from the first (e.g. EAGLE-2) and the later ones from the second (e.g. HASS)")
    p.add_argument("--specialists", type=position_counts, default=None, metavar="N1,N2,...",
                   help="depth-aware layout (--method poss): positions each specialist drafts, e.g. 1,5 = one "
                        "specialist for position 1 and one for positions 2-6 (overrides --positions-per-specialist)")
    p.add_argument("--fc-per-specialist", action="store_true",
                   help="give each specialist its own fusion layer fc (default: one shared fc, as the PosS reference)")
    p.add_argument("--position-weights", default=None, metavar="SPEC",
                   help="loss weight per drafted position: uniform (the paper; the default), eagle3 (0.8^k; the "
                        "default with EAGLE-3 features), reach:a1,a2,... (products of measured pos-acc), or one "
                        "weight per step")
    p.add_argument("--resume", action="store_true", help="continue from OUT/trainer_state.pt")
    p.add_argument("--max-len", type=int_at_least(2), default=1024, help="tokens per conversation at most")
    p.add_argument("--train-size", type=int_at_least(1), default=1000, help="training conversations")
    p.add_argument("--train-start", type=int_at_least(0), default=0,
                   help="with --data: skip this many training answers (key order), e.g. to train on what an "
                        "extended data set added")
    p.add_argument("--val-size", type=int_at_least(0), default=100,
                   help="held-out conversations (fixed by --data-seed)")
    p.add_argument("--data-seed", type=int, default=42, help="seed of the train/validation split")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="train on a `poss distill` folder (on-policy answers with cached features) instead of ShareGPT")
    p.add_argument("--draft-vocab", type=int_at_least(0), default=0, metavar="K",
                   help="reduced draft vocabulary: the K most frequent answer tokens (0: the full vocabulary)")
    p.add_argument("--regenerate", action="store_true", help="use the target's greedy answers as assistant turns")
    p.add_argument("--regen-max-new-tokens", type=int_at_least(1), default=256,
                   help="answer length at most with --regenerate")
    p.add_argument("--epochs", type=int_at_least(1), default=1, help="passes over the training set")
    p.add_argument("--batch-size", type=int_at_least(1), default=1, help="conversations per optimizer step")
    p.add_argument("--lr", type=float_in(0, low_open=True), default=3e-5, help="peak learning rate")
    p.add_argument("--topk-weight", type=float_in(0), default=0.0, help="HASS top-K loss weight (K=10)")
    p.add_argument("--feature-weight", type=float_in(0), default=1.0,
                   help="SmoothL1 feature-regression weight (EAGLE/HASS/PosS: 1.0; EAGLE-3 drops it: 0)")
    p.add_argument("--token-weight", type=float_in(0, low_open=True), default=None,
                   help="soft cross-entropy weight against the target's distribution (EAGLE/HASS/PosS: 0.1; "
                        "with EAGLE-3 features, their only loss: 1.0)")
    p.add_argument("--noise-std", type=float_in(0), default=0.2, help="feature noise during training")
    p.add_argument("--checkpoint-minutes", type=float_in(0, low_open=True), default=10.0,
                   help="minutes between checkpoints")
    p.add_argument("--features", choices=("online", "cache"), default="cache",
                   help="target features computed every batch, or cached as fp16 shards (reused across epochs/methods)")
    p.add_argument("--feature-cache", default=None, help="feature cache dir (default: under the poss cache)")
    p.add_argument("--max-batches", type=int_at_least(1), default=None, help="stop after this many optimizer steps")
    p.add_argument("--validate-every-epoch", action="store_true",
                   help="score the held-out split after each epoch (learning curve) and keep the best draft in "
                        "OUT/best")
    add_device(p, None, " (default: cuda when available)")
    add_dtype(p, "train")
    add_threads(p)
    p.add_argument("--seed", type=int, default=0, help="initialisation and noise seed")
    p.add_argument("--validate", default=None, metavar="DRAFT",
                   help="no training: score the draft folder DRAFT on this data's validation split for --steps "
                        "draft positions (default 6) and print the per-step metrics as JSON")
    return p


def _prepare(args):
    """Target runner and dataset shared by training and --validate."""
    import torch

    from poss.models.registry import load_model
    from poss.models.target import TargetRunner
    from poss.train.dataset import DataRecipe, build_dataset, distilled_dataset
    from poss.train.ddp import init_distributed
    from poss.train.draft_vocab import answer_vocabulary

    set_threads(args)
    if args.device is None:  # resolved here, not in the parser, so ``poss --help`` needs no torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    info = init_distributed(args.device)
    device = f"cuda:{info.local_rank}" if args.device.startswith("cuda") else args.device
    from poss.hardware import resolve_dtype

    dtype = resolve_dtype(args.dtype, device, training=True)
    tokenizer, hf = load_model(args.target, dtype=dtype, device=device)
    runner = TargetRunner(hf, max_batch=args.batch_size, max_seq=args.max_len, dtype=dtype)
    if args.data:
        data = distilled_dataset(args.data, runner.fingerprint(), args.max_len, args.train_size, args.val_size,
                                 args.train_start)
    else:
        recipe = DataRecipe(max_len=args.max_len, train_size=args.train_size, val_size=args.val_size,
                            data_seed=args.data_seed, regenerate=args.regenerate,
                            regen_max_new_tokens=args.regen_max_new_tokens)
        data = build_dataset(tokenizer, hf, runner.fingerprint(), recipe, cache_features=args.features == "cache",
                             feature_cache=args.feature_cache, main=info.main)
    token_map = None
    if args.draft_vocab:
        from poss.decode.stopping import end_token_ids

        token_map = answer_vocabulary(data.train, args.draft_vocab, hf.config.vocab_size,
                                      end_token_ids(tokenizer, getattr(hf, "generation_config", None)))
    return info, runner, data, token_map


def check_train_arguments(args) -> None:
    """Every check that needs no model or data: raises ``UsageError`` naming the flag."""
    if args.validate is None and args.out is None:
        raise UsageError("--out DIR is required (the run directory), unless --validate DRAFT is given")
    if args.validate is not None and not (Path(args.validate) / "config.json").is_file():
        raise UsageError(f"--validate expects a draft folder with config.json, got {args.validate!r}")
    check_target(args.target)
    if args.init_from is not None and len(args.init_from) > 2:
        raise UsageError(f"--init-from takes one or two draft folders, got {len(args.init_from)}")
    for folder in args.init_from or []:
        check_draft(folder, "--init-from")
    if args.specialists is not None and args.method != "poss":
        raise UsageError(f"--specialists needs --method poss, not {args.method}")
    if args.fc_per_specialist and args.method != "poss":
        raise UsageError(f"--fc-per-specialist needs --method poss, not {args.method}")
    eagle3 = args.method == "eagle3" or args.draft_features == "eagle3"
    if args.draft_features == "eagle3" and args.method not in ("eagle3", "poss"):
        raise UsageError(f"--draft-features eagle3 needs --method eagle3 or poss, not {args.method}")
    if args.method == "eagle3" and args.draft_features == "last":
        raise UsageError("--method eagle3 reads EAGLE-3 features: drop --draft-features last")
    if args.feature_layers is not None and not eagle3:
        raise UsageError("--feature-layers needs EAGLE-3 features (--method eagle3 or --draft-features eagle3)")
    if args.fc_per_specialist and eagle3:
        raise UsageError("--fc-per-specialist: EAGLE-3 features are fused by one fc")
    from poss.train.loop import DEFAULT_STEPS
    from poss.train.objective import position_weights

    try:
        position_weights(args.position_weights or ("eagle3" if eagle3 else "uniform"),
                         args.steps or DEFAULT_STEPS[args.method])
    except ValueError as e:
        raise UsageError(f"--position-weights: {e}") from None
    if args.data is not None and not Path(args.data).is_dir():
        raise UsageError(f"--data: {args.data!r} is not a folder (expected a `poss distill` output folder)")
    if args.train_start and args.data is None:
        raise UsageError("--train-start needs --data (a `poss distill` folder)")
    if args.validate is None and args.feature_weight == 0 and (args.method == "eagle2" or (args.steps or 2) < 2):
        # Without the feature loss a one-step draft's output features are never trained as the next
        # position's input, so every draft position after the first would run on untrained inputs.
        raise UsageError("--feature-weight 0 needs a multi-step objective (--method hass or poss, --steps >= 2)")


def run(args) -> int:
    from poss.train.ddp import shutdown
    from poss.train.loop import TrainConfig, Trainer
    from poss.train.validate import draft_autocast, validate_draft

    check_train_arguments(args)
    info, runner, data, token_map = _prepare(args)
    if args.validate is not None:
        result = validate_draft(args.validate, runner, data.val, steps=args.steps or 6,
                                feature_cache=data.feature_cache, batch_size=args.batch_size, info=info)
        if info.main:
            print(json.dumps(result, indent=1))
        shutdown(info)
        return 0
    cfg = TrainConfig(method=args.method, steps=args.steps, positions_per_specialist=args.positions_per_specialist,
                      specialists=args.specialists, fc_per_specialist=args.fc_per_specialist,
                      position_weights=args.position_weights,
                      epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, topk_weight=args.topk_weight,
                      v_weight=args.feature_weight, p_weight=args.token_weight,
                      noise_std=args.noise_std, checkpoint_minutes=args.checkpoint_minutes, seed=args.seed,
                      max_batches=args.max_batches, validate_every_epoch=args.validate_every_epoch,
                      autocast=draft_autocast(runner.dtype), draft_features=args.draft_features,
                      feature_layers=args.feature_layers)
    feature_cache = data.feature_cache
    if args.features == "online" and cfg.draft_features == "eagle3":
        # A distill folder's cache holds final-norm features only: EAGLE-3 features would fill a second cache
        # (about 4 * H * 2 bytes a token) unless asked to run the target every batch.
        feature_cache = None
    trainer = Trainer(runner, cfg, data.train, data.val, args.out,
                      target_name=args.target if isinstance(args.target, str) else "", init_from=args.init_from,
                      feature_cache=feature_cache, info=info, data_info=data.info, token_map=token_map,
                      train_ids=data.train_ids)
    if args.resume and trainer.resume() and info.main:
        print(f"resumed at step {trainer.progress['step']} (epoch {trainer.progress['epoch']})", file=sys.stderr)
    result = trainer.fit()
    if info.main:
        print(json.dumps(result, indent=1))
    shutdown(info)
    return 0

