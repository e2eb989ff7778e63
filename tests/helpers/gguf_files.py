"""Tiny GGUF files for the tests: a tiny HF Llama's linear weights written with gguf's writer, in
chosen formats, with q / k rows permuted as llama.cpp's converter stores them."""

from pathlib import Path

import numpy as np
import torch

# tensor name inside blk.<i> -> HF module inside model.layers.<i>
LAYER_TENSORS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}


def _gguf_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order: GGUF row (h, j, a) holds HF row (h, a, j) (head h, half a, pair j)."""
    n = w.shape[0]
    return w.reshape(n_head, 2, n // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: Path, layers: str = "q4_0", head: str = "q8_0", embed: str = "f32") -> Path:
    """Write ``model``'s (a tiny HF Llama, untied) projections in format ``layers``, its lm_head as
    ``output.weight`` in ``head`` and its embedding in ``embed`` ("q8_0" / "q4_0" / "q4_1" / "f16" /
    "f32") to the GGUF file ``path``, and set the model's weights to the values the file decodes to (as
    transformers loads a GGUF file). Returns ``path``."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    cfg = model.config
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)

    def put(name: str, param, fmt: str, n_head: int = 0):
        w = param.detach().float().numpy()
        kind = GGMLQuantizationType[fmt.upper()]
        if fmt in ("f32", "f16"):
            data = w.astype(np.float16 if fmt == "f16" else np.float32)
            decoded = data.astype(np.float32)
        else:
            data = quants.quantize(w, kind)
            decoded = quants.dequantize(data, kind)
        with torch.no_grad():
            param.copy_(torch.from_numpy(np.ascontiguousarray(decoded)).reshape(param.shape))
        if n_head:
            data = np.ascontiguousarray(_gguf_rows(data, n_head))
        writer.add_tensor(name, data, raw_dtype=None if fmt in ("f32", "f16") else kind)

    put("token_embd.weight", model.model.embed_tokens.weight, embed)
    for i, layer in enumerate(model.model.layers):
        for short, module in LAYER_TENSORS.items():
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(short, 0)
            put(f"blk.{i}.{short}.weight", layer.get_submodule(module).weight, layers, heads)
    put("output.weight", model.lm_head.weight, head)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
