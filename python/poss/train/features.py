"""Target features for draft training: computed on the fly, or read back from an fp16 shard cache.

:class:`OnlineFeatures` runs the target inside the training loop (no grad) through our fused target
runner and returns the final-norm hidden states f_0..f_{L-1}. Nothing is written to disk. For small
targets, where re-running the target every epoch (and for every method trained on the same data)
costs more than reading 2 bytes per feature, :class:`CachedFeatures` keeps each example's features
in sharded fp16 safetensors files and computes only the misses.

With the runner's ``feature_layers`` set (EAGLE-3 drafts), the features are the runner's wider ones
(final-norm states, then those layers' hidden states). A cache folder records the layers it holds in
``features.json`` and refuses features of other layers; :func:`make_features` keeps them in a
``layers-I-J-K`` subfolder, so one cache folder serves both kinds.
"""

import json
import os
import uuid
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from poss.models.target import TargetRunner
from poss.models.tree import chain_parents

# Feature-cache keys: a training example is keyed by its index, a validation example by this offset
# plus its index, so one cache folder holds both splits.
VAL_ID_OFFSET = 10 ** 9


class OnlineFeatures:
    """Features ``[B, L, H]`` of right-padded token batches from the target runner (no autograd).

    Args:
        runner: a :class:`TargetRunner` with ``max_batch >= B`` and ``max_seq >= L``.
    """

    def __init__(self, runner: TargetRunner):
        self.runner = runner

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, lengths: Tensor, indices: Optional[Sequence[int]] = None) -> Tensor:
        r = self.runner
        B, L = input_ids.shape
        dev = r.device
        parents = chain_parents(lengths.tolist(), L, dev)
        positions = torch.arange(L, device=dev).expand(B, L).contiguous()
        prefix = torch.zeros(B, dtype=torch.int32, device=dev)
        _, f = r.forward(input_ids.to(dev), positions, parents, prefix, check_capacity=False, logits=False)
        # Rows past a sequence's length are padding; zero them so they are inert everywhere.
        valid = torch.arange(L, device=dev).view(1, L) < lengths.to(dev).view(B, 1)
        return f * valid.unsqueeze(-1).to(f.dtype)


META_FILE = "features.json"  # which target layers a cache folder holds


class FeatureCache:
    """Per-example fp16 features in sharded safetensors files under ``directory``.

    Writes are buffered and flushed as one shard of about ``shard_mb`` MB; ``index.json`` maps example
    index -> shard and is rewritten after each flush, so a killed run keeps every flushed shard.
    ``feature_layers``: the runner's (None: final-norm features only), recorded in ``features.json``;
    a folder that records other layers raises ``ValueError`` (a folder without the file holds
    final-norm features: every cache written before the file existed).
    """

    def __init__(self, directory, shard_mb: int = 64, feature_layers: Optional[Sequence[int]] = None):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        want = None if feature_layers is None else [int(i) for i in feature_layers]
        meta = self.dir / META_FILE
        if meta.exists():
            got = json.loads(meta.read_text()).get("feature_layers")
        elif (self.dir / "index.json").exists():
            got = None  # written before features.json existed, or by a final-norm run (which writes none)
        else:
            got = want  # a new folder: it holds what this run writes
            if want is not None:
                meta.write_text(json.dumps({"feature_layers": want}) + "\n")
        if got != want:
            have = f"layers {got}" if got is not None else "final-norm features only"
            need = f"layers {want}" if want is not None else "final-norm features only"
            raise ValueError(f"feature cache {self.dir} holds {have}, this run needs {need}: "
                             "use another --feature-cache or online features")
        self.shard_bytes = shard_mb << 20
        idx = self.dir / "index.json"
        self.index: Dict[str, str] = json.loads(idx.read_text()) if idx.exists() else {}
        self.pending: Dict[str, Tensor] = {}
        self.pending_bytes = 0
        self._handles = {}

    def __contains__(self, i: int) -> bool:
        return str(i) in self.index or str(i) in self.pending

    def get(self, i: int) -> Tensor:
        key = str(i)
        if key in self.pending:
            return self.pending[key]
        shard = self.index[key]
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.dir / shard), framework="pt")
        return self._handles[shard].get_tensor(key)

    def put(self, i: int, features: Tensor) -> None:
        t = features.detach().to("cpu", torch.float16).contiguous()
        self.pending[str(i)] = t
        self.pending_bytes += t.numel() * 2
        if self.pending_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        # Unique shard names and a merge with the index on disk let a second process (a validation
        # run beside a training run) share the folder without overwriting the other's shards.
        name = f"shard-{uuid.uuid4().hex[:16]}.safetensors"
        tmp = self.dir / (name + ".tmp")
        save_file(self.pending, str(tmp))
        os.replace(tmp, self.dir / name)
        idx = self.dir / "index.json"
        if idx.exists():
            self.index.update({k: v for k, v in json.loads(idx.read_text()).items() if k not in self.index})
        self.index.update({k: name for k in self.pending})
        tmp_idx = self.dir / f"index.json.{os.getpid()}.tmp"
        tmp_idx.write_text(json.dumps(self.index))
        os.replace(tmp_idx, self.dir / "index.json")
        self.pending, self.pending_bytes = {}, 0


class CachedFeatures:
    """:class:`OnlineFeatures` behind a :class:`FeatureCache` keyed by example index."""

    def __init__(self, online: OnlineFeatures, cache: FeatureCache):
        self.online, self.cache = online, cache

    def __call__(self, input_ids: Tensor, lengths: Tensor, indices: Sequence[int]) -> Tensor:
        B, L = input_ids.shape
        miss = [b for b, i in enumerate(indices) if i not in self.cache]
        if miss:
            sub = input_ids[miss, : int(lengths[miss].max())]
            f = self.online(sub, lengths[miss])
            for row, b in enumerate(miss):
                self.cache.put(indices[b], f[row, : int(lengths[b])])
        r = self.online.runner
        out = torch.zeros(B, L, r.feature_width, dtype=r.dtype, device=r.device)
        for b, i in enumerate(indices):
            f = self.cache.get(i)[:L]  # a cache made for longer sequences (--max-len) serves truncated ones
            out[b, : f.shape[0]] = f.to(out.device, r.dtype)
        return out


def make_features(runner: TargetRunner, feature_cache=None, rank: int = 0):
    """Online features, or cached ones in ``feature_cache/rank{rank}`` when a cache folder is given
    (``feature_cache/layers-I-J-K/rank{rank}`` when the runner returns those layers too)."""
    online = OnlineFeatures(runner)
    if not feature_cache:
        return online
    layers = runner.feature_layers
    folder = Path(feature_cache)
    if layers is not None:
        folder = folder / ("layers-" + "-".join(str(i) for i in layers))
    return CachedFeatures(online, FeatureCache(folder / f"rank{rank}", feature_layers=layers))
