"""Import published drafts into poss's format and export poss drafts in the published layouts.

:func:`load_foreign` is what :meth:`PosSDraft.load` does with a folder in a published layout (so
``poss.load(target, draft=FOLDER)`` and ``--draft FOLDER`` take one as it is); :func:`import_draft`
converts one once, checked against its target, into poss's format with a model card; :func:`export_draft`
writes a poss draft in a published layout. The layouts: :mod:`poss.models.published`, docs/interop.md.
"""

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

import torch
from torch import Tensor

from poss.models.checkpoint_files import FILE_FORMATS, write_weights
from poss.models.draft_config import DRAFT_VOCABS, DraftConfig
from poss.models.eagle3_draft import Eagle3Config, Eagle3Draft, as_draft_config, from_draft_config
from poss.models.published import (
    LAYOUT_NAMES,
    LAYOUTS,
    TOKEN_MAP_FILE,
    Converted,
    layout_of,
    read_published,
    to_eagle,
    to_eagle3,
)

EMBED_ROWS_CHECKED = 256  # rows of a checkpoint's embed_tokens compared with the target's


def load_foreign(folder, dtype: torch.dtype = torch.float32, device="cpu", vocab: str = "trained",
                 positions_per_specialist: Optional[int] = None):
    """The :class:`~poss.models.draft.PosSDraft` in ``folder``, a published ``eagle`` / ``poss-ref`` /
    ``eagle3`` layout or an imported EAGLE-3 folder (arguments as :meth:`PosSDraft.load`). An EAGLE-3
    draft becomes a one-specialist ``eagle3`` draft (:func:`~poss.models.eagle3_draft.as_draft_config`);
    it scores with its own head, so ``vocab="full"`` is refused."""
    from poss.models.draft import PosSDraft

    if vocab not in DRAFT_VOCABS:
        raise ValueError(f"vocab must be one of {', '.join(DRAFT_VOCABS)}, got {vocab!r}")
    kind = layout_of(folder)
    if kind in ("eagle3", "poss-eagle3"):
        if vocab == "full":
            raise ValueError(f"{folder} is an EAGLE-3 draft: it scores with its own head, so vocab 'full' "
                             "does not apply")
        e3 = Eagle3Draft.load(folder) if kind == "poss-eagle3" else read_published(folder)
        config, state = as_draft_config(e3.config, str(folder)), dict(e3.state)
        model = PosSDraft(config)
        model.load_state_dict(state, strict=True)
        return model.to(dtype=dtype, device=device).eval()
    conv = read_published(folder, positions_per_specialist)
    config, state = conv.config, dict(conv.state)
    if vocab == "full" and config.draft_vocab:
        config = replace(config, draft_vocab=0)
        state.pop("token_map")
    model = PosSDraft(config)
    model.load_state_dict(state, strict=True)
    return model.to(dtype=dtype, device=device).eval()


def check_target(conv: Converted, runner, where: str) -> None:
    """Raise a one-line ``ValueError`` naming the first mismatch between the converted draft and
    ``runner``'s target: hidden size, vocabulary, recorded fingerprint, or (where the checkpoint has
    ``embed_tokens.weight``) the embedding's shape or :data:`EMBED_ROWS_CHECKED` of its rows."""
    c = conv.config
    hidden = c.target_hidden if isinstance(c, Eagle3Config) else c.hidden
    if hidden != runner.hidden_size:
        raise ValueError(f"{where} was made for a target of hidden size {hidden}, this target has {runner.hidden_size}")
    v = int(runner.lm_head.shape[0])
    if c.vocab != v:
        raise ValueError(f"{where} was made for a vocabulary of {c.vocab} tokens, this target has {v}")
    if c.target_fingerprint and c.target_fingerprint != runner.fingerprint():
        raise ValueError(f"{where} was made for target weights {c.target_fingerprint} ({c.target_name!r}), "
                         f"this target is {runner.fingerprint()}")
    e = conv.embed
    if e is None or (isinstance(c, Eagle3Config) and c.hidden != c.target_hidden):
        return  # none, or an EAGLE-3 draft's own (narrower) embedding rather than the target's
    if tuple(e.shape) != tuple(runner.embed.shape):
        raise ValueError(f"{where}: its embed_tokens.weight is {tuple(e.shape)}, "
                         f"the target's {tuple(runner.embed.shape)}")
    rows = torch.linspace(0, e.shape[0] - 1, min(EMBED_ROWS_CHECKED, e.shape[0])).long()
    mine, theirs = e[rows].float(), runner.embed[rows.to(runner.embed.device)].float().cpu()
    # Both sides are the target's embedding rounded to a 16-bit type at most: bf16 keeps 8 bits of mantissa.
    if not torch.allclose(mine, theirs, rtol=1e-2, atol=1e-2 * float(theirs.abs().max())):
        raise ValueError(f"{where}: its embed_tokens.weight differs from this target's embedding "
                         "(made for another target)")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _import_card(conv: Converted, source: str, target_name: str, fingerprint: str, mapping: str) -> str:
    c = conv.config
    files = "; ".join(f"`{p.name}` (sha256 {_sha256(p)[:16]})" for p in conv.files)
    k = c.draft_vocab or "the full"
    if isinstance(c, Eagle3Config):
        shape = (f"EAGLE-3: fc over three target layers' features ({c.target_hidden} each), one decoder layer, "
                 f"its own norm and lm_head over {k} tokens")
        use = ("Use it as any poss draft (the target runner then returns those layers' hidden states): "
               "`poss generate --target T --draft THIS_FOLDER`; `poss export --format eagle3` writes it back "
               "in the published layout, bit for bit.")
    else:
        shape = (f"{c.n_specialists} decoder layer(s) sharing one fc over [embedding; feature] "
                 f"(fc bias: {'yes' if c.fc_bias else 'no'}), position p drafted by layer "
                 f"min((p - 1) // {c.positions_per_specialist}, {c.n_specialists - 1}); head: the target's, "
                 f"scoring {k} tokens")
        use = "Use it as any poss draft: `poss generate --target T --draft THIS_FOLDER`, `poss.load(T, draft=...)`."
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in conv.state.values() if t.is_floating_point()})
    ignored = ", ".join(f"`{n}`" for n in conv.ignored) or "none"
    return (f"# {LAYOUT_NAMES[conv.layout]} draft imported into poss\n\n"
            f"Converted by `poss import` from a published {LAYOUT_NAMES[conv.layout]} checkpoint.\n\n"
            f"- **Source:** `{source}`: {conv.file_format}, {len(conv.files)} file(s): {files}.\n"
            f"- **Layout:** {shape}; hidden {c.hidden}, {c.heads} heads / {c.kv_heads} KV heads of {c.head_dim}, "
            f"FFN {c.ffn}, vocabulary {c.vocab}.\n"
            f"- **Target:** `{target_name}` (fingerprint `{fingerprint}`), checked on import: hidden size, "
            f"vocabulary{', the embedding' if conv.embed is not None else ''}; loading checks the fingerprint.\n"
            f"- **Conversion:** {mapping} Weights keep their bits and dtype ({', '.join(dtypes)}). "
            f"Not kept: {ignored} (the target's own tensors are shared).\n\n{use}\n")


_EAGLE_MAPPING = ("`self_attn.{q,k,v}_proj` rows concatenated into `qkv_proj`, `mlp.{gate,up}_proj` into "
                  "`gate_up_proj`, `post_attention_layernorm` is `post_norm`.")
_EAGLE3_MAPPING = ("`midlayer` is `layers.0`, q/k/v and gate/up rows concatenated, `input_layernorm` / "
                   "`hidden_norm` / `post_attention_layernorm` are `input_norm` / `hidden_norm` / "
                   "`post_norm`, `d2t[i] + i` is `token_map[i]`.")


def import_draft(folder, runner, out, target_name: str, positions_per_specialist: Optional[int] = None) -> Path:
    """Convert the published draft in ``folder`` for ``runner``'s target into poss's format in ``out``,
    with a README model card saying where it came from. ``ValueError`` (one line) when the draft was made
    for another target, or the folder is not a complete published layout."""
    from poss.models.draft import PosSDraft

    src = Path(folder)
    if layout_of(src) in ("poss", "poss-eagle3"):
        raise ValueError(f"{src} is already in poss's format (no HF-style config.json with hidden_size)")
    conv = read_published(src, positions_per_specialist)
    check_target(conv, runner, str(src))
    fingerprint = runner.fingerprint()
    out = Path(out)
    config = replace(conv.config, target_name=target_name, target_fingerprint=fingerprint)
    if isinstance(config, Eagle3Config):
        Eagle3Draft(config, conv.state).save(out)
        mapping = _EAGLE3_MAPPING
    else:
        model = PosSDraft(config)
        model.load_state_dict(conv.state, strict=True)
        # load_state_dict copies into fp32 parameters; keep the file's dtype so the weights stay bit for bit.
        model.to(next(iter(conv.state.values())).dtype)
        model.save(out)
        mapping = _EAGLE_MAPPING
    (out / "README.md").write_text(_import_card(conv, str(folder), target_name, fingerprint, mapping))
    return out


def _export_card(layout: str, config, files: List[Path], with_map: bool, with_embed: bool) -> str:
    names = ", ".join(f"`{p.name}`" for p in files)
    lines = [f"# poss draft exported in the {LAYOUT_NAMES[layout]} layout\n",
             f"Written by `poss export --format {layout}` from a poss draft for `{config.target_name or 'unknown'}` "
             f"(fingerprint `{config.target_fingerprint or 'not recorded'}`): {names}.",
             "`config.json` keeps poss's own config under `poss`; `poss import` / `poss.load` read it back.", ""]
    if with_map:
        lines.append(f"The draft scores {config.draft_vocab} of {config.vocab} tokens: `{TOKEN_MAP_FILE}` lists "
                     "them (SGLang: `--speculative-token-map`); engines that do not read it score all of them.")
    if not with_embed and layout != "eagle3":
        lines.append("No `embed_tokens.weight`: engines share the target's embedding.")
    lines.append("Which engine loads it and how: docs/interop.md in poss.")
    return "\n".join(lines) + "\n"


def export_draft(folder, layout: str, out, embed: Optional[Tensor] = None, file_format: str = "safetensors",
                 max_shard_bytes: Optional[int] = None, max_positions: int = 2048) -> List[Path]:
    """Write the poss draft in ``folder`` in ``layout`` (one of :data:`LAYOUTS`) into ``out``; returns the
    files written. ``embed [V, H]``: the target's embedding, written as ``embed_tokens.weight``
    (required by ``poss-ref``). ``file_format`` / ``max_shard_bytes``: as
    :func:`~poss.models.checkpoint_files.write_weights`. ``max_positions``: the config's
    ``max_position_embeddings`` (the target's context length)."""
    from safetensors.torch import load_file

    if layout not in LAYOUTS:
        raise ValueError(f"format must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if file_format not in FILE_FORMATS:
        raise ValueError(f"file format must be one of {', '.join(FILE_FORMATS)}, got {file_format!r}")
    src = Path(folder)
    kind = layout_of(src)
    if kind not in ("poss", "poss-eagle3"):
        raise ValueError(f"{src} is a published {LAYOUT_NAMES[kind]} folder, not a poss draft: `poss import` it first")
    token_map = None
    if kind == "poss-eagle3":
        if layout != "eagle3":
            raise ValueError(f"{src} holds EAGLE-3 weights, which only the eagle3 layout can hold")
        draft = Eagle3Draft.load(src)
        state, cfg = to_eagle3(draft, embed)
        config = draft.config
    else:
        config = DraftConfig.load(src / "config.json")
        if config.features == "eagle3":  # an EAGLE-3 draft poss trained
            if layout != "eagle3":
                raise ValueError(f"{src} is an EAGLE-3 draft (fc over target layers, its own head), which only the "
                                 "eagle3 layout can hold")
            draft = Eagle3Draft(from_draft_config(config), load_file(str(src / "model.safetensors")))
            state, cfg = to_eagle3(draft, embed)
            config = draft.config
        elif layout == "eagle3":
            raise ValueError(f"{src} is an EAGLE-2-style draft (fc over [embedding; feature]); the eagle3 layout "
                             "holds EAGLE-3 drafts (fc over three target layers): use --format eagle or poss-ref")
        else:
            state, cfg, token_map = to_eagle(config, load_file(str(src / "model.safetensors")), layout, embed,
                                             max_positions)
    out = Path(out)
    files = write_weights(out, state, file_format, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    files.append(out / "config.json")
    if token_map is not None:
        torch.save(token_map.to(torch.int64).clone(), str(out / TOKEN_MAP_FILE))
        files.append(out / TOKEN_MAP_FILE)
    (out / "README.md").write_text(_export_card(layout, config, files, token_map is not None, embed is not None))
    return files + [out / "README.md"]
