"""``dtype="auto"`` on a CPU for a GGUF target: the fastest of the formats it has here, by a short timing.

A decode step streams every linear weight once, so the weights' format decides its speed: bf16 reads
half fp32's bytes, the file's Q4_x / Q8_0 blocks (``dtype="gguf"``, :func:`poss_ext.ops.qlinear`) a
third to a half of bf16's, but decode them in registers, which costs compute that grows with the rows
a pass carries. Which wins depends on the CPU (a core's read bandwidth, AMX / AVX512-BF16) and the
threads, so it is measured, once per machine, target layout and thread count, and cached.

The timing (:func:`time_format`) runs the target's own matrix shapes (fused q|k|v and gate|up per
layer, as the runner streams them, and the lm_head) with placeholder values in each candidate format:
as many layers and lm_head rows as fill four times the last-level cache (a decode step streams the model
from memory) and scaled up to the whole model (:func:`time_format`). Nothing of the model is loaded, so
it costs a second or two. Each candidate is timed at 1 row (a plain decode step) and at a tree
verify's rows (:data:`VERIFY_ROWS`, the shipped CPU trees', unless the load names a tree). Which row
count decides (:func:`decide`): with a draft, the verify's, since every speculative round's target
cost is one verify pass of the tree, while the draft's cost is the same whatever the target's format
(drafts keep their float dtype); without a draft, the one-row step, which is every step.

Cached as JSON under ``<poss cache>/autotune/dtype/`` (:func:`cache_key`: the CPU, the kernels each
format runs, threads, the target's layout fingerprint, the rows); ``retune=True`` (``--retune``)
measures again.
"""

import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

CACHE_VERSION = 2  # bump when what is measured changes: old cache files are then ignored (2: int8 activations)
# A tree verify's rows: the draft trees shipped for CPUs verify 6-8 (2/1 + a 4-6 token lookup chain,
# drafts/*/trees.json). The paper's 60/6 and GPU trees verify 16-60, but on a CPU a verify's cost grows
# with its rows, so the trees timed best there stay small.
VERIFY_ROWS = 8
ROWS = (1, VERIFY_ROWS)
REPEATS = 3  # timed passes per row count (the fastest counts: on a shared machine, the uncontended cost)
GGUF = "gguf"

# candidate -> rows -> ms of one pass over every linear weight of the target
Timings = Dict[str, Dict[int, float]]


@dataclass
class DtypeChoice:
    """What ``dtype="auto"`` resolved to: ``dtype`` ("gguf" or a float dtype's name), ``source``
    ("measured", "cached" or why nothing was timed), the row count that decided and the timings."""

    dtype: str
    source: str
    rows: int = 1
    ms: Timings = field(default_factory=dict)

    def label(self) -> str:
        """E.g. ``gguf (measured: gguf 23.4, bfloat16 43.4 ms per pass at 1 row)``."""
        if not self.ms:
            return f"{self.dtype} ({self.source})"
        ranked = sorted(self.ms, key=lambda c: self.ms[c][self.rows])
        times = ", ".join(f"{c} {self.ms[c][self.rows]:.1f}" for c in ranked)
        return f"{self.dtype} ({self.source}: {times} ms per pass at {self.rows} row{'s' if self.rows > 1 else ''})"


def float_candidates(device="cpu") -> List[str]:
    """The float dtypes worth timing here: ``"auto"``'s (bf16 where the CPU runs it fast) and fp32."""
    from poss.hardware import resolve_dtype

    auto = str(resolve_dtype("auto", device)).replace("torch.", "")
    return list(dict.fromkeys([auto, "float32"]))


def decide(ms: Timings, draft: bool) -> Tuple[str, int]:
    """``(fastest candidate, the rows that decided)``: the verify's rows (the most ``ms`` has) with a
    draft, else 1 (see the module docstring). Ties go to the earlier candidate (the float ones come first)."""
    rows = max(next(iter(ms.values()))) if draft else 1
    return min(ms, key=lambda c: ms[c][rows]), rows


# -- timing ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Matrix:
    """One weight a forward streams: ``[n, k]`` in ``format`` (a qlinear format, or None: float)."""

    n: int
    k: int
    format: Optional[str]


def fused_matrices(layout, i: int) -> List[Matrix]:
    """Decoder layer ``i``'s weights as the runner fuses them (q|k|v, o, gate|up, down; a fused weight
    stays blocks only when its parts share one qlinear format, as
    :meth:`~poss.models.quant_weight.QuantWeight.stack`), for the GGUF
    :class:`~poss.models.gguf_weights.GGUFLayout` ``layout``."""
    from poss.models.gguf_weights import QLINEAR_FORMATS

    def matrix(*names) -> Matrix:
        full = [f"model.layers.{i}.{n}.weight" for n in names]
        fmts = {QLINEAR_FORMATS.get(layout.types[n]) for n in full}
        fmt = fmts.pop() if len(fmts) == 1 else None
        return Matrix(sum(layout.shapes[n][0] for n in full), layout.shapes[full[0]][1], fmt)

    return [matrix("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), matrix("self_attn.o_proj"),
            matrix("mlp.gate_proj", "mlp.up_proj"), matrix("mlp.down_proj")]


def head_matrix(layout) -> Matrix:
    """The lm_head of ``layout`` (see :func:`fused_matrices`)."""
    from poss.models.gguf_weights import QLINEAR_FORMATS

    n, k = layout.shapes["lm_head.weight"]
    return Matrix(n, k, QLINEAR_FORMATS.get(layout.types["lm_head.weight"]))


def _weight(m: Matrix, n: int, candidate: str, float_dtype: torch.dtype):
    """A placeholder weight of ``n`` rows of ``m`` as ``candidate`` runs it: blocks for a qlinear format
    under "gguf", else a float tensor. Every byte is written (zero pages would all map to one page and
    time as cache hits) and every scale is a small finite number (values do not change a kernel's speed)."""
    from poss.models.quant_weight import QuantWeight
    from poss_ext.ops import QBLOCK, QFORMAT_BLOCK_BYTES

    if candidate == GGUF and m.format is not None:
        size = QFORMAT_BLOCK_BYTES[m.format]
        blocks = torch.full((n, m.k // QBLOCK, size), 0x11, dtype=torch.uint8)
        scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
        blocks[..., 0:2] = scale
        if m.format == "q4_1":
            blocks[..., 2:4] = scale
        return QuantWeight(blocks.reshape(n, -1), m.format).interleaved()  # as the runner keeps them
    return torch.full((n, m.k), 0.01, dtype=float_dtype)


def _nbytes(w) -> int:
    t = getattr(w, "blocks", w)
    return t.numel() * t.element_size()


def sample_bytes() -> int:
    """Bytes of weights timed per candidate: four times the last-level cache (a decode step streams the
    model from memory, not from a cache), within [64 MB, 256 MB]; 128 MB where the size is unknown."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        llc = int(text[:-1]) << {"K": 10, "M": 20}[text[-1]]
    except (OSError, ValueError, KeyError, IndexError):
        return 128 << 20
    return min(max(4 * llc, 64 << 20), 256 << 20)


def time_format(layout, candidate: str, float_dtype: torch.dtype, rows=ROWS, repeats: int = REPEATS,
                sample: Optional[int] = None) -> Dict[int, float]:
    """ms of one pass over every linear weight of ``layout``'s target in ``candidate`` (a float dtype's
    name, or "gguf": blocks where the file has a qlinear format, ``float_dtype`` elsewhere), at each
    row count of ``rows``, with torch's current threads (see the module docstring).

    ``sample`` bytes (default :func:`sample_bytes`) of the candidate's weights are timed, half of them
    layers spread over the model, half the lm_head's first rows (a small model's head is a good part of
    its bytes); each part's time is scaled to the whole. A pass of more than one row costs mostly
    arithmetic, so it runs on a quarter of the sample. The fastest of ``repeats`` passes counts (on a
    shared machine, the uncontended cost)."""
    from poss.huge_pages import pack_on_huge_pages
    from poss.models.quant_weight import QuantWeight, project

    sample = sample_bytes() if sample is None else sample
    dtype = float_dtype if candidate == GGUF else getattr(torch, candidate)
    n_layers = layout.n_layers
    per_layer = sum(_nbytes(_weight(m, 1, candidate, dtype)) * m.n for m in fused_matrices(layout, 0))
    n_sample = max(1, min(n_layers, sample // 2 // max(per_layer, 1)))
    # Layers spread over the model: a file may give some layers other formats than the rest.
    mats = [fused_matrices(layout, j * n_layers // n_sample) for j in range(n_sample)]
    head = head_matrix(layout)
    head_rows = max(1, min(head.n, sample // 2 // max(_nbytes(_weight(head, 1, candidate, dtype)), 1)))
    flat = [m for layer in mats for m in layer]
    if candidate == GGUF and head.format is not None and head_rows >= 8:
        head_rows -= head_rows % 8  # whole groups of 8 rows, which the runner interleaves
    weights = [_weight(m, m.n, candidate, dtype) for m in flat] + [_weight(head, head_rows, candidate, dtype)]
    # On 2 MB pages where the OS has them, as the runner keeps its weights (poss.huge_pages).
    packed = pack_on_huge_pages([getattr(w, "blocks", w) for w in weights])
    weights = [QuantWeight(p, w.format) if isinstance(w, QuantWeight) else p for w, p in zip(weights, packed)]
    layer_w, head_w = weights[:-1], weights[-1]

    def one_pass(m: int, n_layers_run: int, n_head_run: int) -> Tuple[float, float]:
        xs = {k: torch.full((m, k), 0.5, dtype=dtype) for k in {w.k for w in flat + [head]}}
        t0 = time.perf_counter()
        for w, mat in zip(layer_w[: 4 * n_layers_run], flat):
            project(xs[mat.k], w)
        t1 = time.perf_counter()
        project(xs[head.k], head_w if n_head_run == head_rows else _rows(head_w, n_head_run))
        return t1 - t0, time.perf_counter() - t1

    one_pass(1, n_sample, head_rows)  # touches every page once
    out = {}
    for m in rows:
        if m == 1:
            n_run, h_run = n_sample, head_rows
        else:
            n_run, h_run = max(1, n_sample // 4), _whole_groups(head_w, head_rows // 4)
        best = [math.inf, math.inf]
        for _ in range(repeats):
            best = [min(b, t) for b, t in zip(best, one_pass(m, n_run, h_run))]
        out[m] = 1e3 * (best[0] * n_layers / n_run + best[1] * head.n / h_run)
    return out


def _whole_groups(w, n: int) -> int:
    """n rows, at least 1, rounded down to whole groups of 8 (at least one) where ``w``'s rows are
    interleaved by 8 (a slice must not split a group)."""
    if getattr(w, "format", "").endswith("x8"):
        return max(8, n - n % 8)
    return max(1, n)


def _rows(w, n: int):
    """The first ``n`` rows of a float weight or of blocks (a view: nothing is copied)."""
    from poss.models.quant_weight import QuantWeight

    return QuantWeight(w.blocks[:n], w.format) if isinstance(w, QuantWeight) else w[:n]


def measure(layout, candidates: List[str], float_dtype: torch.dtype, rows=ROWS) -> Timings:
    """:func:`time_format` of every candidate."""
    return {c: time_format(layout, c, float_dtype, rows) for c in candidates}


# -- cache -----------------------------------------------------------------------------------------

def cache_key(layout, candidates: List[str], threads: int, rows=ROWS) -> Dict:
    """What the timings depend on: the CPU, the kernel each format runs, threads, the target's layout."""
    import poss_ext
    from poss import hardware

    kernels = {c: poss_ext.ops.cpu_linear_kernel(getattr(torch, c)) for c in candidates if c != GGUF}
    if GGUF in candidates:
        from poss.models.quant_weight import QLINEAR_REVISION, X_INT8

        kernels[GGUF] = (poss_ext.ops.cpu_qlinear_kernel(X_INT8) + ("-i8" if X_INT8 else "")
                         + f"-r{QLINEAR_REVISION}")
    return {"method": CACHE_VERSION, "cpu": hardware.cpu_model(), "kernels": kernels, "threads": threads,
            "target": layout.fingerprint, "rows": list(rows)}


def cache_dir() -> Path:
    from poss.decode.autotune import cache_dir as autotune_dir

    return autotune_dir() / "dtype"


def cache_path(key: Dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"{digest}.json"


def _read(path: Path, key: Dict) -> Optional[Timings]:
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") != key:
            return None
        return {c: {int(r): float(v) for r, v in by_rows.items()} for c, by_rows in stored["ms"].items()}
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None  # none yet, or unreadable: measure again


def cached_choices() -> List[Dict]:
    """Every choice cached on this machine (any threads): ``{"target", "threads", "ms", "plain", "speculative"}``,
    the last two what a plain and a speculative load would pick; for ``poss info``."""
    from poss import hardware

    out = []
    for path in sorted(cache_dir().glob("*.json")):
        try:
            stored = json.loads(path.read_text())
            key = stored["key"]
            if key.get("method") != CACHE_VERSION or key.get("cpu") != hardware.cpu_model():
                continue
            ms = {c: {int(r): float(v) for r, v in by_rows.items()} for c, by_rows in stored["ms"].items()}
            out.append({"target": stored.get("target_file"), "threads": key["threads"], "ms": ms,
                        "plain": decide(ms, draft=False)[0], "speculative": decide(ms, draft=True)[0]})
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            continue
    return out


def _warn_if_busy() -> Optional[float]:
    """Warn when other work keeps every usable core busy (the timings, and the choice, may then be off);
    returns the load average, kept with the timings."""
    import warnings

    from poss import hardware

    load, cores = hardware.load_average(), hardware.usable_cores()
    if load is not None and hardware.others_load() >= cores:
        warnings.warn(f"dtype auto: the machine is busy (load average {load:.1f} on {cores} cores), so the "
                      "timings of the formats and the dtype picked from them may be off; they are cached: time "
                      "again with --retune (poss.load(..., retune=True)) when the machine is quiet",
                      RuntimeWarning, stacklevel=3)
    return load


def log(msg: str) -> None:
    print(f"poss: {msg}", file=sys.stderr, flush=True)


def choose_dtype(gguf_path: Optional[Path], draft: bool, retune: bool = False, device="cpu",
                 verify_rows: int = VERIFY_ROWS, timer: Optional[Callable[..., Timings]] = None) -> DtypeChoice:
    """``dtype="auto"``: "gguf" or a float dtype's name, for the target whose GGUF file is ``gguf_path``
    (None: not a GGUF target) and a load with or without a draft whose trees verify ``verify_rows``
    rows. Times the candidates (``timer``, default :func:`measure`, called as
    ``timer(layout, candidates, float_dtype, rows)``) unless this machine
    has them cached for this layout and thread count (``retune=True`` times them again). Nothing is
    timed off the CPU, for a target without a GGUF file or for a file without blocks poss runs: the
    answer is then :func:`poss.hardware.resolve_dtype`'s, as without this module."""
    from poss.models.gguf_weights import gguf_linear_layout

    floats = float_candidates(device)
    if torch.device(device).type != "cpu":
        return DtypeChoice(floats[0], "not a CPU: no GGUF kernels")
    if gguf_path is None:
        return DtypeChoice(floats[0], "not a GGUF target")
    layout = gguf_linear_layout(gguf_path)
    if not layout.runnable():
        return DtypeChoice(floats[0], "no Q8_0/Q4_0/Q4_1 blocks in the file")
    candidates = floats + [GGUF]
    threads = torch.get_num_threads()
    if not isinstance(verify_rows, int) or verify_rows < 2:
        raise ValueError(f"verify_rows must be an int >= 2, got {verify_rows!r}")
    rows = (1, verify_rows)
    key = cache_key(layout, candidates, threads, rows)
    path = cache_path(key)
    ms = None if retune else _read(path, key)
    source = "cached"
    if ms is None:
        log(f"timing the target's weights as {', '.join(candidates)} on this CPU ({threads} thread"
            f"{'s' if threads > 1 else ''}) to pick dtype auto; once, then cached")
        load = _warn_if_busy()
        start = time.perf_counter()
        ms = (timer or measure)(layout, candidates, getattr(torch, floats[0]), rows)
        source = "measured"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{time.time_ns()}.tmp")
        tmp.write_text(json.dumps({"key": key, "ms": ms, "target_file": Path(gguf_path).name,
                                   "load_average": load, "seconds": time.perf_counter() - start}, indent=1))
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    dtype, rows = decide(ms, draft)
    choice = DtypeChoice(dtype, source, rows, ms)
    if source == "measured":
        log(f"dtype auto: {choice.label()}")
    return choice
