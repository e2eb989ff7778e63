"""The cost model behind ``tree="auto"``: expected tokens per second of a draft tree from a few timed
costs and the draft's acceptance, and the choice it implies. Pure functions of their inputs; the
timings come from :mod:`poss.decode.autotune`.

A round costs ``draft(d) + verify(T)`` (``verify`` here is everything of a round that is not
drafting: the target's tree forward, ``tree_verify``, commit and host bookkeeping) and yields, in
expectation, ``E(T, d)`` tokens:

    w      = min(beam_width, (T - 1) / d)              nodes per level when T - 1 nodes share d levels
    a_i(w) = 1 - (1 - min(1, s * p_i)) ** (w ** beta)  the chance that level i holds the target's token
                                                       given that its parent did; p_i is the draft's
                                                       top-1 accuracy at position i
    E(T,d) = 1 + sum_{k<=d} prod_{i<=k} a_i(w)         the bonus token plus the expected accepted length

``p_i`` comes from the draft's validation (``config.json`` ``training.val.acc``). ``s`` (how much
easier the prompts are than the validation set) and ``beta`` (how much a second, third... sibling
adds: 0 = nothing, 1 = as much as an independent guess) are fitted to the tau measured while timing;
without it ``s = 1, beta = 0.5``. A tree that was itself timed (same size, depth and beam) is scored
with its measured tau instead: two parameters cannot follow every size. The choice includes the
root-only tree (T = 1, d = 0: plain autoregressive decoding), which wins when the draft is too weak
or a tree forward too expensive.

Drafting costs ``first + (d - 1) * level(K) + catch_up(d)``: the first level (one row, whatever the
tree), each further level over a beam of ``K = min(beam_width, T - 1)`` nodes, and the specialists'
catch-up forwards past level 2 (:func:`draft_model`). A tree with a ``K``-token lookup chain is scored
with its plain tree's tau times the measured ratio, at the verify cost of its rows.
"""

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from poss.decode.params import TreeParams

# The trees timed. Sizes 2, 6 and 12 are there because a CPU's cost is not linear in T: the AVX2 GEMM
# takes up to 6 rows in one pass over the weights, the AVX512-BF16 one up to 12.
SIZES = (1, 2, 4, 6, 8, 12, 16, 32, 60)
DEPTHS = (1, 2, 3, 4, 5, 6)
# Calibration configs (T, d): every size and depth timed at least once, depth 2 at every beam width
# (T - 1 = 3, 5, 7 and the full 10) and the catch-ups at the full width.
CALIBRATION = ((1, 0), (2, 1), (4, 1), (4, 2), (6, 2), (8, 2), (12, 3), (16, 2), (16, 3), (32, 4), (60, 5), (60, 6))
CALIBRATION_BEAM = 10
LOOKUP_MIN_TOKENS = 2  # the chain of a tree as tall as the row budget or taller
DEFAULT_S, DEFAULT_BETA = 1.0, 0.5


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


def chain_tokens(num_nodes: int, rows: int) -> int:
    """The chain that fills a ``num_nodes`` tree to ``rows`` rows (at least :data:`LOOKUP_MIN_TOKENS`)."""
    return max(LOOKUP_MIN_TOKENS, rows - num_nodes)


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
