"""A datastore of the target's own text: lookup chains for contexts that do not repeat themselves.

Prompt lookup (:mod:`poss.decode.lookup`) copies what followed the context's last tokens earlier in
the same context; about a fifth of the positions of a short answer have no such earlier occurrence.
For those, the next best guess is what followed the same tokens in other answers of the same target
(retrieval drafting, as in REST, He et al. 2023): a target's greedy answers reuse its phrases. The
index here maps every n-gram (n = ``min_ngram`` .. ``max_ngram``) of a token corpus, the target's own
greedy answers to training prompts (``poss distill``), to its latest occurrence; a lookup takes the
longest n that matches the context's end. A wrong guess costs only its rows in the verify forward,
and verification does not change, so the output stays exactly the target's.

On 16 MT-Bench prompts x 256 tokens with the shipped PosS-2 draft, falling back to the shipped
smollm2-135m datastore (1.15M answer tokens) where the context holds no match raised tau at 3/1+5
from 2.49 to 2.58 and at 4/1+4 from 2.41 to 2.50, and 3/1+5 ran 2.07x our AR loop against 2.00x
(``bench/bench_tree_sweep.py --datastore-ab``, AVX512-BF16 EPYC, bf16, one thread). A lookup costs 3-11 us on
the host, a hit to a miss (``bench/bench_datastore.py``).

The file is a NumPy ``.npz`` holding ``tokens`` (uint16 or int32 token ids, answers separated by -1
in int32 files or by 65535 in uint16 ones) and ``meta`` (a JSON string: the target's weight
fingerprint, where the text came from). The index is built in memory on load (0.4 s for the shipped
1.15M tokens, ``bench/bench_datastore.py``).
"""

import hashlib
import json
import os
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Union

import numpy as np

_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd: the polynomial hash below is a bijection per token
_MASK = (1 << 64) - 1
SEPARATOR = -1
_SEPARATOR_U16 = 0xFFFF


def _extend_hashes(h: np.ndarray, tokens: np.ndarray, n: int) -> np.ndarray:
    """The uint64 polynomial hashes of every window ``tokens[i:i+n]`` (``len(tokens) - n + 1`` values)
    from those of the windows one token shorter (``h``; empty for n = 1)."""
    L = len(tokens) - n + 1
    last = tokens[n - 1:].astype(np.uint64)
    if n == 1:
        return last
    with np.errstate(over="ignore"):
        return h[:L] * _MULT + last


def _hash_tuple(window: Sequence[int]) -> int:
    """:func:`_extend_hashes`' hash of one window, in Python integers (the same value)."""
    h, m = 0, int(_MULT)
    for x in window:
        h = (h * m + (x & _MASK)) & _MASK
    return h


class Datastore:
    """An n-gram index over ``tokens`` for :meth:`continuation`.

    tokens: 1-D int array of token ids in ``[0, 2**31)``, documents separated by :data:`SEPARATOR`
    (-1); no n-gram or continuation crosses a separator. ``meta``: what the file records (e.g.
    ``target_fingerprint``).
    """

    def __init__(self, tokens: Union[np.ndarray, Sequence[int]], min_ngram: int = 2, max_ngram: int = 6,
                 meta: Optional[Dict] = None, index_cache: Optional[Union[str, Path]] = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a 1-D integer array, got shape {tokens.shape} and dtype {tokens.dtype}")
        if tokens.size and (int(tokens.min()) < SEPARATOR or int(tokens.max()) >= 2**31):
            raise ValueError(f"tokens must be ids in [0, 2**31) or the separator {SEPARATOR}, got values in "
                             f"[{tokens.min()}, {tokens.max()}]")
        self.tokens = tokens.astype(np.int32)
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.meta = dict(meta or {})
        digest = hashlib.sha256(self.tokens.tobytes() + f"{min_ngram},{max_ngram}".encode()).hexdigest()
        self.fingerprint = digest[:16]  # what autotune's cache keys on
        self._keys: Dict[int, np.ndarray] = {}  # n -> sorted unique window hashes
        self._ends: Dict[int, np.ndarray] = {}  # n -> the latest window end (the continuation's start) per hash
        # Sorting the window hashes is most of a load (0.6 s of a 1 s start for SmolLM2's store), and the
        # index depends only on the tokens and n-gram range: ``index_cache`` (a folder) keeps it by fingerprint.
        cached = Path(index_cache) / f"{self.fingerprint}.npz" if index_cache is not None else None
        if cached is not None and self._load_index(cached):
            return
        self._build_index()
        if cached is not None:
            self._save_index(cached)

    def _load_index(self, path: Path) -> bool:
        try:
            with np.load(path, allow_pickle=False) as f:
                keys = {n: f[f"keys{n}"] for n in range(self.min_ngram, self.max_ngram + 1)}
                ends = {n: f[f"ends{n}"] for n in range(self.min_ngram, self.max_ngram + 1)}
        except (OSError, KeyError, ValueError):  # absent, cut short or from another layout: rebuild
            return False
        if any(keys[n].dtype != np.uint64 or ends[n].dtype != np.int32 or keys[n].shape != ends[n].shape
               for n in keys):
            return False
        self._keys, self._ends = keys, ends
        return True

    def _save_index(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
        arrays = {**{f"keys{n}": k for n, k in self._keys.items()}, **{f"ends{n}": e for n, e in self._ends.items()}}
        np.savez(tmp, **arrays)
        os.replace(tmp, path)  # whole or not at all: a reader never sees half a file

    def _build_index(self) -> None:
        max_ngram, min_ngram = self.max_ngram, self.min_ngram
        sep = np.concatenate([[0], np.cumsum(self.tokens == SEPARATOR)])  # separators in tokens[:i]
        windows = self.tokens[:-1]  # a window needs a continuation after it
        h = np.zeros(0, np.uint64)
        for n in range(1, max_ngram + 1):
            if len(windows) < n:
                h = np.zeros(0, np.uint64)
            else:
                h = _extend_hashes(h, windows, n)  # windows[e-n:e] for e = n .. len(tokens) - 1
            if n < min_ngram:
                continue
            ends = np.arange(n, n + len(h), dtype=np.int64)  # window tokens[e-n:e], continuation tokens[e]
            ok = (sep[ends + 1] - sep[ends - n]) == 0  # no separator in the window nor at its continuation
            hn, ends = h[ok], ends[ok]
            order = np.argsort(hn, kind="stable")  # equal hashes keep position order: the last is the latest
            hn, ends = hn[order], ends[order]
            last = np.ones(len(hn), dtype=bool)
            last[:-1] = hn[1:] != hn[:-1]
            self._keys[n], self._ends[n] = hn[last], ends[last].astype(np.int32)

    def __len__(self) -> int:
        return int(len(self.tokens) - np.count_nonzero(self.tokens == SEPARATOR))

    def continuation(self, context: Sequence[int], k: int) -> List[int]:
        """Up to ``k`` tokens that followed the latest occurrence of ``context``'s last n tokens in the
        corpus, for the largest n in ``max_ngram`` .. ``min_ngram`` that occurs; ``[]`` when none does.
        The chain stops at the end of its document."""
        if k <= 0:
            return []
        tail = [int(x) for x in context[max(len(context) - self.max_ngram, 0):]]
        for n in range(len(tail), self.min_ngram - 1, -1):
            window = tail[len(tail) - n:]
            keys = self._keys[n]
            h = np.uint64(_hash_tuple(window))
            i = int(np.searchsorted(keys, h))
            if i == len(keys) or keys[i] != h:
                continue
            end = int(self._ends[n][i])
            if self.tokens[end - n:end].tolist() != window:
                continue  # a hash collision: the text differs
            out = self.tokens[end:end + k].tolist()
            return out[:out.index(SEPARATOR)] if SEPARATOR in out else out
        return []

    # -- files -------------------------------------------------------------------------------------
    @classmethod
    def from_documents(cls, documents: Iterable[Sequence[int]], **kw) -> "Datastore":
        """A datastore over ``documents`` (token-id lists, e.g. answers), separated."""
        flat: List[int] = []
        for d in documents:
            flat.extend(int(x) for x in d)
            flat.append(SEPARATOR)
        return cls(np.asarray(flat, dtype=np.int64), **kw)

    def save(self, path: Union[str, Path]) -> None:
        """Write ``tokens`` and ``meta`` (compressed ``.npz``); uint16 where every id fits."""
        t = self.tokens
        if not len(t) or int(t.max()) < _SEPARATOR_U16:
            t = np.where(t == SEPARATOR, _SEPARATOR_U16, t).astype(np.uint16)
        np.savez_compressed(path, tokens=t, meta=np.array(json.dumps(self.meta, sort_keys=True)))

    @classmethod
    def load(cls, path: Union[str, Path], **kw) -> "Datastore":
        """A datastore from a :meth:`save` file; ``kw`` as in the constructor (``index_cache`` defaults to
        ``datastore-index/`` in the poss cache)."""
        with np.load(path, allow_pickle=False) as f:
            if "tokens" not in f or "meta" not in f:
                raise ValueError(f"{path}: not a poss datastore (needs arrays 'tokens' and 'meta', has {list(f)})")
            tokens, meta = f["tokens"], json.loads(str(f["meta"]))
        if tokens.dtype == np.uint16:
            tokens = np.where(tokens == _SEPARATOR_U16, SEPARATOR, tokens.astype(np.int64))
        if "index_cache" not in kw:
            from poss.models.downloads import cache_root

            kw["index_cache"] = cache_root() / "datastore-index"
        return cls(tokens, meta=meta, **kw)


def shipped_datastore_path(target_name: str) -> Optional[Path]:
    """The datastore file shipped in the package for registry target ``target_name``, if any."""
    path = Path(__file__).resolve().parents[1] / "data" / "datastores" / f"{target_name}.npz"
    return path if path.is_file() else None
