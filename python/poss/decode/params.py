"""What a caller chooses per call: how each request samples (:class:`SamplingParams`) and the shape
of the draft tree (:class:`TreeParams`), each validated in one place.

Adding a logits processor (min-p was added this way) is a field of :class:`SamplingParams` plus its
row in :class:`SamplingTensors`, the batch's device copy that ``tree_verify`` reads.
"""

import struct
from dataclasses import dataclass, fields
from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor

# Tree attention takes at most MAX_TREE_NODES real nodes per tree, build_tree on CUDA at most
# MAX_CUDA_CANDIDATES candidates: a tree is held to both on every device, so that it runs anywhere.
from poss_ext.limits import MAX_CUDA_CANDIDATES as MAX_TREE_CANDIDATES
from poss_ext.limits import MAX_TREE_NODES

# The sampler works in float32 with 1 / temperature and takes top_k as int32, and seeds are 64-bit:
# values that pass a float64 / Python-int check but not these would fail mid-batch.
MIN_TEMPERATURE = 1e-5  # below it float32 logits / temperature overflow (vLLM draws the line here too)
MAX_TEMPERATURE = 1e4
MAX_TOP_K = 2 ** 31 - 1
SEED_RANGE = (0, 2 ** 64)


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens; the default is greedy decoding.

    temperature: 0 is greedy (argmax), > 0 samples from ``softmax(logits / temperature)``.
    top_k: keep the k most likely tokens (0 = all). top_p: keep the smallest set holding this much
    probability (1 = all). min_p: keep tokens whose probability is at least ``min_p`` times the most
    likely one's (0 = off). All filters apply after the temperature, and only when sampling.
    seed: makes the request reproducible: it draws its random numbers from its own generator seeded
    with it, so it samples the same tokens alone or in any batch, through ``generate`` or ``poss
    serve`` (requests that share a prompt and a seed sample alike; no seed: a fresh random one).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None

    def __post_init__(self):
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):  # NaN too
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                             f"got {self.temperature}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, {MAX_TOP_K}] (0 = off), got {self.top_k}")
        if not (0 < self.top_p <= 1 and _float32(self.top_p) > 0):
            raise ValueError(f"top_p must be in (0, 1] and not round to 0 in float32 (1 = off), got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @staticmethod
    def per_request(sampling, n: int, **overrides) -> List["SamplingParams"]:
        """``n`` params from one :class:`SamplingParams`, a list of them, or None (greedy), with keyword
        ``overrides`` (e.g. ``temperature=0.7`` or ``top_k=[0, 5]``, a value or one per request)."""
        if isinstance(sampling, (list, tuple)):
            if len(sampling) != n:
                raise ValueError(f"sampling has {len(sampling)} values for {n} prompts")
            base = list(sampling)
        else:
            base = [sampling or SamplingParams()] * n
        names = {f.name for f in fields(SamplingParams)}
        for name, value in overrides.items():
            if name not in names:
                raise TypeError(f"unknown sampling parameter {name!r}")
            if value is None:  # not given: keep what ``sampling`` says
                continue
            values = list(value) if isinstance(value, (list, tuple)) else [value] * n
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} values for {n} prompts")
            base = [SamplingParams(**{**vars(p), name: v}) for p, v in zip(base, values)]
        return base


@dataclass
class SamplingTensors:
    """The batch's sampling parameters on the device, row b for request b (``tree_verify``'s inputs).

    temperature ``[B] float32``, top_k ``[B] int32``, top_p ``[B] float32``, min_p ``[B] float32`` or
    None when no request uses min-p (the op then runs without it).
    """

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    min_p: Optional[Tensor]

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device) -> Optional["SamplingTensors"]:
        """None when every request is greedy (the op's greedy path needs no tensors)."""
        if all(p.greedy for p in params):
            return None
        f32 = dict(dtype=torch.float32, device=device)
        min_p = torch.tensor([p.min_p for p in params], **f32) if any(p.min_p > 0 for p in params) else None
        return cls(torch.tensor([p.temperature for p in params], **f32),
                   torch.tensor([p.top_k for p in params], dtype=torch.int32, device=device),
                   torch.tensor([p.top_p for p in params], **f32), min_p)

    def rows(self) -> List[Optional[Tensor]]:
        return [self.temperature, self.top_k, self.top_p, self.min_p]

    def move_row(self, dst: int, src: int) -> None:
        for t in self.rows():
            if t is not None:
                t[dst] = t[src]

    def shrink(self, B: int) -> None:
        """Keep the leading ``B`` rows."""
        self.temperature, self.top_k, self.top_p = self.temperature[:B], self.top_k[:B], self.top_p[:B]
        if self.min_p is not None:
            self.min_p = self.min_p[:B]


@dataclass(frozen=True)
class TreeParams:
    """The draft tree of every round.

    num_nodes: nodes verified per round, root included (1 = no speculation). depth: draft positions
    below the root (0 = no speculation). beam_width: EAGLE-2's K, the children kept per frontier node
    and the frontier size per level. lookup: up to this many tokens copied from the request's own
    context (prompt lookup, :mod:`poss.decode.lookup`) merged into each round's tree, on top of its
    ``num_nodes`` (0 = off). With a draft, the rows a chain leaves unused (no match, a shorter one, or
    a prefix the tree already holds) go to the draft's next-best first-level tokens, so every round
    verifies ``num_nodes + lookup`` rows; with no draft, the lookup chain alone is the tree.
    """

    num_nodes: int = 60
    depth: int = 6
    beam_width: int = 10
    lookup: int = 0

    def __post_init__(self):
        if not 1 <= self.num_nodes <= MAX_TREE_NODES:
            raise ValueError(f"num_nodes must be in [1, {MAX_TREE_NODES}], got {self.num_nodes}")
        if self.depth < 0:
            raise ValueError(f"depth must be >= 0, got {self.depth}")
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if not 0 <= self.lookup <= MAX_TREE_NODES - self.num_nodes:
            raise ValueError(f"lookup must be in [0, {MAX_TREE_NODES - self.num_nodes}] (num_nodes + lookup <= "
                             f"{MAX_TREE_NODES}), got {self.lookup}")
        if self.depth and self.drafted_nodes > MAX_TREE_NODES:
            raise ValueError(f"depth={self.depth} with beam_width={self.beam_width} drafts more than "
                             f"{MAX_TREE_NODES} nodes per round")
        if self.depth and self.candidates > MAX_TREE_CANDIDATES:
            raise ValueError(f"depth={self.depth} with beam_width={self.beam_width} gives more than "
                             f"{MAX_TREE_CANDIDATES} tree candidates")

    @property
    def drafted_nodes(self) -> int:
        """Nodes of one round's draft forward: root, one beam per level below the first."""
        return self.depth + 1 + self.beam_width * (self.depth - 1)

    @property
    def candidates(self) -> int:
        """Candidates handed to ``build_tree``: K at level 1, K * K at each deeper level."""
        return self.beam_width + (self.depth - 1) * self.beam_width ** 2

    def check_vocab(self, vocab: int) -> None:
        if self.beam_width > vocab:
            raise ValueError(f"beam_width must be in [1, vocab={vocab}], got {self.beam_width}")


def tree_from_flags(num_nodes, depth, beam_width: int, lookup=0) -> Union[TreeParams, str]:
    """``TreeParams`` from the tree flags, or ``"auto"`` when both sizes are ``auto`` (the caller passes
    ``beam_width`` and a numeric ``lookup`` along as fields); a size given alone takes the other's fixed
    default (60 nodes / depth 6), and ``lookup="auto"`` is 0 on a fixed tree. ``ValueError`` names the
    field."""
    if num_nodes == "auto" and depth == "auto":
        return "auto"
    fixed = TreeParams()
    return TreeParams(num_nodes=fixed.num_nodes if num_nodes == "auto" else num_nodes,
                      depth=fixed.depth if depth == "auto" else depth, beam_width=beam_width,
                      lookup=0 if lookup == "auto" else lookup)


def tree_spec(text: str) -> TreeParams:
    """``"N/D"`` -> ``TreeParams(N, D)``, ``"N/D+K"`` -> the same with a K-token lookup chain (the form
    the benchmarks and scripts print); ``ValueError`` for anything else."""
    shape, plus, k = text.partition("+")
    nodes, depth = (int(x) for x in shape.split("/"))
    return TreeParams(num_nodes=nodes, depth=depth, lookup=int(k) if plus else 0)
