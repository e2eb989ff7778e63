"""Published draft layouts: EAGLE-1/2 and HASS, the PosS reference and EAGLE-3, in and out.

Checkpoints are written as the reference code writes them (tests/helpers/published.py, independent of
poss.models.published), in every file form (safetensors, bin, sharded), from random weights and from the
shipped SmolLM2 drafts; imports are checked bit for bit, by an independent forward from the
reference's names, by greedy decoding (same tokens and the same acceptance per round as the draft in
poss's own format) and by the chi-square sampling test.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from helpers.loop import hf_greedy, single_thread  # noqa: F401  (autouse: one CPU thread)
from helpers.published import econfig, random_eagle3, write_eagle
from poss.cli import main
from poss.decode.generator import Generator
from poss.decode.params import TreeParams
from poss.models.checkpoint_files import read_weights, write_weights
from poss.models.draft import PosSDraft
from poss.models.draft_config import DraftConfig
from poss.models.draft_interop import export_draft, import_draft
from poss.models.eagle3_draft import Eagle3Draft
from poss.models.published import TOKEN_MAP_FILE, layout_of, read_published
from poss.models.target import TargetRunner, chain_parents
from poss.testing import eval_prompts, random_draft, tiny_target

REPO = Path(__file__).resolve().parents[2]
FILE_FORMATS = ["safetensors", "bin", "sharded-safetensors", "sharded-bin"]
TREE = TreeParams(num_nodes=12, depth=4, beam_width=4)


@pytest.fixture(scope="module")
def model():
    return tiny_target(vocab=300, seed=4)


@pytest.fixture(scope="module")
def runner(model):
    return TargetRunner(model, max_batch=1, max_seq=64)


def assert_same_tensors(a: dict, b: dict):
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def decode(runner, draft, prompts, n=24):
    """Greedy token ids and per-prompt acceptance histograms with ``draft`` attached to ``runner``."""
    gen = Generator(runner, draft=draft.attach(runner, 1, 64), end_ids=set())
    res = gen.generate(prompts, n, tree=TREE)
    return res.token_ids, [s.accept_hist for s in res.stats]


# -- EAGLE-1/2, HASS and the PosS reference ----------------------------------------------------------------
@pytest.mark.parametrize("fmt", FILE_FORMATS)
def test_eagle_checkpoint_imports_bit_for_bit_in_every_file_form(runner, tmp_path, fmt):
    ours = random_draft(runner, n=1, seed=1).to(torch.float16)
    folder = write_eagle(tmp_path / "e", ours, runner=runner, fmt=fmt)
    assert layout_of(folder) == "eagle"
    conv = read_published(folder)
    assert_same_tensors(conv.state, ours.state_dict())
    assert conv.config.n_specialists == 1 and conv.config.fc_bias and conv.ignored == ["embed_tokens.weight"]
    assert torch.equal(conv.embed, runner.embed.to(torch.float16))


def test_imported_eagle_layer_matches_an_independent_forward_from_the_reference_names(runner, tmp_path):
    """q/k/v and gate/up land where the reference's forward uses them: our fused step on the imported
    draft equals a plain forward written from the published tensors (cnets1.py's layer 0)."""
    ours = random_draft(runner, n=1, seed=2)
    folder = write_eagle(tmp_path / "e", ours)
    w = read_weights(folder)[0]
    draft = PosSDraft.load(folder).attach(runner, 1, 64)
    T, c = 9, draft.config
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, c.vocab, (1, T), generator=g)
    feats = torch.randn(1, T, c.hidden, generator=g)
    pos = torch.arange(T).view(1, T)
    got = draft.step(0, tokens, feats, pos, chain_parents([T], T), torch.zeros(1, dtype=torch.int32))

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_eps) * weight

    def rot(x):
        ang = pos.view(T, 1).float() * runner.inv_freq
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        return x * cos + torch.cat([-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]], -1) * sin

    p = "layers.0."
    u = F.linear(torch.cat([runner.embed[tokens], feats], -1), w["fc.weight"], w["fc.bias"])[0]
    q = rot(F.linear(u, w[p + "self_attn.q_proj.weight"]).view(T, c.heads, c.head_dim).transpose(0, 1))
    k = rot(F.linear(u, w[p + "self_attn.k_proj.weight"]).view(T, c.kv_heads, c.head_dim).transpose(0, 1))
    v = F.linear(u, w[p + "self_attn.v_proj.weight"]).view(T, c.kv_heads, c.head_dim).transpose(0, 1)
    rep = c.heads // c.kv_heads
    att = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0), is_causal=True)
    h = u + F.linear(att.transpose(0, 1).reshape(T, -1), w[p + "self_attn.o_proj.weight"])
    n = rms(h, w[p + "post_attention_layernorm.weight"])
    want = h + F.linear(F.silu(F.linear(n, w[p + "mlp.gate_proj.weight"])) * F.linear(n, w[p + "mlp.up_proj.weight"]),
                        w[p + "mlp.down_proj.weight"])
    torch.testing.assert_close(got[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n,fmt", [(1, "safetensors"), (3, "sharded-bin")])
def test_imported_draft_decodes_as_the_same_draft_in_poss_format(model, runner, tmp_path, n, fmt):
    ours = random_draft(runner, n=n, ppl=2, aligned=True, seed=3)
    ppl = 2 if n > 1 else None
    folder = write_eagle(tmp_path / "pub", ours, runner=runner, fmt=fmt, position_per_layer=ppl)
    assert layout_of(folder) == ("poss-ref" if n > 1 else "eagle")
    imported = PosSDraft.load(folder)
    assert imported.config.n_specialists == n and imported.config.positions_per_specialist == (ppl or 1)
    prompts = eval_prompts(1, 24, 300)[:3]
    got_ids, got_hist = decode(runner, imported, prompts)
    want_ids, want_hist = decode(runner, ours, prompts)
    assert got_ids == want_ids and got_hist == want_hist
    assert sum(sum(h[1:]) for h in got_hist) > 0  # draft tokens were accepted: the draft matters here
    assert got_ids[0] == hf_greedy(model, prompts[0], 24)


def test_poss_reference_needs_its_positions_per_layer(runner, tmp_path):
    ours = random_draft(runner, n=3, seed=5)
    folder = write_eagle(tmp_path / "ref", ours, runner=runner)
    with pytest.raises(ValueError, match="position_per_layer.*--positions-per-specialist"):
        PosSDraft.load(folder)
    conv = read_published(folder, positions_per_specialist=2)
    assert conv.layout == "poss-ref" and conv.config.positions_per_specialist == 2
    assert_same_tensors(conv.state, ours.state_dict())


@pytest.mark.parametrize("drop,names", [
    (["layers.0.mlp.up_proj.weight"], ["layers.0.mlp.up_proj.weight"]),
    (["fc.bias", "layers.1.self_attn.k_proj.weight"], ["fc.bias", "layers.1.self_attn.k_proj.weight"]),
])
def test_a_partial_checkpoint_is_refused_listing_the_missing_tensors(runner, tmp_path, drop, names):
    ours = random_draft(runner, n=2, seed=6)
    folder = write_eagle(tmp_path / "p", ours, runner=runner, position_per_layer=1, drop=drop)
    with pytest.raises(ValueError, match="not a complete PosS reference checkpoint: missing") as e:
        PosSDraft.load(folder)
    for name in names:
        assert name in str(e.value)


def test_unknown_and_unsupported_layouts_are_refused(runner, tmp_path):
    ours = random_draft(runner, n=1, seed=7)
    folder = write_eagle(tmp_path / "x", ours)
    w, _, _ = read_weights(folder)
    write_weights(folder, {**w, "layers.0.self_attn.q_proj.bias": torch.zeros(4)})
    with pytest.raises(ValueError, match="does not have: layers.0.self_attn.q_proj.bias"):
        PosSDraft.load(folder)
    layer1 = {k.replace("layers.0.", "layers.1."): v for k, v in w.items() if k.startswith("layers.0.")}
    write_weights(folder, {**w, **layer1, "layers.1.input_layernorm.weight": torch.ones(256)})
    with pytest.raises(ValueError, match="input norm"):
        PosSDraft.load(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="holds no weights: expected one of model.safetensors"):
        PosSDraft.load(folder)


def test_a_draft_for_another_target_is_refused_in_one_line(runner, model, tmp_path):
    ours = random_draft(runner, n=1, seed=8)
    narrow = TargetRunner(tiny_target(vocab=300, hidden_size=128, intermediate_size=96), max_batch=1, max_seq=16)
    other_vocab = TargetRunner(tiny_target(vocab=320, seed=4), max_batch=1, max_seq=16)
    other_weights = TargetRunner(tiny_target(vocab=300, seed=9), max_batch=1, max_seq=16)
    plain = write_eagle(tmp_path / "plain", ours)
    cases = [(narrow, "hidden"), (other_vocab, "vocabulary")]
    for target, what in cases:
        with pytest.raises(ValueError, match=what) as e:
            import_draft(plain, target, tmp_path / "out", "t")
        assert "\n" not in str(e.value)
        with pytest.raises(ValueError, match=what):
            PosSDraft.load(plain).attach(target, 1, 16)
    with_embed = write_eagle(tmp_path / "emb", ours, runner=runner)
    with pytest.raises(ValueError, match="embed_tokens.weight differs from this target's embedding"):
        import_draft(with_embed, other_weights, tmp_path / "out", "t")
    # An export records the target's fingerprint; the import checks it.
    ours.save(tmp_path / "poss")
    export_draft(tmp_path / "poss", "eagle", tmp_path / "exp")
    with pytest.raises(ValueError, match="different weights"):
        PosSDraft.load(tmp_path / "exp").attach(other_weights, 1, 16)
    with pytest.raises(ValueError, match="was made for target weights"):
        import_draft(tmp_path / "exp", other_weights, tmp_path / "out", "t")


def test_import_writes_poss_format_with_a_model_card(runner, tmp_path):
    ours = random_draft(runner, n=1, seed=10, draft_vocab=40).to(torch.float16)
    folder = write_eagle(tmp_path / "e", ours, runner=runner, fmt="bin")
    torch.save(ours.token_map.clone(), str(folder / TOKEN_MAP_FILE))  # SGLang's --speculative-token-map file
    out = import_draft(folder, runner, tmp_path / "ours", "tiny")
    assert layout_of(out) == "poss"
    assert_same_tensors(load_file(str(out / "model.safetensors")), ours.state_dict())
    cfg = DraftConfig.load(out / "config.json")
    assert cfg.target_fingerprint == runner.fingerprint() and cfg.draft_vocab == 40
    card = (out / "README.md").read_text()
    for needle in ("EAGLE-1 / EAGLE-2 / HASS", str(folder), "pytorch_model.bin", runner.fingerprint(), "float16",
                   "`embed_tokens.weight`"):
        assert needle in card, needle


def test_chi_square_sampling_with_an_imported_draft(tmp_path):
    """The sampling-exactness test of tests/decode/test_loop_sampling.py, on a PosS reference checkpoint."""
    from helpers.sampling import V, chi2_pvalue, exact_distribution, sample

    m = tiny_target(vocab=V, seed=3)
    with torch.no_grad():
        m.lm_head.weight.mul_(6.0)
    r = TargetRunner(m, max_batch=1, max_seq=64)
    folder = write_eagle(tmp_path / "ref", random_draft(r, n=3, ppl=1, aligned=True), runner=r, position_per_layer=1)
    gen = Generator(r, draft=PosSDraft.load(folder).attach(r, 1, 64), end_ids=set())
    counts, accepted = sample(gen, calls=40, depth=3, num_nodes=12, beam_width=4)
    probs = exact_distribution(m)
    assert counts[probs == 0].sum() == 0
    assert chi2_pvalue(counts, probs) > 1e-3
    assert 0 < accepted < 2 * counts.sum()


# -- export and round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("name,layout", [("eagle2", "eagle"), ("hass", "eagle"), ("poss2", "poss-ref")])
@pytest.mark.parametrize("file_format,shard", [("safetensors", None), ("bin", 2_000_000)])
def test_shipped_drafts_round_trip_bit_for_bit(tmp_path, name, layout, file_format, shard):
    src = REPO / "drafts" / name
    config = DraftConfig.load(src / "config.json")
    embed = torch.randn(config.vocab, config.hidden) if layout == "poss-ref" else None
    export_draft(src, layout, tmp_path / "x", embed=embed, file_format=file_format, max_shard_bytes=shard)
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    # The fields the reference loaders read (EConfig, "bias", the PosS flags).
    assert cfg["hidden_size"] == config.hidden and cfg["num_key_value_heads"] == config.kv_heads
    assert cfg["bias"] is config.fc_bias and cfg["vocab_size"] == config.vocab
    assert cfg["hidden_size"] == cfg["num_attention_heads"] * config.head_dim  # EAGLE derives head_dim
    if layout == "poss-ref":
        assert cfg["forward_num_total"] // cfg["position_per_layer"] == config.n_specialists
    published = read_weights(tmp_path / "x")[0]
    assert all(t.dtype == torch.float16 for t in published.values())
    assert ("embed_tokens.weight" in published) == (layout == "poss-ref")
    back = read_published(tmp_path / "x")
    assert back.config == config
    assert_same_tensors(back.state, load_file(str(src / "model.safetensors")))


def test_eagle_export_refuses_several_specialists_and_eagle3(tmp_path):
    with pytest.raises(ValueError, match="3 specialists: export it as poss-ref"):
        export_draft(REPO / "drafts" / "poss2", "eagle", tmp_path / "x")
    with pytest.raises(ValueError, match="--target"):
        export_draft(REPO / "drafts" / "poss2", "poss-ref", tmp_path / "x")
    with pytest.raises(ValueError, match="EAGLE-2-style draft"):
        export_draft(REPO / "drafts" / "hass", "eagle3", tmp_path / "x")


def test_export_then_load_decodes_the_same_through_poss_load_and_the_cli(tmp_path, capsys):
    import poss
    from helpers.targets import tiny_chat_folder

    root = tiny_chat_folder(tmp_path, [("d3", 3, 0), ("k", 1, 40)])
    kw = dict(dtype=torch.float32, tree=TREE, speculate_max_batch=None, datastore=None)
    prompts = [[b for b in "The quick brown fox".encode()], [b for b in "Hello there".encode()]]
    for name, layout in [("d3", "poss-ref"), ("k", "eagle")]:
        out = tmp_path / f"{name}-{layout}"
        assert main(["export", str(root / name), "--format", layout, "--out", str(out), "--target",
                     str(root / "target"), "--file-format", "bin"]) == 0
        assert (out / "pytorch_model.bin").is_file()
        want = poss.load(root / "target", draft=root / name, **kw).generate(prompts, 16)
        got = poss.load(root / "target", draft=out, **kw).generate(prompts, 16)
        assert got.token_ids == want.token_ids
        assert [s.accept_hist for s in got.stats] == [s.accept_hist for s in want.stats]
        back = tmp_path / f"{name}-back"
        assert main(["import", str(out), "--target", str(root / "target"), "--out", str(back)]) == 0
        assert_same_tensors(load_file(str(back / "model.safetensors")),
                            load_file(str(root / name / "model.safetensors")))
    assert main(["import", str(root / "k"), "--target", str(root / "target"), "--out", str(tmp_path / "z")]) == 2
    assert "already in poss's format" in capsys.readouterr().err


# -- EAGLE-3 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,prefix,draft_vocab", [("safetensors", "midlayer.", 40), ("sharded-bin", "midlayer.", 0),
                                                     ("bin", "layers.0.", 40)])
def test_eagle3_converts_and_exports_bit_for_bit(tmp_path, fmt, prefix, draft_vocab):
    runner = TargetRunner(tiny_target(vocab=300, hidden_size=64, num_attention_heads=4, intermediate_size=96),
                          max_batch=1, max_seq=16)
    folder, original = random_eagle3(tmp_path / "e3", fmt=fmt, prefix=prefix, draft_vocab=draft_vocab,
                                     embed=runner.embed)
    assert layout_of(folder) == "eagle3"
    conv = read_published(folder)
    assert conv.config.head_rows == (draft_vocab or 300) and conv.config.layer_prefix == prefix
    if draft_vocab:
        assert torch.equal(conv.state["token_map"], original["d2t"] + torch.arange(draft_vocab))
    out = import_draft(folder, runner, tmp_path / "ours", "tiny")
    assert layout_of(out) == "poss-eagle3" and Eagle3Draft.load(out).config.target_fingerprint == runner.fingerprint()
    assert "EAGLE-3" in (out / "README.md").read_text()
    export_draft(out, "eagle3", tmp_path / "back", embed=runner.embed)
    assert_same_tensors(read_weights(tmp_path / "back")[0], original)
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    src_cfg = json.loads((folder / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "poss"} == src_cfg
    # Both folders load as the same runnable EAGLE-3 draft, with the published tensors as they are.
    a, b = PosSDraft.load(folder, dtype=torch.float16), PosSDraft.load(out, dtype=torch.float16)
    assert a.config.features == b.config.features == "eagle3" and a.config.n_specialists == 1
    assert_same_tensors(a.state_dict(), b.state_dict())
    assert torch.equal(a.state_dict()["layers.0.qkv_proj.weight"][:64], original[prefix + "self_attn.q_proj.weight"])
    with pytest.raises(ValueError, match="own head"):
        PosSDraft.load(out, vocab="full")
    with pytest.raises(ValueError, match="only the eagle3 layout"):
        export_draft(out, "eagle", tmp_path / "no")


@pytest.fixture(scope="module")
def deep_model():
    """A 4-layer tiny target: EAGLE-3's default feature layers (2, L // 2, L - 3) are (2, 2, 1) here."""
    return tiny_target(vocab=300, seed=6, num_hidden_layers=4)


def test_imported_eagle3_matches_an_independent_forward_from_the_published_names(deep_model, tmp_path):
    """The whole EAGLE-3 draft step on the target's hidden states, written from the published tensors
    and ``transformers``' ``hidden_states`` (inputs of layers 2, L // 2, L - 3), equals our fused path:
    the runner's taps, fc, the layer (norms, [embedding; hidden] order, residual) and the own head."""
    runner = TargetRunner(deep_model, 1, 64)
    folder, w = random_eagle3(tmp_path / "e3", hidden=256, heads=4, kv_heads=2, ffn=96, vocab=300, draft_vocab=40,
                              dtype=torch.float32)
    draft = PosSDraft.load(folder)
    with pytest.raises(ValueError, match=r"hidden states \[2, 2, 1\].*set_feature_layers"):
        draft.attach(runner, 1, 64)
    runner.set_feature_layers(draft.feature_layers_for(4))
    draft.attach(runner, 1, 64)
    T, c, eps = 10, draft.config, draft.config.rms_eps
    ids = torch.randint(3, 300, (1, T + 1), generator=torch.Generator().manual_seed(0))
    _, feats = runner.prefill([ids[0, :T].tolist()])
    assert feats.shape == (1, T, 4 * 256)
    g_in = draft.draft_input(feats)
    got = draft.log_probs(draft.step(0, ids[:, 1:], g_in, torch.arange(T).view(1, T), chain_parents([T], T),
                                     torch.zeros(1, dtype=torch.int32)))

    with torch.no_grad():
        hs = deep_model(ids[:, :T], output_hidden_states=True).hidden_states
    p = "midlayer."

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rot(x):
        ang = torch.arange(T).view(T, 1).float() * runner.inv_freq
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        return x * cos + torch.cat([-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]], -1) * sin

    g = F.linear(torch.cat([hs[2], hs[2], hs[1]], -1)[0], w["fc.weight"])
    a = torch.cat([rms(runner.embed[ids[0, 1:]], w[p + "input_layernorm.weight"]),
                   rms(g, w[p + "hidden_norm.weight"])], -1)
    q = rot(F.linear(a, w[p + "self_attn.q_proj.weight"]).view(T, c.heads, c.head_dim).transpose(0, 1))
    k = rot(F.linear(a, w[p + "self_attn.k_proj.weight"]).view(T, c.kv_heads, c.head_dim).transpose(0, 1))
    v = F.linear(a, w[p + "self_attn.v_proj.weight"]).view(T, c.kv_heads, c.head_dim).transpose(0, 1)
    rep = c.heads // c.kv_heads
    att = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0), is_causal=True)
    h = g + F.linear(att.transpose(0, 1).reshape(T, -1), w[p + "self_attn.o_proj.weight"])
    n = rms(h, w[p + "post_attention_layernorm.weight"])
    h = h + F.linear(F.silu(F.linear(n, w[p + "mlp.gate_proj.weight"])) * F.linear(n, w[p + "mlp.up_proj.weight"]),
                     w[p + "mlp.down_proj.weight"])
    want = torch.log_softmax(F.linear(rms(h, w["norm.weight"]), w["lm_head.weight"]), -1)
    torch.testing.assert_close(got[0], want, rtol=1e-4, atol=1e-4)
    # Draft id i is target token i + d2t[i].
    assert torch.equal(draft.full_ids(torch.arange(40)), torch.arange(40) + w["d2t"])


def test_imported_eagle3_decodes_losslessly(deep_model, tmp_path):
    """A published EAGLE-3 folder and its `poss import` decode greedily as the target does, round for round alike."""
    runner = TargetRunner(deep_model, 1, 64, feature_layers=(2, 2, 1))
    folder, _ = random_eagle3(tmp_path / "e3", hidden=256, heads=4, kv_heads=2, ffn=96, vocab=300, draft_vocab=0,
                              dtype=torch.float32)
    out = import_draft(folder, runner, tmp_path / "ours", "tiny")
    prompts = eval_prompts(1, 24, 300)[:3]
    got_ids, got_hist = decode(runner, PosSDraft.load(folder), prompts)
    want_ids, want_hist = decode(runner, PosSDraft.load(out), prompts)
    assert got_ids == want_ids and got_hist == want_hist
    for p, ids in zip(prompts, got_ids):
        assert ids == hf_greedy(deep_model, p, 24)


def test_an_eagle3_draft_trained_by_poss_exports_and_loads_back(deep_model, tmp_path):
    """A one-layer `eagle3` draft in poss's format -> the published layout -> the same tensors and tokens;
    PosS on EAGLE-3 features (several layers) and the EAGLE-2 layouts are refused."""
    runner = TargetRunner(deep_model, 1, 64)
    ours = random_draft(runner, n=1, aligned=True, features="eagle3", draft_vocab=120)
    ours.save(tmp_path / "ours")
    export_draft(tmp_path / "ours", "eagle3", tmp_path / "pub")
    assert layout_of(tmp_path / "pub") == "eagle3"
    assert json.loads((tmp_path / "pub" / "config.json").read_text())["draft_vocab_size"] == 120
    back = PosSDraft.load(tmp_path / "pub")
    assert_same_tensors(back.state_dict(), ours.state_dict())
    prompts = eval_prompts(1, 24, 300)[:2]
    assert decode(runner, back, prompts) == decode(runner, PosSDraft.load(tmp_path / "ours"), prompts)
    with pytest.raises(ValueError, match="only the eagle3 layout"):
        export_draft(tmp_path / "ours", "eagle", tmp_path / "no")
    random_draft(runner, n=3, features="eagle3").save(tmp_path / "poss3")
    with pytest.raises(ValueError, match="one EAGLE-3 layer over three target layers.*3 specialist"):
        export_draft(tmp_path / "poss3", "eagle3", tmp_path / "no")


def test_eagle3_partial_or_inconsistent_is_refused(tmp_path):
    folder, state = random_eagle3(tmp_path / "a")
    write_weights(folder, {k: v for k, v in state.items() if k not in ("t2d", "midlayer.hidden_norm.weight")})
    with pytest.raises(ValueError, match="not a complete EAGLE-3 checkpoint: missing .*midlayer.hidden_norm.weight"
                                         ".*t2d"):
        read_published(folder)
    t2d = state["t2d"].clone()
    t2d[int(t2d.logical_not().nonzero()[0])] = True
    write_weights(folder, {**state, "t2d": t2d})
    with pytest.raises(ValueError, match="t2d does not mark exactly"):
        read_published(folder)
    cfg = econfig(64, 4, 2, 96, 300, draft_vocab_size=40, num_hidden_layers=2)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="single-layer"):
        read_published(folder)


@pytest.mark.slow
def test_smollm2_shipped_hass_exported_decodes_as_shipped(tmp_path):
    """The real target: the shipped HASS draft through the EAGLE layout and back decodes identically."""
    import poss

    export_draft(REPO / "drafts" / "hass", "eagle", tmp_path / "hass-eagle")
    kw = dict(dtype=torch.float32, tree=TreeParams(num_nodes=16, depth=4), speculate_max_batch=None, datastore=None)
    prompts = ["Give three tips for staying healthy.", "What is the capital of France?"]
    want = poss.load("smollm2-135m", draft=REPO / "drafts" / "hass", **kw).generate(prompts, 32)
    got = poss.load("smollm2-135m", draft=tmp_path / "hass-eagle", **kw).generate(prompts, 32)
    assert got.token_ids == want.token_ids
    assert [s.accept_hist for s in got.stats] == [s.accept_hist for s in want.stats]


def test_checkpoint_files_refuse_broken_shards(tmp_path):
    state = {"a": torch.arange(6.0), "b": torch.ones(3, dtype=torch.float16), "c": torch.zeros(2, dtype=torch.int64)}
    files = write_weights(tmp_path, state, "bin", max_shard_bytes=16)
    assert [f.name for f in files] == ["pytorch_model-00001-of-00003.bin", "pytorch_model-00002-of-00003.bin",
                                       "pytorch_model-00003-of-00003.bin", "pytorch_model.bin.index.json"]
    assert_same_tensors(read_weights(tmp_path)[0], state)
    index = json.loads((tmp_path / "pytorch_model.bin.index.json").read_text())
    assert index["metadata"]["total_size"] == 24 + 6 + 16
    index["weight_map"]["d"] = index["weight_map"]["a"]
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lists tensors no shard holds: d"):
        read_weights(tmp_path)
    files[1].unlink()
    with pytest.raises(ValueError, match="names shards that are not in .*pytorch_model-00002-of-00003.bin"):
        read_weights(tmp_path)
