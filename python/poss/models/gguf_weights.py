"""A GGUF file's linear weights as the blocks the file stores, keyed by the HF parameter names.

Tensors in a format :func:`poss_ext.ops.qlinear` runs (Q8_0, Q4_0, Q4_1) become
:class:`~poss.models.quant_weight.QuantWeight`; the rest (F16, F32, K-quants, Q5_x...) are left to
the dequantised HF model, and :func:`read_gguf_linears` says which went which way.
"""

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Tuple

import numpy as np
import torch

from poss.models.quant_weight import QuantWeight

QLINEAR_FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}

# GGUF tensor name inside blk.<i> -> HF parameter name inside model.layers.<i>
_LAYER_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}


@dataclass
class GGUFLinears:
    """``blocks``: HF name -> the file's blocks, for weights in a qlinear format. ``types``: HF name ->
    GGUF type name of every linear weight the runner reads (the layers' projections and ``lm_head.weight``,
    which is ``token_embd`` in a file with tied embeddings)."""

    blocks: Dict[str, QuantWeight] = field(default_factory=dict)
    types: Dict[str, str] = field(default_factory=dict)

    def dequantised(self) -> Dict[str, str]:
        """HF name -> GGUF type of the linear weights that run dequantised (not in a qlinear format)."""
        return {k: t for k, t in self.types.items() if k not in self.blocks}


def _llama_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (as transformers' GGUF loader does):
    HF row (h, a, j) is GGUF row (h, j, a), for head h, half a and pair index j."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)


@dataclass
class GGUFLayout:
    """What a GGUF file's linear weights are, without reading them: HF name -> GGUF type name and
    ``(N, K)``; ``fingerprint``: a hash of that table and the file's size (what a timing of the weights
    depends on); ``n_layers``: the decoder layers."""

    types: Dict[str, str]
    shapes: Dict[str, Tuple[int, int]]
    fingerprint: str
    n_layers: int

    def runnable(self) -> bool:
        """Whether any layer projection is in a format :func:`poss_ext.ops.qlinear` runs (``dtype="gguf"``
        would run blocks; the lm_head alone does not count)."""
        return any(t in QLINEAR_FORMATS for k, t in self.types.items() if k != "lm_head.weight")


def _open(path: Path):
    """``(architecture, {gguf tensor name: reader tensor}, {gguf name: HF name})`` of the linear weights
    the runner reads."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch_field = reader.fields["general.architecture"]
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    tensors = {t.name: t for t in reader.tensors}
    wanted = {}
    for name in tensors:
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_LINEARS:
            wanted[name] = f"model.layers.{parts[1]}.{_LAYER_LINEARS[parts[2]]}.weight"
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    if head not in tensors:
        raise ValueError(f"{path}: no output.weight nor token_embd.weight tensor (not a causal LM GGUF file)")
    wanted[head] = "lm_head.weight"
    return arch, tensors, wanted


def gguf_linear_layout(path: Path) -> GGUFLayout:
    """The :class:`GGUFLayout` of the GGUF file ``path`` (its tensor table only: no weight is read)."""
    _, tensors, wanted = _open(path)
    types = {hf: tensors[g].tensor_type.name for g, hf in wanted.items()}
    # GGUF lists a matrix's dimensions innermost first: [K, N].
    shapes = {hf: (int(tensors[g].shape[1]), int(tensors[g].shape[0])) for g, hf in wanted.items()}
    h = hashlib.sha256(f"{Path(path).stat().st_size}".encode())
    for name in sorted(types):
        h.update(f"{name}:{types[name]}:{shapes[name]}".encode())
    n_layers = len({k.split(".")[2] for k in types if k.startswith("model.layers.")})
    return GGUFLayout(types, shapes, h.hexdigest()[:16], n_layers)


def read_gguf_linears(path: Path, num_heads: int, num_kv_heads: int) -> GGUFLinears:
    """The linear weights of the Llama / Qwen2 / Mistral GGUF file ``path`` (see :class:`GGUFLinears`).

    Raises ``ValueError`` naming the tensor for blocks a run could not use: a K that is not a whole
    number of 32-weight blocks, a row of another byte count, an inf or NaN scale
    (:meth:`QuantWeight.check`)."""
    arch, tensors, wanted = _open(path)
    out = GGUFLinears()
    for gguf_name, hf_name in wanted.items():
        t = tensors[gguf_name]
        out.types[hf_name] = t.tensor_type.name
        fmt = QLINEAR_FORMATS.get(t.tensor_type.name)
        if fmt is None:
            continue
        blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True))
        n, k = int(t.shape[1]), int(t.shape[0])
        if blocks.dim() != 2 or blocks.shape[0] != n:
            raise ValueError(f"{path}: tensor {gguf_name} ({t.tensor_type.name}) holds blocks "
                             f"{tuple(blocks.shape)}, not {n} rows for its shape [{n}, {k}]")
        QuantWeight(blocks, fmt).check(f"{path}: tensor {gguf_name}", (n, k))
        if arch == "llama" and gguf_name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = num_heads if ".attn_q." in gguf_name else num_kv_heads
            blocks = blocks[_llama_rows(blocks.shape[0], heads)].contiguous()
        out.blocks[hf_name] = QuantWeight(blocks, fmt)
    return out
