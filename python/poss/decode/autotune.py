"""Tree size by measurement: pick ``(num_nodes, depth)`` that maximises expected tokens per second on
this machine, dtype, target and draft.

A round costs ``draft(d) + verify(T)`` (``verify`` here is everything of a round that is not
drafting: the target's tree forward, ``tree_verify``, commit and host bookkeeping) and yields, in
expectation, ``E(T, d)`` tokens. The model (kept simple on purpose):

    w      = min(beam_width, (T - 1) / d)              nodes per level when T - 1 nodes share d levels
    a_i(w) = 1 - (1 - min(1, s * p_i)) ** (w ** beta)  the chance that level i holds the target's token
                                                       given that its parent did; p_i is the draft's
                                                       top-1 accuracy at position i
    E(T,d) = 1 + sum_{k<=d} prod_{i<=k} a_i(w)         the bonus token plus the expected accepted length

``p_i`` comes from the draft's validation (``config.json`` ``training.val.acc``, one value per trained
position, the last one repeated deeper). ``s`` (how much easier the prompts are than the validation
set) and ``beta`` (how much a second, third... sibling adds: 0 = nothing, 1 = as much as an
independent guess) are fitted to the tau measured in the calibration rounds; without those rounds
``s = 1, beta = 0.5``. A tree that was itself timed (the same size, depth and beam) is scored with
its measured tau instead: two parameters cannot follow every size (at 2 threads the fit put 2/1 at 1.41
tokens a round against 1.35 measured, and would have picked it over 4/1). The choice includes the
root-only tree (T = 1, d = 0: plain autoregressive
decoding), which wins when the draft is too weak or the machine makes a tree forward too expensive.

Prompt lookup (:mod:`poss.decode.lookup`) is a third choice, ``K`` tokens copied from the context
into each round's tree, the rows a chain leaves unused filled with the draft's next-best first-level
tokens. Its gain depends on how much the text repeats, which no draft accuracy predicts, so
:func:`refine` measures it: the two best trees and 2/1, 3/1 and 4/1, each with and without a chain
that fills the tree to :func:`lookup_rows` rows (8 where the GEMM takes them at about one pass's
cost, else 6), on the same prompts. A chained tree is scored with its plain tree's tau times the
measured ratio, at the verify cost of its rows. With SmolLM2-135M on one AVX512-BF16 core the
chained depth-1 trees ran 1.2-1.3x the best plain tree (6/2) on the MT-Bench benchmark and were
faster on all six eval sets (benchmarks.md, eval.md). A 9-row verify cost 0.9 ms more than an
8-row one there, hence 8. The chains are timed as the generator makes them, from its datastore
(:mod:`poss.decode.datastore`) where the context holds no match, and the cache keys on it.

Costs are timed once (:func:`calibrate`) by greedy generation with the generator's own profile on
MT-Bench prompts (by default three prompts, 64 tokens each per config, interleaved; lower quartile per
round: the fitted acceptance needs text, since one prompt's first 32 tokens gave the shipped PosS-2 a
tau of 1.72 at 60/6, three prompts x 64 tokens 1.93, and the benchmark's 16 prompts x 256 tokens 2.74)
at T in :data:`SIZES` and d in 1..6. Then :func:`refine` times the :data:`REFINE_TOP` best speculative
trees again on :data:`REFINE_PROMPTS` more prompts of :data:`REFINE_TOKENS` tokens and pools their tau:
an answer's first 64 tokens are accepted less than the rest, and less so the deeper the tree, so short
runs cannot tell close trees apart. On the last 9 MT-Bench prompts the shipped PosS-2 had tau 1.48 at
4/1 and 1.56 at 4/2 over 64 tokens, 1.62 and 1.78 over 256; over 64 tokens `auto` picked 4/1, which the
benchmark's 16 prompts x 256 tokens then ran 5 % slower than 4/2. All of it is cached as JSON under
``<poss cache>/autotune/`` keyed by CPU model, threads, dtype, target and draft fingerprints and
whether the steps are compiled. Sizes 2, 6 and 12 are there because a CPU's cost is not linear in T:
the AVX2 GEMM takes up to 6 rows in one pass over the weights, so a 6-node forward cost 1.2x a 4-node
one and a 7-node one 1.7x (bf16, 2 threads); the AVX512-BF16 one takes up to 12.

Drafting costs ``first + (d - 1) * level(K) + catch_up(d)``: the first level (one row, whatever the
tree), each further level over a beam of ``K = min(beam_width, T - 1)`` nodes (:mod:`draft_tree`
drafts no wider than the tree), and the specialists' catch-up forwards past level 2.
:func:`draft_model` reads the three from the timed configs: ``level(K)`` from depth-2 trees of 3, 5,
7 and 10 nodes a level (at 2 threads a level over 3 nodes cost 1.5 ms, over 7 nodes 2.8 ms), and
``catch_up(d)`` from the deeper, widest trees.

Timings taken while other work fills the cores are off (on a 2-core machine, under a test run and a
compiler, a 4-node verify timed 1.4x a decode step; alone, the ratio is what the tree choice rests
on). A measurement that starts on a busy machine warns, records the load average with the result,
and :func:`forget` (``poss generate --retune``) drops the cached timings so the next use measures
again.
"""

import hashlib
import json
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from poss.decode.params import TreeParams

SIZES = (1, 2, 4, 6, 8, 12, 16, 32, 60)
DEPTHS = (1, 2, 3, 4, 5, 6)
# Calibration configs (T, d): every size and depth timed at least once, depth 2 at every beam width
# (T - 1 = 3, 5, 7 and the full 10) and the catch-ups at the full width.
CALIBRATION = ((1, 0), (2, 1), (4, 1), (4, 2), (6, 2), (8, 2), (12, 3), (16, 2), (16, 3), (32, 4), (60, 5), (60, 6))
CALIBRATION_BEAM = 10
REFINE_TOP, REFINE_PROMPTS, REFINE_TOKENS = 3, 4, 256  # trees timed again, on how many more prompts, how long
LOOKUP_TREES = 2  # the best trees refine also times with a chain (besides LOOKUP_ALWAYS)
# Timed with a chain whatever their plain rank: the chain adds most where the draft stops at depth 1,
# and a short first-stage run ranked 8/1 and 8/2 above 4/1, whose chain then won every sweep.
LOOKUP_ALWAYS = ((2, 1), (3, 1), (4, 1))
LOOKUP_MIN_TOKENS = 2  # the chain of a tree as tall as the row budget or taller
DEFAULT_S, DEFAULT_BETA = 1.0, 0.5
CACHE_VERSION = 12  # bump when what is measured or its kernels change: old cache files are then ignored


@dataclass
class Calibration:
    """Measured per-round milliseconds and the fitted acceptance model."""

    verify_ms: Dict[int, float]  # num_nodes -> ms per round for everything but drafting
    draft_ms: List[Tuple[int, int, float]]  # (T, d, ms per round of drafting) as timed (beam 10)
    acc: List[float]  # the draft's per-position top-1 accuracy p_i
    s: float = DEFAULT_S
    beta: float = DEFAULT_BETA
    measured_tau: List[Tuple[int, int, float]] = field(default_factory=list)  # (T, d, tau)
    rounds: List[Tuple[int, int, int, int]] = field(default_factory=list)  # (T, d, tokens, rounds) behind tau
    # (T, d, K, tau with a K-token lookup chain / tau of the plain T/d tree on the same prompts, rows per round)
    lookup: List[Tuple[int, int, int, float, float]] = field(default_factory=list)
    key: Dict = field(default_factory=dict)

    def to_json(self) -> Dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Dict) -> "Calibration":
        d = dict(d)
        d["verify_ms"] = {int(k): v for k, v in d["verify_ms"].items()}
        d["draft_ms"] = [tuple(x) for x in d["draft_ms"]]
        d["measured_tau"] = [tuple(x) for x in d.get("measured_tau", [])]
        d["rounds"] = [tuple(x) for x in d.get("rounds", [])]
        d["lookup"] = [tuple(x) for x in d.get("lookup", [])]
        return cls(**d)


# -- the model ---------------------------------------------------------------------------------------
def level_width(num_nodes: int, depth: int, beam_width: int) -> float:
    return min(float(beam_width), (num_nodes - 1) / depth) if depth else 0.0


def expected_tokens(acc: Sequence[float], num_nodes: int, depth: int, beam_width: int = 10,
                    s: float = DEFAULT_S, beta: float = DEFAULT_BETA) -> float:
    """``E(T, d)``: expected tokens per round (1 for the root-only tree)."""
    d = min(depth, num_nodes - 1)
    if d <= 0:
        return 1.0
    w = level_width(num_nodes, d, beam_width)
    e, chain = 1.0, 1.0
    for i in range(d):
        p = min(1.0, s * (acc[i] if i < len(acc) else acc[-1]))
        chain *= 1.0 - (1.0 - p) ** (w ** beta)
        e += chain
    return e


def interpolate(table: Dict[int, float], x: int) -> float:
    """Piecewise-linear in ``x`` over the measured points (flat beyond them)."""
    xs = sorted(table)
    if x <= xs[0]:
        return table[xs[0]]
    if x >= xs[-1]:
        return table[xs[-1]]
    for lo, hi in zip(xs, xs[1:]):
        if lo <= x <= hi:
            return table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)
    raise AssertionError


def beam(num_nodes: int, beam_width: int) -> int:
    """The beam :func:`poss.decode.draft_tree.draft_tree` drafts levels 2 and deeper over."""
    return max(1, min(beam_width, num_nodes - 1))


def draft_model(timed: Sequence[Tuple[int, int, float]]) -> Tuple[float, Dict[int, float], Dict[int, float]]:
    """``(first, level, catch_up)`` from drafting times ``(T, d, ms)`` taken at beam
    :data:`CALIBRATION_BEAM`: the first level's ms, ms per further level by beam width (from depth-2
    trees; from any deeper one where none was timed), and the ms past ``first + (d - 1) * level`` of
    the widest trees by depth (0 at depths 1 and 2)."""
    first = min((ms for T, d, ms in timed if d == 1), default=0.0)
    level: Dict[int, float] = {}
    for T, d, ms in sorted(timed, key=lambda x: -x[1]):  # depth 2 last: it overrides the deeper ones
        if d >= 2:
            level[beam(T, CALIBRATION_BEAM)] = max(0.0, (ms - first) / (d - 1))
    catch_up = {1: 0.0, 2: 0.0}
    if level:
        widest = max(level)
        for T, d, ms in timed:
            if d >= 3 and beam(T, CALIBRATION_BEAM) == widest:
                catch_up[d] = max(0.0, ms - first - (d - 1) * level[widest])
    return first, level, catch_up


def draft_ms(cal: Calibration, num_nodes: int, depth: int, beam_width: int = CALIBRATION_BEAM) -> float:
    """Expected ms of drafting ``depth`` levels for a ``num_nodes`` tree (0 at depth 0)."""
    if depth <= 0:
        return 0.0
    first, level, catch_up = draft_model(cal.draft_ms)
    if depth == 1 or not level:
        return first
    return first + (depth - 1) * interpolate(level, beam(num_nodes, beam_width)) + interpolate(catch_up, depth)


def round_ms(cal: Calibration, num_nodes: int, depth: int, beam_width: int = CALIBRATION_BEAM) -> float:
    return interpolate(cal.verify_ms, num_nodes) + draft_ms(cal, num_nodes, depth, beam_width)


def candidates(sizes=SIZES, depths=DEPTHS) -> List[Tuple[int, int]]:
    out = [(1, 0)]
    for T in sizes:
        out += [(T, d) for d in depths if 1 <= d <= T - 1]
    return out


def score_table(cal: Calibration, beam_width: int = 10, sizes=SIZES, depths=DEPTHS) -> List[Dict]:
    """Every candidate ``(T, d)`` and every timed tree with its tokens per round (``measured``: the
    calibration's tau, else the fitted model's), ms per round and tokens/s, and each timed lookup chain
    on its tree (``lookup`` = K, 0 for none), best first (ties: the smaller tree, then no chain)."""
    timed = {(T, d): tau for T, d, tau in cal.measured_tau}
    rows, plain = [], {}
    for T, d in dict.fromkeys(candidates(sizes, depths) + list(timed)):  # a timed tree is a candidate too
        measured = (T, d) in timed and beam(T, beam_width) == beam(T, CALIBRATION_BEAM)
        e = timed[(T, d)] if measured else expected_tokens(cal.acc, T, d, beam_width, cal.s, cal.beta)
        ms = round_ms(cal, T, d, beam_width)
        plain[(T, d)] = e
        rows.append({"num_nodes": T, "depth": d, "lookup": 0, "tokens_per_round": e, "measured": measured,
                     "ms_per_round": ms, "tokens_per_s": 1e3 * e / ms})
    for T, d, K, ratio, per_round in cal.lookup:
        if (T, d) not in plain or beam(T, beam_width) != beam(T, CALIBRATION_BEAM):
            continue  # timed at another beam width: its ratio does not carry over
        e = plain[(T, d)] * ratio
        ms = interpolate(cal.verify_ms, per_round) + draft_ms(cal, T, d, beam_width)
        rows.append({"num_nodes": T, "depth": d, "lookup": K, "tokens_per_round": e, "measured": True,
                     "ms_per_round": ms, "tokens_per_s": 1e3 * e / ms})
    rows.sort(key=lambda r: (-r["tokens_per_s"], r["num_nodes"], r["depth"], r["lookup"]))
    return rows


def choose(cal: Calibration, beam_width: int = 10, sizes=SIZES, depths=DEPTHS) -> TreeParams:
    """The ``TreeParams`` with the highest expected tokens/s (ties: the smaller tree)."""
    best = score_table(cal, beam_width, sizes, depths)[0]
    return TreeParams(num_nodes=best["num_nodes"], depth=best["depth"], beam_width=beam_width,
                      lookup=best["lookup"])


def fit_acceptance(acc: Sequence[float], measured: Sequence[Tuple[int, int, float]],
                   beam_width: int = 10) -> Tuple[float, float]:
    """``(s, beta)`` minimising the squared error of ``E(T, d)`` against the measured tau (grid search)."""
    pts = [(T, d, tau) for T, d, tau in measured if d >= 1 and T > 1]
    if not pts:
        return DEFAULT_S, DEFAULT_BETA
    best = None
    for s in [0.25 + 0.05 * i for i in range(76)]:  # 0.25 .. 4.0
        for beta in [0.05 * i for i in range(21)]:  # 0 .. 1
            err = sum((expected_tokens(acc, T, d, beam_width, s, beta) - tau) ** 2 for T, d, tau in pts)
            if best is None or err < best[0] - 1e-12:
                best = (err, s, beta)
    return round(best[1], 4), round(best[2], 4)


# -- the measurement ---------------------------------------------------------------------------------
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
            **({"weights": gen.runner.weight_formats()} if getattr(gen.runner, "quantized", False) else {})}


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


def load_average() -> Optional[float]:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def own_load() -> float:
    """About how much of the 1-minute load average is this process's own threads: its CPU seconds over
    its age, the age counted as at least a minute (the average's time constant). 0 where the OS does
    not say (no /proc)."""
    try:
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (ImportError, OSError, ValueError, IndexError):
        return 0.0
    return (usage.ru_utime + usage.ru_stime) / max(age, 60.0)


def warn_if_busy(what: str) -> Optional[float]:
    """Warn when other work kept every core busy on average before a timing starts (this process's own
    threads, e.g. a benchmark's earlier rows, do not count); returns the load average."""
    load, cores = load_average(), os.cpu_count() or 1
    if load is not None and load - own_load() >= cores:
        warnings.warn(f"{what}: the machine is busy (load average {load:.1f} on {cores} cores), so the timings "
                      "and the choice made from them may be off; they are cached: rerun with --retune "
                      "(poss.load(..., retune=True)) when the machine is quiet", RuntimeWarning, stacklevel=3)
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


def time_configs(gen, prompts: Sequence, new_tokens: int, configs) -> Tuple[Dict, Dict, Dict]:
    """Greedy generation (batch 1) of every ``(T, d)`` of ``configs`` on every prompt, interleaved per
    prompt (a load spike on a shared machine hits all of them alike); a config ``(T, d, K)`` adds a
    K-token lookup chain. Returns the per-round seconds of everything but drafting by T, of drafting by
    (T, d) (both from the plain configs only), and ``[tokens, rounds, draft tokens]`` by config."""
    from tqdm import tqdm

    verify: Dict[int, List[float]] = {}
    draft: Dict[Tuple[int, int], List[float]] = {}
    counts = {c: [0, 0, 0] for c in configs}  # tokens after the first, rounds, nodes past the roots
    saved_end, saved_profile = gen.end_ids, gen.profile
    gen.end_ids = set()  # every request runs its full length
    # disable=None: a bar on a terminal only (the first `poss generate` on a machine waits here).
    bar = tqdm(total=len(prompts) * len(configs), desc="timing tree sizes (once per machine)", unit="config",
               leave=False, disable=None)
    try:
        gen.generate([prompts[0]], 4, num_nodes=60, depth=6 if gen.draft else 0)  # warm-up
        for p in prompts:
            for c in configs:
                T, d, K = (*c, 0)[:3]
                bar.update()
                gen.profile = {}
                res = gen.generate([p], new_tokens, num_nodes=T, depth=d, beam_width=CALIBRATION_BEAM, lookup=K)
                counts[c][0] += res.stats[0].tokens - 1  # the prefill makes the first token
                counts[c][1] += res.stats[0].rounds
                counts[c][2] += res.stats[0].draft_tokens
                if K:
                    continue  # a chain's rows vary per round: the costs come from the plain trees
                prof = gen.profile
                phases = zip(*(prof.get(k, []) for k in ("verify", "commit", "host")))
                verify.setdefault(T, []).extend(sum(x) for x in phases)
                if d:
                    draft.setdefault((T, d), []).extend(prof["draft"])
    finally:
        bar.close()
        gen.end_ids, gen.profile = saved_end, saved_profile
    return verify, draft, counts


def _fit(acc: Sequence[float], rounds: Sequence[Tuple[int, int, int, int]]):
    """The measured tau of each ``(T, d, tokens, rounds)`` and the acceptance model fitted to them:
    ``(taus, s, beta)``."""
    taus = [(T, d, n / max(r, 1)) for T, d, n, r in rounds]
    return (taus, *fit_acceptance(acc, taus, CALIBRATION_BEAM))


def measure(gen, prompts: Sequence, new_tokens: int = 32, configs=CALIBRATION) -> Calibration:
    """Time every ``(T, d)`` of ``configs`` (:func:`time_configs`) and fit the acceptance; each cost is
    the lower quartile of its per-round times."""
    configs = [(T, d) for T, d in configs if gen.draft is not None or not d]
    verify, draft, counts = time_configs(gen, prompts, new_tokens, configs)
    rounds = [(T, d, n, r) for (T, d), (n, r, _) in counts.items() if d]
    acc = draft_accuracy(gen.draft) if gen.draft is not None else [0.0]
    taus, s, beta = _fit(acc, rounds)
    return Calibration({k: 1e3 * _low(v) for k, v in verify.items()},
                       [(T, d, 1e3 * _low(v)) for (T, d), v in draft.items()], acc, s, beta, taus, rounds)


def lookup_rows(gen) -> int:
    """The rows a chained tree fills (tree + chain): 8 where a verify of 8 rows costs about one of 4
    (the AVX512-BF16 GEMM, a GPU), else 6 (the AVX2 GEMM takes up to 6 rows in one pass)."""
    import poss_ext

    if gen.runner.device.type != "cpu":
        return 8
    return 8 if poss_ext.ops.cpu_linear_kernel(gen.runner.dtype) == "avx512-bf16" else 6


def chain_tokens(num_nodes: int, rows: int) -> int:
    """The chain that fills a ``num_nodes`` tree to ``rows`` rows (at least :data:`LOOKUP_MIN_TOKENS`)."""
    return max(LOOKUP_MIN_TOKENS, rows - num_nodes)


def refine(gen, cal: Calibration, prompts: Sequence, new_tokens: int = REFINE_TOKENS,
           top: int = REFINE_TOP, rows: Optional[int] = None) -> Calibration:
    """``cal`` with the tau of its ``top`` best speculative trees (by :func:`score_table`) pooled over
    ``prompts`` too: tokens and rounds add up, and the acceptance model is fitted again. The costs stay
    the first stage's (they vary less from prompt to prompt than tau does). The :data:`LOOKUP_TREES`
    best and the :data:`LOOKUP_ALWAYS` trees are also timed with a lookup chain that fills them to
    ``rows`` rows (:func:`chain_tokens`; None: :func:`lookup_rows`; 0: no chains), and each chain's tau
    ratio over its plain tree (same prompts) and rows per round are kept."""
    contenders = [(r["num_nodes"], r["depth"]) for r in score_table(cal) if r["depth"] and not r["lookup"]][:top]
    if gen.draft is None or not contenders or not prompts:
        return cal
    rows = lookup_rows(gen) if rows is None else rows
    chained = list(dict.fromkeys(contenders[:LOOKUP_TREES] + list(LOOKUP_ALWAYS))) if rows else []
    plain = list(dict.fromkeys(contenders + chained))
    chains = {(T, d): (T, d, chain_tokens(T, rows)) for T, d in chained}
    _, _, counts = time_configs(gen, prompts, new_tokens, plain + list(chains.values()))
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
    return Calibration(cal.verify_ms, cal.draft_ms, cal.acc, s, beta, taus, rounds, timed, cal.key)


def calibrate(gen, n_prompts: int = 3, new_tokens: int = 64, refresh: bool = False, cache: bool = True,
              prompts: Optional[Sequence] = None, more_prompts: Optional[Sequence] = None,
              n_more: int = REFINE_PROMPTS, more_tokens: int = REFINE_TOKENS) -> Calibration:
    """The cached calibration of ``gen`` (measured on first use: tens of seconds on a small CPU model).

    ``prompts`` (token ids) are timed at every calibration tree for ``new_tokens`` tokens,
    ``more_prompts`` only at the best few, for ``more_tokens`` (:func:`refine`); by default the last
    ``n_prompts`` MT-Bench first turns and the ``n_more`` before them. Passing ``prompts`` alone skips
    the refinement."""
    key = cache_key(gen)
    path = cache_path(key)
    if cache and not refresh and path.exists():
        try:
            return Calibration.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            pass
    if prompts is None and gen.tokenizer is not None:
        texts = calibration_ids(gen, n_prompts + n_more)
        prompts, more_prompts = texts[len(texts) - n_prompts:], texts[:len(texts) - n_prompts]
    if not prompts:
        raise ValueError("calibration needs prompts (this generator has no tokenizer: pass token ids)")
    load = warn_if_busy("timing draft tree sizes")
    t = time.perf_counter()
    cal = measure(gen, prompts, new_tokens)
    if more_prompts:
        cal = refine(gen, cal, more_prompts, more_tokens)
    cal.key = {**key, "seconds": round(time.perf_counter() - t, 1), "n_prompts": len(prompts),
               "n_more_prompts": len(more_prompts or []), "new_tokens": new_tokens,
               "more_tokens": more_tokens if more_prompts else 0, "loadavg": load}
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cal.to_json(), indent=1))
    return cal


# -- batch size: where speculation stops paying -------------------------------------------------------
BATCHES = (2, 4, 8, 16)


def measure_batches(gen, tree: TreeParams, prompts: Sequence[Sequence[int]], batches: Sequence[int] = BATCHES,
                    new_tokens: int = 32) -> Dict[int, Tuple[float, float]]:
    """Tokens/s of the decode rounds of ``B`` requests (greedy), the first ``B`` of ``prompts`` (reused
    in turn when there are fewer): ``{B: (root-only rounds, tree rounds)}``. A tree round's cost grows
    with ``B * num_nodes`` rows while a decode step's barely grows with ``B``, so on a CPU speculation
    loses from some batch size on.

    The requests must differ: copies of one prompt accept alike and find the same lookup chains, so no
    row of a round waits on another or pads its tree; with 4 copies of one prompt a 4/1+5 tree measured
    1.07x plain rounds, on 4 different prompts it ran 0.78x (AVX512-BF16 EPYC, one thread)."""
    saved_end, saved_profile, saved_limit = gen.end_ids, gen.profile, gen.speculate_max_batch
    gen.end_ids, gen.speculate_max_batch = set(), None  # time the tree rounds even where they lose
    out = {}
    try:
        for B in batches:
            batch = [prompts[i % len(prompts)] for i in range(B)]
            rates = []
            for T, d, K in ((1, 0, 0), (tree.num_nodes, tree.depth, tree.lookup)):
                kw = dict(num_nodes=T, depth=d, beam_width=tree.beam_width, lookup=K)
                gen.generate(batch, 2, **kw)  # warm-up
                gen.profile = {}
                res = gen.generate(batch, new_tokens, **kw)
                seconds = sum(sum(v) for v in gen.profile.values())
                rates.append(sum(s.tokens - 1 for s in res.stats) / max(seconds, 1e-9))
            out[B] = (rates[0], rates[1])
    finally:
        gen.end_ids, gen.profile, gen.speculate_max_batch = saved_end, saved_profile, saved_limit
    return out


def batch_limit(tok_s: Dict[int, Tuple[float, float]]) -> Optional[int]:
    """The largest batch size up to which tree rounds are at least as fast as root-only rounds at every
    measured size (1 if they lose from the smallest); None when they win at every measured size."""
    limit = 1
    for B in sorted(tok_s):
        ar, spec = tok_s[B]
        if spec < ar:
            return limit
        limit = B
    return None


def speculation_limit(gen, tree: TreeParams, max_batch: Optional[int] = None, refresh: bool = False,
                      cache: bool = True) -> Optional[int]:
    """:func:`batch_limit` of ``gen`` with ``tree`` over the :data:`BATCHES` up to ``max_batch`` (and
    ``max_batch`` itself), measured once (seconds) and cached like the calibration; None (no limit)
    when ``tree`` does not speculate or ``max_batch`` is 1."""
    if gen.draft is None or tree.depth == 0 or tree.num_nodes == 1 or max_batch == 1:
        return None
    batches = sorted({b for b in BATCHES if max_batch is None or b < max_batch} | ({max_batch} - {None}))
    key = {**cache_key(gen), "batch_limit_for": [tree.num_nodes, tree.depth, tree.beam_width]
           + ([tree.lookup] if tree.lookup else []), "batches": batches}
    path = cache_path(key)
    if cache and not refresh and path.exists():
        try:
            return json.loads(path.read_text())["limit"]
        except (ValueError, KeyError, TypeError):
            pass
    prompts = calibration_ids(gen, max(batches))
    if not prompts:
        raise ValueError("measuring the batch limit needs prompts (this generator has no tokenizer)")
    load = warn_if_busy("timing batch sizes")
    tok_s = measure_batches(gen, tree, prompts, batches)
    limit = batch_limit(tok_s)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "tokens_per_s": {B: list(v) for B, v in tok_s.items()},
                                    "limit": limit, "loadavg": load}, indent=1))
    return limit


def auto_tree(gen, beam_width: int = 10, **calibrate_kw) -> TreeParams:
    """``TreeParams`` for ``gen`` maximising expected tokens/s (root-only when there is no draft)."""
    if gen.draft is None:
        return TreeParams(num_nodes=1, depth=0, beam_width=beam_width)
    return choose(calibrate(gen, **calibrate_kw), beam_width)
