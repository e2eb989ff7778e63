"""Timing ``tree="auto"`` on this machine: time a few trees and batch sizes by greedy decoding on
MT-Bench prompts, fit the cost model (:mod:`poss.decode.cost_model`) to them, and cache the result on
disk.

:func:`calibrate` times the :data:`~poss.decode.cost_model.CALIBRATION` trees (three prompts, 64
tokens each per tree, interleaved; per-round costs are the lower quartile) and fits the acceptance;
:func:`refine` times the best few again on more and longer prompts (an answer's first tokens are
accepted less than the rest, so short runs cannot tell close trees apart), and also with prompt-lookup
chains that fill the tree to :func:`lookup_rows` rows, whose gain no draft accuracy predicts.
:func:`measure_batches` times tree rounds against plain ones at a few batch sizes
(:func:`~poss.decode.cost_model.batch_limit`: where speculation stops paying). Results are cached as
JSON under ``<poss cache>/autotune/``, keyed by the CPU, its GEMM kernel, threads, dtype, target,
draft and datastore fingerprints and whether the steps are compiled (:func:`cache_key`).

Timings taken while other work fills the cores are off: a measurement that starts on a busy machine
warns and records the load average with the result; :func:`forget` drops this machine's timings of a
generator.
"""

import hashlib
import json
import time
import warnings
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from poss.decode.cost_model import (
    CALIBRATION,
    CALIBRATION_BEAM,
    Calibration,
    batch_limit,
    chain_tokens,
    choose,
    fit_acceptance,
    score_table,
)
from poss.decode.engine import DecodeEngine, speculates
from poss.decode.params import TreeParams

REFINE_TOP, REFINE_PROMPTS, REFINE_TOKENS = 3, 4, 256  # trees timed again, on how many more prompts, how long
LOOKUP_TREES = 2  # the best trees refine also times with a chain (besides LOOKUP_ALWAYS)
# Timed with a chain whatever their plain rank: the chain adds most where the draft stops at depth 1,
# and a short first-stage run ranked 8/1 and 8/2 above 4/1, whose chain then won every sweep.
LOOKUP_ALWAYS = ((2, 1), (3, 1), (4, 1))
CACHE_VERSION = 12  # bump when what is measured or its kernels change: old cache files are then ignored


def draft_accuracy(draft) -> List[float]:
    """Per-position top-1 accuracy from the draft's validation (``training.val.acc``); 0.2 if absent."""
    training = getattr(draft.config, "training", None) or {}
    acc = (training.get("val") or {}).get("acc") if isinstance(training, dict) else None
    return [float(a) for a in acc] if acc else [0.2]


def cache_key(gen) -> Dict:
    import poss_ext
    from poss import hardware
    from poss.models.target import weight_fingerprint

    draft = gen.draft
    on_cpu = gen.runner.device.type == "cpu"
    return {"method": CACHE_VERSION,
            "cpu": hardware.cpu_model() if on_cpu else torch.cuda.get_device_name(),
            "linear": poss_ext.ops.cpu_linear_kernel(gen.runner.dtype) if on_cpu else "aten",
            "threads": torch.get_num_threads(), "dtype": str(gen.runner.dtype).replace("torch.", ""),
            "target": gen.runner.fingerprint(),
            "draft": weight_fingerprint(list(draft.named_parameters())) if draft is not None else None,
            "draft_vocab": draft.config.draft_vocab if draft is not None else None,  # 0: all rows (slower head)
            # the chains' worth depends on where they come from (poss.decode.datastore)
            "datastore": gen.datastore.fingerprint if gen.datastore is not None else None,
            # torch.compile'd steps (poss.load(compile=True)) cost differently from eager ones
            "compiled": gen.compiled,
            # GGUF blocks (dtype "gguf") stream a third of bf16's bytes: other timings (a float target's
            # key is left as it was, so its cached timings stay valid)
            **({"weights": gen.runner.weight_formats(), "qlinear": _qlinear_revision()}
               if getattr(gen.runner, "quantized", False) else {})}


def _qlinear_revision() -> str:
    """The qlinear kernel the blocks run (POSS_QLINEAR may force another) and its revision."""
    import poss_ext
    from poss.models.quant_weight import QLINEAR_REVISION, X_INT8

    return f"{poss_ext.ops.cpu_qlinear_kernel(X_INT8)}-r{QLINEAR_REVISION}"


def cache_dir():
    from poss.models.downloads import cache_root

    return cache_root() / "autotune"


def cache_path(key: Dict):
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"{digest}.json"


def forget(gen) -> int:
    """Remove every cached timing of ``gen`` (its calibration and its batch limits for any tree) on
    this machine, threads and dtype, so the next use measures again; returns how many files went."""
    key = cache_key(gen)
    gone = 0
    for path in cache_dir().glob("*.json"):
        try:
            stored = json.loads(path.read_text()).get("key", {})
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(stored, dict) and all(stored.get(k) == v for k, v in key.items()):
            path.unlink(missing_ok=True)
            gone += 1
    return gone


def warn_if_busy(what: str) -> Optional[float]:
    """Warn when other work kept every usable core busy on average before a timing starts (this
    process's own threads, e.g. a benchmark's earlier rows, do not count); returns the load average."""
    from poss import hardware

    load, cores = hardware.load_average(), hardware.usable_cores()
    if load is not None and hardware.others_load() >= cores:
        warnings.warn(f"{what}: the machine is busy (load average {load:.1f} on {cores} cores), so the timings "
                      "and the choice made from them may be off; they are cached: time again with `poss tune` "
                      "(poss.decode.autotune.tune) when the machine is quiet", RuntimeWarning, stacklevel=3)
    return load


def calibration_prompts(n: int) -> List[str]:
    from poss.data.eval_sets import load_eval_set

    return [r["turns"][0] for r in load_eval_set("mt_bench")[-n:]]  # the last ones: benchmarks use the first


def calibration_ids(gen, n: int) -> Optional[List[List[int]]]:
    """:func:`calibration_prompts` as ``gen``'s token ids, each cut to a quarter of its context (a small
    model's window may be shorter than a long MT-Bench turn); None without a tokenizer."""
    if gen.tokenizer is None:
        return None
    return [gen.encode(t)[: max(1, gen.context_limit // 4)] for t in calibration_prompts(n)]


def _low(xs: Sequence[float]) -> float:
    """The lower quartile: on a shared machine the uncontended cost, robust to one slow round."""
    xs = sorted(xs)
    return xs[len(xs) // 4]


def run_greedy(gen, prompts: Sequence, new_tokens: int, tree: TreeParams,
               profile: Optional[Dict[str, List[float]]] = None) -> List:
    """Greedy decoding of ``prompts`` (token ids or texts) as one batch on ``tree``, always
    speculating, every request running its full ``new_tokens`` (no end tokens), the rounds' phase
    seconds appended to ``profile``: each request's :class:`~poss.decode.engine.Stats`. The generator's
    own settings are not touched."""
    engine = DecodeEngine(gen, tree, speculate_max_batch=None, end_ids=(), profile=profile)
    ids = [engine.add(gen.encode(p), new_tokens) for p in prompts]
    stats = {}
    while engine.has_work():
        stats.update({ev.id: ev.stats for ev in engine.step() if ev.finished})
    return [stats[i] for i in ids]


def time_configs(gen, prompts: Sequence, new_tokens: int, configs,
                 deadline: Optional[float] = None) -> Tuple[Dict, Dict, Dict, int]:
    """Greedy generation (batch 1) of every ``(T, d)`` of ``configs`` on every prompt, interleaved per
    prompt (a load spike on a shared machine hits all of them alike); a config ``(T, d, K)`` adds a
    K-token lookup chain. Past ``deadline`` (a ``time.perf_counter()`` value) no further prompt starts,
    the first always runs. Returns the per-round seconds of everything but drafting by T, of drafting
    by (T, d) (both from the plain configs only), ``[tokens, rounds, draft tokens]`` by config, and how
    many prompts were timed."""
    from tqdm import tqdm

    verify: Dict[int, List[float]] = {}
    draft: Dict[Tuple[int, int], List[float]] = {}
    counts = {c: [0, 0, 0] for c in configs}  # tokens after the first, rounds, nodes past the roots
    # disable=None: a bar on a terminal only.
    bar = tqdm(total=len(prompts) * len(configs), desc="timing tree sizes", unit="config", leave=False,
               disable=None)
    timed = 0
    try:
        run_greedy(gen, [prompts[0]], 4, TreeParams(num_nodes=60, depth=6 if gen.draft else 0))  # warm-up
        for p in prompts:
            if timed and deadline is not None and time.perf_counter() > deadline:
                break
            timed += 1
            for c in configs:
                T, d, K = (*c, 0)[:3]
                bar.update()
                prof: Dict[str, List[float]] = {}
                stats = run_greedy(gen, [p], new_tokens, TreeParams(num_nodes=T, depth=d, beam_width=CALIBRATION_BEAM,
                                                                    lookup=K), prof)[0]
                counts[c][0] += stats.tokens - 1  # the prefill makes the first token
                counts[c][1] += stats.rounds
                counts[c][2] += stats.draft_tokens
                if K:
                    continue  # a chain's rows vary per round: the costs come from the plain trees
                phases = zip(*(prof.get(k, []) for k in ("verify", "commit", "host")))
                verify.setdefault(T, []).extend(sum(x) for x in phases)
                if d:
                    draft.setdefault((T, d), []).extend(prof["draft"])
    finally:
        bar.close()
    return verify, draft, counts, timed


def _fit(acc: Sequence[float], rounds: Sequence[Tuple[int, int, int, int]]):
    """The measured tau of each ``(T, d, tokens, rounds)`` and the acceptance model fitted to them:
    ``(taus, s, beta)``."""
    taus = [(T, d, n / max(r, 1)) for T, d, n, r in rounds]
    return (taus, *fit_acceptance(acc, taus, CALIBRATION_BEAM))


def measure(gen, prompts: Sequence, new_tokens: int = 32, configs=CALIBRATION,
            deadline: Optional[float] = None) -> Calibration:
    """Time every ``(T, d)`` of ``configs`` (:func:`time_configs`, no prompt started past ``deadline``)
    and fit the acceptance; each cost is the lower quartile of its per-round times. ``key["n_prompts"]``
    says how many prompts were timed."""
    configs = [(T, d) for T, d in configs if gen.draft is not None or not d]
    verify, draft, counts, timed = time_configs(gen, prompts, new_tokens, configs, deadline=deadline)
    rounds = [(T, d, n, r) for (T, d), (n, r, _) in counts.items() if d]
    acc = draft_accuracy(gen.draft) if gen.draft is not None else [0.0]
    taus, s, beta = _fit(acc, rounds)
    return Calibration({k: 1e3 * _low(v) for k, v in verify.items()},
                       [(T, d, 1e3 * _low(v)) for (T, d), v in draft.items()], acc, s, beta, taus, rounds,
                       key={"n_prompts": timed})


def lookup_rows(gen) -> int:
    """The rows a chained tree fills (tree + chain): 8 where a verify of 8 rows costs about one of 4
    (the AVX512-BF16 GEMM, a GPU), else 6 (the AVX2 GEMM takes up to 6 rows in one pass)."""
    import poss_ext

    if gen.runner.device.type != "cpu":
        return 8
    return 8 if poss_ext.ops.cpu_linear_kernel(gen.runner.dtype) == "avx512-bf16" else 6


def refine(gen, cal: Calibration, prompts: Sequence, new_tokens: int = REFINE_TOKENS,
           top: int = REFINE_TOP, rows: Optional[int] = None, deadline: Optional[float] = None) -> Calibration:
    """``cal`` with the tau of its ``top`` best speculative trees (by :func:`score_table`) pooled over
    ``prompts`` too: tokens and rounds add up, and the acceptance model is fitted again. The costs stay
    the first stage's (they vary less from prompt to prompt than tau does). The :data:`LOOKUP_TREES`
    best and the :data:`LOOKUP_ALWAYS` trees are also timed with a lookup chain that fills them to
    ``rows`` rows (:func:`chain_tokens`; None: :func:`lookup_rows`; 0: no chains), and each chain's tau
    ratio over its plain tree (same prompts) and rows per round are kept. No prompt starts past
    ``deadline``; ``key["n_more_prompts"]`` says how many were timed."""
    contenders = [(r["num_nodes"], r["depth"]) for r in score_table(cal) if r["depth"] and not r["lookup"]][:top]
    if gen.draft is None or not contenders or not prompts:
        return cal
    rows = lookup_rows(gen) if rows is None else rows
    chained = list(dict.fromkeys(contenders[:LOOKUP_TREES] + list(LOOKUP_ALWAYS))) if rows else []
    plain = list(dict.fromkeys(contenders + chained))
    chains = {(T, d): (T, d, chain_tokens(T, rows)) for T, d in chained}
    _, _, counts, n_timed = time_configs(gen, prompts, new_tokens, plain + list(chains.values()), deadline=deadline)
    pooled = {(T, d): [n, r] for T, d, n, r in cal.rounds}
    for c in plain:
        n, r, _ = counts[c]
        pooled.setdefault(c, [0, 0])
        pooled[c][0] += n
        pooled[c][1] += r
    rounds = [(T, d, n, r) for (T, d), (n, r) in pooled.items()]
    taus, s, beta = _fit(cal.acc, rounds)
    timed = []
    for (T, d), c in chains.items():
        (n0, r0, _), (n, r, nodes) = counts[(T, d)], counts[c]
        if n0 and r and r0:
            timed.append((*c, round((n / r) / (n0 / r0), 4), round(1 + nodes / r, 3)))
    return Calibration(cal.verify_ms, cal.draft_ms, cal.acc, s, beta, taus, rounds, timed,
                       {**cal.key, "n_more_prompts": n_timed})


def cached_calibration(gen) -> Optional[Calibration]:
    """This machine's cached calibration of ``gen`` (:func:`calibrate`), or None: never times."""
    path = cache_path(cache_key(gen))
    try:
        return Calibration.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def calibrate(gen, n_prompts: int = 3, new_tokens: int = 64, refresh: bool = False, cache: bool = True,
              prompts: Optional[Sequence] = None, more_prompts: Optional[Sequence] = None,
              n_more: int = REFINE_PROMPTS, more_tokens: int = REFINE_TOKENS,
              budget_s: Optional[float] = None) -> Calibration:
    """The calibration of ``gen``: the cached one, else timed now (and cached).

    ``prompts`` (token ids) are timed at every calibration tree for ``new_tokens`` tokens,
    ``more_prompts`` only at the best few, for ``more_tokens`` (:func:`refine`); by default the last
    ``n_prompts`` MT-Bench first turns and the ``n_more`` before them. Passing ``prompts`` alone skips
    the refinement. ``budget_s``: no prompt starts once the first stage has used half of it, or the
    refinement the rest (each stage times at least one prompt); None: every prompt."""
    key = cache_key(gen)
    path = cache_path(key)
    if cache and not refresh:
        cal = cached_calibration(gen)
        if cal is not None:
            return cal
    if prompts is None and gen.tokenizer is not None:
        texts = calibration_ids(gen, n_prompts + n_more)
        prompts, more_prompts = texts[len(texts) - n_prompts:], texts[:len(texts) - n_prompts]
    if not prompts:
        raise ValueError("calibration needs prompts (this generator has no tokenizer: pass token ids)")
    load = warn_if_busy("timing draft tree sizes")
    t = time.perf_counter()
    cal = measure(gen, prompts, new_tokens, deadline=None if budget_s is None else t + budget_s / 2)
    if more_prompts:
        cal = refine(gen, cal, more_prompts, more_tokens, deadline=None if budget_s is None else t + budget_s)
    cal.key = {**key, "seconds": round(time.perf_counter() - t, 1), "n_prompts": cal.key.get("n_prompts"),
               "n_more_prompts": cal.key.get("n_more_prompts", 0), "new_tokens": new_tokens,
               "more_tokens": more_tokens if more_prompts else 0, "budget_s": budget_s, "loadavg": load}
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cal.to_json(), indent=1))
    return cal


# -- batch size: where speculation stops paying -------------------------------------------------------
BATCHES = (2, 4, 8, 16)


def measure_batches(gen, tree: TreeParams, prompts: Sequence[Sequence[int]], batches: Sequence[int] = BATCHES,
                    new_tokens: int = 32, deadline: Optional[float] = None) -> Dict[int, Tuple[float, float]]:
    """Tokens/s of the decode rounds of ``B`` requests (greedy), the first ``B`` of ``prompts`` (reused
    in turn when there are fewer): ``{B: (root-only rounds, tree rounds)}``. A tree round's cost grows
    with ``B * num_nodes`` rows while a decode step's barely grows with ``B``, so on a CPU speculation
    loses from some batch size on.

    The requests must differ: copies of one prompt accept alike and find the same lookup chains, so no
    row of a round waits on another or pads its tree; with 4 copies of one prompt a 4/1+5 tree measured
    1.07x plain rounds, on 4 different prompts it ran 0.78x (AVX512-BF16 EPYC, one thread). Past
    ``deadline`` (a ``time.perf_counter()`` value) no further size starts; the first always runs."""
    from tqdm import tqdm

    out = {}
    for B in tqdm(batches, desc="timing batch sizes", unit="size", leave=False, disable=None):
        if out and deadline is not None and time.perf_counter() > deadline:
            break
        batch = [prompts[i % len(prompts)] for i in range(B)]
        rates = []
        for T, d, K in ((1, 0, 0), (tree.num_nodes, tree.depth, tree.lookup)):
            t = TreeParams(num_nodes=T, depth=d, beam_width=tree.beam_width, lookup=K)
            run_greedy(gen, batch, 2, t)  # warm-up
            prof: Dict[str, List[float]] = {}
            stats = run_greedy(gen, batch, new_tokens, t, prof)
            seconds = sum(sum(v) for v in prof.values())
            rates.append(sum(s.tokens - 1 for s in stats) / max(seconds, 1e-9))
        out[B] = (rates[0], rates[1])
    return out


def _batch_limit_path(gen, tree: TreeParams, max_batch: Optional[int]):
    """Where the batch limit of ``gen`` with ``tree`` up to ``max_batch`` is cached, and the sizes it times."""
    batches = sorted({b for b in BATCHES if max_batch is None or b < max_batch} | ({max_batch} - {None}))
    key = {**cache_key(gen), "batch_limit_for": [tree.num_nodes, tree.depth, tree.beam_width]
           + ([tree.lookup] if tree.lookup else []), "batches": batches}
    return cache_path(key), key, batches


def measure_speculation_limit(gen, tree: TreeParams, max_batch: Optional[int] = None,
                              deadline: Optional[float] = None) -> Optional[int]:
    """Time :func:`measure_batches` over the :data:`BATCHES` up to ``max_batch`` (and ``max_batch``
    itself), cache and return its :func:`~poss.decode.cost_model.batch_limit` (None: no limit). Sizes
    cut by ``deadline`` are not claimed: the limit is then at most the largest size timed."""
    if not speculates(gen.draft, tree) or max_batch == 1:
        return None
    path, key, batches = _batch_limit_path(gen, tree, max_batch)
    prompts = calibration_ids(gen, max(batches))
    if not prompts:
        raise ValueError("measuring the batch limit needs prompts (this generator has no tokenizer)")
    load = warn_if_busy("timing batch sizes")
    tok_s = measure_batches(gen, tree, prompts, batches, deadline=deadline)
    limit = batch_limit(tok_s)
    if limit is None and len(tok_s) < len(batches):
        limit = max(tok_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "tokens_per_s": {B: list(v) for B, v in tok_s.items()},
                                "limit": limit, "loadavg": load}, indent=1))
    return limit


def speculation_limit(gen, tree: TreeParams, max_batch: Optional[int] = None) -> Optional[int]:
    """The batch size above which rounds of ``tree`` stop speculating for ``gen`` (None: no limit):
    this machine's timing (:func:`measure_speculation_limit`, ``poss tune``) when there is one, else
    the draft's shipped default for this machine (:mod:`poss.decode.shipped_trees`). Never times."""
    if not speculates(gen.draft, tree) or max_batch == 1:
        return None
    path, _, _ = _batch_limit_path(gen, tree, max_batch)
    try:
        return json.loads(path.read_text())["limit"]
    except (OSError, ValueError, KeyError, TypeError):
        return _shipped(gen, tree.beam_width).speculate_max_batch


class AutoTree(NamedTuple):
    """The tree ``"auto"`` resolved to and where it came from (``timed on this machine``, ``shipped
    for <class>/<dtype>``, a fallback, or ``no draft``)."""

    tree: TreeParams
    source: str


def _shipped(gen, beam_width: int):
    from poss.decode.shipped_trees import shipped_tree

    return shipped_tree(getattr(gen, "draft_dir", None), gen.runner.device, gen.runner.dtype, beam_width)


def auto_tree(gen, beam_width: int = 10) -> AutoTree:
    """The tree for ``gen``: the one with the most expected tokens/s by this machine's cached timing
    (:func:`calibrate`), else the draft's shipped tree for this machine's class and dtype, else a
    fallback; root-only when there is no draft. Never times (:func:`tune` does)."""
    if gen.draft is None:
        return AutoTree(TreeParams(num_nodes=1, depth=0, beam_width=beam_width), "no draft")
    cal = cached_calibration(gen)
    if cal is not None:
        return AutoTree(choose(cal, beam_width), "timed on this machine")
    shipped = _shipped(gen, beam_width)
    return AutoTree(shipped.tree, shipped.source)


# -- timing on request -----------------------------------------------------------------------------
class MachineBusy(RuntimeError):
    """Other work holds the cores a timing would need: its figures would mislead the choice."""


def busy_reason(threads: int) -> Optional[str]:
    """Why timing at ``threads`` threads now would mislead (other work holds the cores it needs, by
    the 1-minute load average less this process's share), or None when the cores are free."""
    from poss import hardware

    cores, others = hardware.usable_cores(), hardware.others_load()
    if others > cores - threads + 0.5:
        return (f"the machine is busy: other work keeps {others:.1f} of its {cores} cores busy (1-minute load "
                f"average), and timing {threads} thread{'s' if threads > 1 else ''} needs them free")
    return None


TUNE_BUDGET_S = 60.0


def tune(gen, budget_s: float = TUNE_BUDGET_S, force: bool = False, max_batch: Optional[int] = None,
         tree: Optional[TreeParams] = None) -> str:
    """Time this machine for ``gen`` now, within about ``budget_s`` seconds (progress bars on a
    terminal), replace its cached timings, and return one line on what ``auto`` now picks.

    Times the tree sizes (:func:`calibrate`); with ``max_batch`` > 1 also the batch size where
    speculation stops paying, for ``tree`` (default: the tree just chosen), which gets a third of
    the budget. Raises :class:`MachineBusy` when other work holds the cores (:func:`busy_reason`)
    unless ``force``; nothing is then changed."""
    if budget_s <= 0:
        raise ValueError(f"budget_s must be > 0, got {budget_s}")
    reason = busy_reason(torch.get_num_threads())
    if reason is not None and not force:
        raise MachineBusy(reason + "; not timing (the cached or shipped choices stay)")
    if gen.draft is None:
        return "no draft: auto is plain decoding, nothing to time"
    start = time.perf_counter()
    batches = max_batch is not None and max_batch > 1
    forget(gen)
    cal = calibrate(gen, refresh=True, budget_s=budget_s * (2 / 3 if batches else 1))
    gen.forget_tuning()
    chosen = choose(cal)
    line = (f"tree {tree_label(chosen)} (timed {cal.key['n_prompts']} + {cal.key['n_more_prompts']} prompts "
            f"in {cal.key['seconds']:.0f} s")
    if batches:
        t = tree or chosen
        limit = measure_speculation_limit(gen, t, max_batch, deadline=start + budget_s)
        line += f"; speculating {'at any batch' if limit is None else f'up to batch {limit}'} with {tree_label(t)}"
    return line + ")"


def tree_label(tree: TreeParams) -> str:
    """``N/D`` or ``N/D+K`` (the form :func:`poss.decode.params.tree_spec` reads)."""
    return f"{tree.num_nodes}/{tree.depth}" + (f"+{tree.lookup}" if tree.lookup else "")
