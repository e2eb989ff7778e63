"""Checkpoints written the way the published projects write them, independently of poss.models.published.

Names, shapes, dtypes and config fields follow the reference code: EAGLE-1/2 and HASS (SafeAILab/EAGLE
``cnets1.py`` ``Model`` and ``EConfig``; ``"bias"`` read by ``ea_model.py``), the PosS authors' code
(``cnets_poss_layer_gen.py``: N layers, one ``fc``, ``embed_tokens`` in the state dict) and EAGLE-3
(``cnets.py`` ``Model``: ``midlayer``, ``fc`` over 3 x hidden, ``norm``, ``lm_head``, ``d2t`` / ``t2d``).
"""

import json
from pathlib import Path

import torch


def _save(folder: Path, state: dict, fmt: str) -> None:
    """``fmt``: safetensors | bin | sharded-safetensors | sharded-bin (two shards, transformers' names)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in state.items()}
    sharded, kind = fmt.startswith("sharded-"), fmt.split("-")[-1]
    stem, ext = ("model", "safetensors") if kind == "safetensors" else ("pytorch_model", "bin")

    def write(part, name):
        if kind == "safetensors":
            from safetensors.torch import save_file

            save_file(part, str(folder / name), metadata={"format": "pt"})
        else:
            torch.save(part, str(folder / name))

    if not sharded:
        write(state, f"{stem}.{ext}")
        return
    names = sorted(state)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    files = [f"{stem}-0000{i + 1}-of-00002.{ext}" for i in range(2)]
    for half, f in zip(halves, files):
        write({k: state[k] for k in half}, f)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": {k: f for half, f in zip(halves, files) for k in half}}
    (folder / f"{stem}.{ext}.index.json").write_text(json.dumps(index))


def econfig(hidden, heads, kv_heads, ffn, vocab, rms_eps=1e-5, rope_theta=10000.0, **extra) -> dict:
    """An EAGLE train config (``eagle/train/*config.json``): an HF Llama config with one hidden layer."""
    return {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
            "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": ffn,
            "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": rms_eps,
            "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1",
            "use_cache": True, "vocab_size": vocab, "rope_theta": rope_theta, **extra}


def eagle_names_from_draft(draft) -> dict:
    """A poss draft's layers in the reference's names (rows of q|k|v and gate|up split back apart)."""
    c = draft.config
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    sd = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    out = {"fc.weight": sd["fc.weight"]}
    if c.fc_bias:
        out["fc.bias"] = sd["fc.bias"]
    for j in range(c.n_specialists):
        p = f"layers.{j}."
        qkv, gu = sd[p + "qkv_proj.weight"], sd[p + "gate_up_proj.weight"]
        out[p + "self_attn.q_proj.weight"] = qkv[:q]
        out[p + "self_attn.k_proj.weight"] = qkv[q:q + kv]
        out[p + "self_attn.v_proj.weight"] = qkv[q + kv:]
        out[p + "self_attn.o_proj.weight"] = sd[p + "o_proj.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[p + "post_norm"]
        out[p + "mlp.gate_proj.weight"] = gu[:c.ffn]
        out[p + "mlp.up_proj.weight"] = gu[c.ffn:]
        out[p + "mlp.down_proj.weight"] = sd[p + "down_proj.weight"]
    return out


def write_eagle(folder, draft, runner=None, fmt="safetensors", position_per_layer=None, drop=(), **config_over):
    """``draft`` written as an EAGLE / HASS checkpoint (one layer) or, with several specialists, as the
    PosS reference's (with ``embed_tokens.weight`` from ``runner``, and ``position_per_layer`` in its
    config when given). ``drop``: tensor names to leave out (a partial checkpoint)."""
    folder = Path(folder)
    c = draft.config
    state = eagle_names_from_draft(draft)
    if runner is not None:
        state["embed_tokens.weight"] = runner.embed.detach().to(state["fc.weight"].dtype).clone()
    for name in drop:
        del state[name]
    _save(folder, state, fmt)
    cfg = econfig(c.hidden, c.heads, c.kv_heads, c.ffn, c.vocab, c.rms_eps, c.rope["rope_theta"],
                  bias=c.fc_bias, **config_over)
    if position_per_layer is not None:
        cfg["position_per_layer"] = position_per_layer
        cfg["forward_num_total"] = position_per_layer * c.n_specialists
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def random_eagle3(folder, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=300, draft_vocab=40, seed=0,
                  fmt="safetensors", prefix="midlayer.", embed=None, dtype=torch.float16):
    """A random EAGLE-3 draft as the EAGLE-3 reference saves it; returns ``(folder, state dict)``."""
    g = torch.Generator().manual_seed(seed)
    D = hidden // heads
    r = lambda *s: (torch.randn(*s, generator=g) * 0.05).to(dtype)  # noqa: E731
    k = draft_vocab or vocab
    state = {"fc.weight": r(hidden, 3 * hidden), "norm.weight": r(hidden) + 1, "lm_head.weight": r(k, hidden),
             prefix + "self_attn.q_proj.weight": r(heads * D, 2 * hidden),
             prefix + "self_attn.k_proj.weight": r(kv_heads * D, 2 * hidden),
             prefix + "self_attn.v_proj.weight": r(kv_heads * D, 2 * hidden),
             prefix + "self_attn.o_proj.weight": r(hidden, heads * D),
             prefix + "input_layernorm.weight": r(hidden) + 1, prefix + "hidden_norm.weight": r(hidden) + 1,
             prefix + "post_attention_layernorm.weight": r(hidden) + 1,
             prefix + "mlp.gate_proj.weight": r(ffn, hidden), prefix + "mlp.up_proj.weight": r(ffn, hidden),
             prefix + "mlp.down_proj.weight": r(hidden, ffn)}
    if draft_vocab:
        hot = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        state["d2t"] = hot - torch.arange(draft_vocab)  # target id = draft id + d2t[draft id]
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[hot] = True
        state["t2d"] = t2d
    if embed is not None:
        state["embed_tokens.weight"] = embed.to(dtype)
    folder = Path(folder)
    _save(folder, state, fmt)
    cfg = econfig(hidden, heads, kv_heads, ffn, vocab, draft_vocab_size=k)
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder, state
