"""The training loop behind ``poss train``: data, target features, the multi-step objective, AdamW with a
linear warmup/decay schedule, value clipping, periodic resumable checkpoints, validation and the final save.
"""

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import torch

from poss.hardware import describe as describe_machine
from poss.models.draft import PosSDraft
from poss.models.draft_config import DRAFT_FEATURES, DraftConfig
from poss.models.target import TargetRunner, check_feature_layers, eagle3_feature_layers
from poss.train import checkpoint as ckpt
from poss.train.data import Example, collate, data_fingerprint
from poss.train.ddp import DistInfo, average_gradients, broadcast_parameters
from poss.train.features import VAL_ID_OFFSET, make_features
from poss.train.objective import Objective, make_batch, position_weights, run_steps
from poss.train.validate import evaluate

METHODS = ("eagle2", "hass", "poss", "eagle3")
DEFAULT_STEPS = {"eagle2": 1, "hass": 3, "poss": 6, "eagle3": 7}  # eagle3: the paper's training-time test


@dataclass
class TrainConfig:
    method: str = "poss"
    steps: Optional[int] = None  # default: eagle2 1, hass 3, poss 6
    positions_per_specialist: int = 1
    # A depth-aware layout: how many positions each specialist drafts (e.g. [1, 5]); overrides
    # positions_per_specialist. The last specialist also drafts every deeper position.
    specialists: Optional[List[int]] = None
    fc_per_specialist: bool = False  # each specialist its own fc (the PosS reference ties one)
    # See poss.train.objective.position_weights; None: eagle3 (0.8^k) with EAGLE-3 features, else uniform.
    position_weights: Optional[str] = None
    epochs: int = 1
    batch_size: int = 1
    lr: float = 3e-5
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 0.01
    warmup_frac: float = 0.01
    clip_value: float = 0.5
    noise_std: float = 0.2
    v_weight: float = 1.0
    p_weight: Optional[float] = None  # None: 1.0 with EAGLE-3 features (their only loss), else 0.1
    topk_weight: float = 0.0
    autocast: str = "bf16"  # bf16 | none
    checkpoint_minutes: float = 10.0
    seed: int = 0
    max_batches: Optional[int] = None  # stop after this many optimizer steps (throughput probes, tests)
    # Validate after every epoch and keep the best draft (mean held-out accuracy over the steps) in
    # OUT/best: the loss can keep falling while acceptance drops.
    validate_every_epoch: bool = False
    # What the draft reads (DraftConfig.features): "last" or "eagle3" (method eagle3 implies it), and
    # for "eagle3" the target's hidden-state indices (None: EAGLE-3's default for the target).
    draft_features: Optional[str] = None
    feature_layers: Optional[List[int]] = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.draft_features is None:
            self.draft_features = "eagle3" if self.method == "eagle3" else "last"
        if self.draft_features not in DRAFT_FEATURES:
            raise ValueError(f"draft_features must be one of {DRAFT_FEATURES}, got {self.draft_features!r}")
        if self.draft_features == "eagle3" and self.method not in ("eagle3", "poss"):
            raise ValueError(f"EAGLE-3 features train with method 'eagle3' (one layer) or 'poss' (specialists), "
                             f"not {self.method!r}")
        if self.method == "eagle3" and self.draft_features != "eagle3":
            raise ValueError("method 'eagle3' reads EAGLE-3 features (draft_features 'eagle3')")
        if self.feature_layers is not None:
            if self.draft_features != "eagle3":
                raise ValueError("feature_layers needs EAGLE-3 features (draft_features 'eagle3')")
            self.feature_layers = [int(i) for i in self.feature_layers]
        if self.position_weights is None:
            self.position_weights = "eagle3" if self.draft_features == "eagle3" else "uniform"
        if self.p_weight is None:
            self.p_weight = 1.0 if self.draft_features == "eagle3" else 0.1
        if self.steps is None:
            self.steps = DEFAULT_STEPS[self.method]
        if self.method == "eagle2" and self.steps != 1:
            raise ValueError("eagle2 trains exactly one teacher-forced step (steps=1)")
        if self.steps < 1 or self.positions_per_specialist < 1:
            raise ValueError("steps and positions_per_specialist must be >= 1")
        if self.specialists is not None:
            self.specialists = list(self.specialists)
            if self.method != "poss":
                raise ValueError(f"specialists (a specialist schedule) needs method 'poss', not {self.method!r}")
            if not self.specialists or any(not isinstance(n, int) or n < 1 for n in self.specialists):
                raise ValueError(f"specialists must be positive position counts, got {self.specialists!r}")
            if sum(self.specialists[:-1]) >= self.steps:
                raise ValueError(f"specialists {self.specialists}: the last specialist starts at position "
                                 f"{sum(self.specialists[:-1]) + 1}, past the {self.steps} trained steps")
        if self.fc_per_specialist and (self.method != "poss" or self.draft_features == "eagle3"):
            raise ValueError("fc_per_specialist needs method 'poss' on final-norm features (a single-layer draft "
                             "has one fc; EAGLE-3 features are fused once per round)")
        position_weights(self.position_weights, self.steps)  # raises on a malformed value
        self.betas = tuple(self.betas)

    @property
    def n_specialists(self) -> int:
        if self.method != "poss":
            return 1
        if self.specialists is not None:
            return len(self.specialists)
        return math.ceil(self.steps / self.positions_per_specialist)

    @property
    def draft_positions_per_specialist(self) -> int:
        """What the draft's config records: a single-layer draft drafts every position with layer 0."""
        return self.positions_per_specialist if self.method == "poss" else self.steps

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        return torch.bfloat16 if self.autocast == "bf16" else None

    def target_layers(self, num_layers: int) -> Optional[List[int]]:
        """The target hidden-state indices an EAGLE-3-feature draft reads (None for final-norm features)."""
        if self.draft_features != "eagle3":
            return None
        return list(check_feature_layers(self.feature_layers or eagle3_feature_layers(num_layers), num_layers))

    def objective(self) -> Objective:
        return Objective(self.steps, self.v_weight, self.p_weight, self.topk_weight,
                         position_weights=position_weights(self.position_weights, self.steps))


InitFrom = Union[None, str, Sequence[str]]


def init_sources(init_from: InitFrom) -> List[str]:
    """``--init-from`` as a list of draft folders: none, one (every specialist), or two (specialist 0 from
    the first, e.g. a trained EAGLE-2 draft; the later specialists from the second, e.g. HASS)."""
    if not init_from:
        return []
    srcs = [init_from] if isinstance(init_from, (str, Path)) else [str(s) for s in init_from]
    if len(srcs) > 2:
        raise ValueError(f"init_from takes one or two draft folders, got {len(srcs)}")
    return [str(s) for s in srcs]


def new_draft(runner: TargetRunner, cfg: TrainConfig, target_name: str, init_from: InitFrom = None,
              seed: int = 0, token_map: Optional[torch.Tensor] = None) -> PosSDraft:
    """A fresh draft shaped like the target; ``init_from`` copies trained single-layer drafts into the
    specialists (:func:`init_sources`).

    ``token_map [K] int64``: a reduced draft vocabulary (an ``init_from`` draft brings its own, which wins).
    """
    srcs = [PosSDraft.load(p) for p in init_sources(init_from)]
    if srcs and srcs[0].token_map is not None:
        token_map = srcs[0].token_map
    layers = cfg.target_layers(len(runner.layers))
    dc = DraftConfig.for_target(runner.config, target_name, runner.fingerprint(), n_specialists=cfg.n_specialists,
                                positions_per_specialist=cfg.draft_positions_per_specialist,
                                fc_bias=cfg.draft_features != "eagle3",  # EAGLE-3's fc has no bias
                                draft_vocab=0 if token_map is None else int(token_map.numel()),
                                schedule=list(cfg.specialists or []), fc_per_specialist=cfg.fc_per_specialist,
                                features=cfg.draft_features, feature_layers=list(layers or []))
    torch.manual_seed(seed)
    if not srcs:
        draft = PosSDraft(dc)
        if token_map is not None:
            draft.token_map.copy_(token_map)
        if draft.eagle3:
            # The draft's own head starts as the target's final norm and lm_head rows (its vocabulary's).
            with torch.no_grad():
                draft.norm.copy_(runner.final_norm_w.float())
                draft.lm_head.weight.copy_(
                    runner.lm_head.float().cpu().index_select(0, torch.arange(dc.vocab) if token_map is None
                                                              else token_map.cpu().long()))
        return draft
    paths = init_sources(init_from)
    for path, src in zip(paths, srcs):
        src.config.check_target(dc.target_fingerprint, what=path)
        if src.config.features != dc.features or src.config.n_feature_layers != dc.n_feature_layers:
            raise ValueError(f"init_from {path}: a draft on {src.config.features!r} features cannot start one on "
                             f"{dc.features!r} features")
    return PosSDraft.from_layers(init_layers(paths, srcs, dc), dc)


def init_layers(paths: List[str], srcs: List[PosSDraft], dc: DraftConfig) -> List[Dict[str, torch.Tensor]]:
    """One single-layer state dict (``fc.*``, ``layers.0.*``, ``token_map``) per specialist of ``dc``.

    A source with the same layout continues: specialist j from its specialist j (its own or shared fc).
    A single-layer source (EAGLE-2 / HASS) starts every specialist; with two sources, specialist 0 takes
    the first and the others the second. Any other pairing would drop trained specialists: refused."""
    def layer_of(src: PosSDraft, j: int) -> Dict[str, torch.Tensor]:
        sd = src.state_dict()
        fc = f"fcs.{j}." if src.config.fc_per_specialist else "fc."
        out = {"fc." + k[len(fc):]: v for k, v in sd.items() if k.startswith(fc)}
        out.update({"layers.0." + k[len(f"layers.{j}."):]: v for k, v in sd.items() if k.startswith(f"layers.{j}.")})
        for k in ("token_map", "norm", "lm_head.weight"):  # the last two: an EAGLE-3 draft's own head
            if k in sd:
                out[k] = sd[k]
        return out

    n = dc.n_specialists
    if len(srcs) == 1 and srcs[0].config.n_specialists == n > 1:
        c = srcs[0].config
        if [c.specialist_for(p) for p in range(1, 17)] != [dc.specialist_for(p) for p in range(1, 17)]:
            raise ValueError(f"init_from {paths[0]}: its {n} specialists draft other positions than this run's "
                             f"(schedule {c.schedule or c.positions_per_specialist} vs "
                             f"{dc.schedule or dc.positions_per_specialist})")
        return [layer_of(srcs[0], j) for j in range(n)]
    for path, src in zip(paths, srcs):
        if src.config.n_specialists != 1:
            raise ValueError(f"init_from {path}: a draft of {src.config.n_specialists} specialists can only "
                             f"continue a run of the same layout, not start one of {n}")
    return [layer_of(srcs[0], 0)] + [layer_of(srcs[-1], 0)] * (n - 1)


def init_record(init_from: InitFrom) -> Optional[Dict]:
    """The ``--init-from`` draft(s) as a trained draft's config records them: one level each (folder as
    given, weights fingerprint, method, epochs, token-passes so far, held-out acc@1), never the source's
    own lineage, so a model card can say where training started without nesting every earlier round."""
    from poss.train.draft_card import init_summary_record

    recs = [init_summary_record(p) for p in init_sources(init_from)]
    if not recs:
        return None
    return recs[0] if len(recs) == 1 else {"path": [r["path"] for r in recs], "sources": recs}


def linear_schedule(optimizer, total: int, warmup: int):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, f)


def _step_summary(metrics: List[Dict[str, torch.Tensor]]) -> Dict[str, List[float]]:
    # One device->host copy for all steps' (loss, correct, count), not three per step.
    rows = torch.stack([torch.stack([m["loss"].float(), m["correct"].float(), m["count"].float()])
                        for m in metrics]).tolist()
    return {"loss": [r[0] for r in rows], "acc": [r[1] / max(1.0, r[2]) for r in rows]}


class Trainer:
    """Trains one draft. ``train_examples`` / ``val_examples`` come from :mod:`poss.train.data` (or tests).

    Args:
        runner: the bf16 (or fp32) target runner; its ``max_batch``/``max_seq`` bound the batches.
        out_dir: checkpoints (``trainer_state.pt``), ``metrics.jsonl`` and the final ``draft/``.
        feature_cache: directory for the fp16 feature cache, or None for purely online features.
        train_ids: the feature-cache keys of the train examples (default: their positions); val
            example i has key ``VAL_ID_OFFSET + i``.
    """

    def __init__(self, runner: TargetRunner, cfg: TrainConfig, train_examples: List[Example],
                 val_examples: List[Example], out_dir, target_name: str = "", init_from: InitFrom = None,
                 feature_cache: Optional[str] = None,
                 info: DistInfo = DistInfo(), data_info: Optional[dict] = None, progress_bar: bool = True,
                 token_map: Optional[torch.Tensor] = None, train_ids: Optional[Sequence[int]] = None):
        self.runner, self.cfg, self.info = runner, cfg, info
        self.train, self.val = train_examples, val_examples
        self.train_ids = list(range(len(train_examples))) if train_ids is None else list(train_ids)
        if len(self.train_ids) != len(train_examples):
            raise ValueError(f"train_ids has {len(self.train_ids)} keys for {len(train_examples)} train examples")
        self.out = Path(out_dir)
        self.progress_bar = progress_bar and info.main
        # EAGLE-3 features: the runner returns the target layers the draft fuses in every forward.
        runner.set_feature_layers(cfg.target_layers(len(runner.layers)))
        self.features = make_features(runner, feature_cache, info.rank)
        self.draft = new_draft(runner, cfg, target_name, init_from, cfg.seed, token_map).to(runner.device)
        self.init_record = init_record(init_from)
        broadcast_parameters(self.draft, info)
        self.params = [p for p in self.draft.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.global_batch = cfg.batch_size * info.world
        self.batches_per_epoch = len(train_examples) // self.global_batch
        if self.batches_per_epoch < 1:
            raise ValueError(f"{len(train_examples)} training examples cannot fill one global batch of "
                             f"{self.global_batch}")
        self.total_steps = self.batches_per_epoch * cfg.epochs
        self.sched = linear_schedule(self.opt, self.total_steps, max(1, int(self.total_steps * cfg.warmup_frac)))
        self.data_info = dict(data_info or {})
        self.data_info.setdefault("train_fingerprint", data_fingerprint(train_examples))
        # The run's identity travels in the checkpoint so --resume refuses a mismatched run.
        self.progress = {"epoch": 0, "batch": 0, "step": 0, "tokens": 0, "seconds": 0.0, **self.identity()}
        self._last_val = (None, None)  # (step, metrics) of the latest epoch validation
        self.data_info.setdefault("val_fingerprint", data_fingerprint(val_examples))
        self.data_info.update(n_train=len(train_examples), n_val=len(val_examples))

    # -- state -------------------------------------------------------------------------------------
    def identity(self) -> Dict:
        """What a resumed run must share with the checkpoint: the data and method, and what fixes the
        example order (seed, global batch) and the learning-rate schedule (epochs, lr, warmup)."""
        cfg = self.cfg
        return {"train_fingerprint": self.data_info["train_fingerprint"], "method": cfg.method, "steps": cfg.steps,
                "positions_per_specialist": cfg.positions_per_specialist, "specialists": cfg.specialists,
                "fc_per_specialist": cfg.fc_per_specialist, "position_weights": cfg.position_weights, "seed": cfg.seed,
                "draft_features": cfg.draft_features, "feature_layers": cfg.target_layers(len(self.runner.layers)),
                "global_batch": self.global_batch, "epochs": cfg.epochs, "lr": cfg.lr, "warmup_frac": cfg.warmup_frac}

    def resume(self) -> bool:
        def same_run(got):
            # A checkpoint written before a key was checked carries no value for it.
            diff = [f"{k} {got[k]!r} (now {v!r})" for k, v in self.identity().items() if k in got and got[k] != v]
            if diff:
                raise ValueError(f"{self.out} holds a checkpoint of another run: {', '.join(diff)}; "
                                 f"use a new --out or the original settings")

        got = ckpt.load_state(self.out, self.draft, self.opt, self.sched, check=same_run)
        if got is None:
            return False
        self.progress.update(got)
        return True

    def save_checkpoint(self) -> None:
        if hasattr(self.features, "cache"):
            self.features.cache.flush()  # a resumed run then recomputes no features
        if self.info.main:
            ckpt.save_state(self.out, self.draft, self.opt, self.sched, self.progress)

    def order(self, epoch: int) -> List[int]:
        g = torch.Generator().manual_seed(self.cfg.seed * 1000 + epoch)
        return torch.randperm(len(self.train), generator=g).tolist()

    # -- one optimizer step ------------------------------------------------------------------------
    def compute_gradients(self, idx: Sequence[int], noise: bool = True) -> List[Dict[str, torch.Tensor]]:
        """Forward + per-step backward on this rank's examples ``idx``; gradients are left in ``.grad``."""
        b = collate([self.train[i] for i in idx])
        f = self.features(b["input_ids"], b["lengths"], [self.train_ids[i] for i in idx])
        dev = f.device
        batch = make_batch(b["input_ids"].to(dev), b["loss_mask"].to(dev), b["lengths"], f, self.runner.lm_head,
                           self.cfg.noise_std if noise else 0.0, token_map=self.draft.token_map,
                           next_token=b["next_token"])
        return run_steps(self.draft, batch, self.runner.embed, self.runner.lm_head, self.runner.inv_freq,
                         self.cfg.objective(), backward=True, autocast_dtype=self.cfg.autocast_dtype)

    def optimizer_step(self) -> None:
        average_gradients(self.params, self.info)
        torch.nn.utils.clip_grad_value_(self.params, self.cfg.clip_value)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    # -- the loop ----------------------------------------------------------------------------------
    def fit(self) -> Dict:
        from tqdm import tqdm

        cfg, info = self.cfg, self.info
        self.out.mkdir(parents=True, exist_ok=True)
        log = open(self.out / "metrics.jsonl", "a") if info.main else None
        bar = tqdm(total=self.total_steps, initial=self.progress["step"], disable=not self.progress_bar,
                   dynamic_ncols=True, desc=f"{cfg.method} S={cfg.steps}")
        last_ckpt = time.monotonic()
        started = time.monotonic() - self.progress["seconds"]
        ema_loss, ema_acc = None, None
        stop = False
        while self.progress["epoch"] < cfg.epochs and not stop:
            order = self.order(self.progress["epoch"])
            while self.progress["batch"] < self.batches_per_epoch:
                at = self.progress["batch"] * self.global_batch + info.rank * cfg.batch_size
                idx = order[at:at + cfg.batch_size]
                metrics = self.compute_gradients(idx)
                self.optimizer_step()
                s = _step_summary(metrics)
                loss = sum(s["loss"]) / len(s["loss"])
                ema_loss = loss if ema_loss is None else 0.95 * ema_loss + 0.05 * loss
                ema_acc = s["acc"] if ema_acc is None else [0.95 * a + 0.05 * b for a, b in zip(ema_acc, s["acc"])]
                ntok = sum(len(self.train[i].input_ids) for i in idx) * info.world
                self.progress.update(batch=self.progress["batch"] + 1, step=self.progress["step"] + 1,
                                     tokens=self.progress["tokens"] + ntok, seconds=time.monotonic() - started)
                bar.update(1)
                bar.set_postfix_str(f"loss {ema_loss:.3f} acc " + "/".join(f"{a:.2f}" for a in ema_acc) +
                                    f" tok/s {self.progress['tokens'] / max(1e-9, self.progress['seconds']):.0f}")
                if log and self.progress["step"] % 10 == 0:
                    log.write(json.dumps({"step": self.progress["step"], "epoch": self.progress["epoch"],
                                          "loss": loss, "acc": s["acc"], "lr": self.sched.get_last_lr()[0],
                                          "tokens": self.progress["tokens"],
                                          "seconds": self.progress["seconds"]}) + "\n")
                    log.flush()
                if time.monotonic() - last_ckpt >= cfg.checkpoint_minutes * 60:
                    self.save_checkpoint()
                    last_ckpt = time.monotonic()
                if cfg.max_batches is not None and self.progress["step"] >= cfg.max_batches:
                    stop = True
                    break
            # An epoch that ran to its end is validated and checkpointed even when --max-batches stopped
            # the run on its last batch, so OUT/best covers it.
            if self.progress["batch"] >= self.batches_per_epoch:
                self.progress.update(epoch=self.progress["epoch"] + 1, batch=0)
                if cfg.validate_every_epoch:
                    self.validate_epoch(log)
                self.save_checkpoint()
                last_ckpt = time.monotonic()
            elif stop:
                self.save_checkpoint()
        bar.close()
        if hasattr(self.features, "cache"):
            self.features.cache.flush()
        result = {"progress": dict(self.progress), "finished": self.progress["epoch"] >= cfg.epochs}
        if result["finished"]:
            # The last epoch's validation scored these very weights when it ran at this step: reuse it (a
            # second pass took PosS-2 on the coder 15 minutes on one core).
            step, last = self._last_val
            if step == self.progress["step"]:
                result["val"] = last
            else:
                val_ids = [VAL_ID_OFFSET + i for i in range(len(self.val))]
                result["val"] = evaluate(self.draft, self.features, self.val, val_ids, cfg.objective(),
                                         self.runner, cfg.batch_size, cfg.autocast_dtype, info)
            if hasattr(self.features, "cache"):
                self.features.cache.flush()
            self.save_final(result)
        if log:
            log.write(json.dumps({"final": result}) + "\n")
            log.close()
        return result

    def validate_epoch(self, log) -> Dict:
        """Held-out metrics after an epoch, logged as a learning-curve point; a new best is saved to OUT/best."""
        val_ids = [VAL_ID_OFFSET + i for i in range(len(self.val))]
        v = evaluate(self.draft, self.features, self.val, val_ids, self.cfg.objective(), self.runner,
                     self.cfg.batch_size, self.cfg.autocast_dtype, self.info)
        score = sum(v["acc"]) / len(v["acc"])
        point = {"epoch": self.progress["epoch"], "tokens": self.progress["tokens"],
                 "seconds": self.progress["seconds"], "val": v}
        self._last_val = (self.progress["step"], v)
        if log:
            log.write(json.dumps({"val_epoch": point}) + "\n")
            log.flush()
        if score > self.progress.get("best_score", -1.0):
            self.progress["best_score"], self.progress["best_epoch"] = score, self.progress["epoch"]
            if self.info.main:
                self._save_draft(self.out / "best", {"val": v, "epoch": self.progress["epoch"]})
        return v

    def training_record(self, extra: Dict) -> Dict:
        """What a saved draft's config records under ``training``: recipe, data, where it started from
        (``init_from``: the ``--init-from`` folder and that draft's own record, or None), the machine, time and
        token-passes, and ``extra``."""
        return {"recipe": {**asdict(self.cfg), "n_specialists": self.cfg.n_specialists}, "data": self.data_info,
                "init_from": self.init_record, "machine": describe_machine(self.runner.dtype),
                "world_size": self.info.world, "train_seconds": self.progress["seconds"],
                "tokens": self.progress["tokens"], **extra}

    def _save_draft(self, directory: Path, extra: Dict) -> None:
        """The fp16 draft (what ships) with the recipe, data record and ``extra`` in its config."""
        self.draft.config.training = self.training_record(extra)
        half = PosSDraft(self.draft.config)
        half.load_state_dict(self.draft.state_dict())
        half.half().save(directory)

    def save_final(self, result: Dict) -> Optional[Path]:
        if not self.info.main:
            return None
        self.draft.config.training = self.training_record({"val": result.get("val")})
        d = self.out / "draft"
        self.draft.save(d)
        # The shippable copy: fp16 weights (half the size; drafts run in the target's half dtype anyway).
        half = PosSDraft(self.draft.config)
        half.load_state_dict(self.draft.state_dict())
        half.half().save(self.out / "draft-fp16")
        return d
