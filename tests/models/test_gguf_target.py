"""A target whose linear weights stay GGUF blocks (``dtype="gguf"``): the runner against the float
runner of the same (dequantised) weights, greedy speculation token-identical to the AR loop on the same
quantized target, exact sampling (chi-square), and the real SmolLM2 file (slow).
"""

import pytest
import torch

from helpers.loop import (
    eval_prompts,
    random_draft,
    single_thread,  # noqa: F401  (autouse: one CPU thread)
    tiny_target,
)
from poss.decode.generator import Generator
from poss.models.quant_weight import QuantWeight
from poss.models.target import TargetRunner

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

FORMATS = ["q8_0", "q4_0", "q4_1"]
GGML_TYPE = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
             "q4_1": GGMLQuantizationType.Q4_1}
NEW = 64


def quantize_in_place(model, fmt):
    """Quantize every projection and the lm_head of ``model`` with gguf, return the blocks by HF name,
    and set the model's weights to their dequantised values (as a GGUF file loads in transformers)."""
    blocks = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.weight") or name == "lm_head.weight":
                q = QuantWeight(torch.from_numpy(gguf_quants.quantize(p.float().numpy(), GGML_TYPE[fmt])), fmt)
                blocks[name] = q
                p.copy_(q.dequantize())
    return blocks


def generator(model, blocks, dtype, draft):
    runner = TargetRunner(model, max_batch=1, max_seq=64, dtype=dtype, quantized=blocks)
    d = random_draft(runner, n=3, ppl=2, aligned=True) if draft else None
    eos = model.generation_config.eos_token_id
    return Generator(runner, draft=d, end_ids={eos} if eos is not None else set())


@pytest.fixture(scope="module", params=FORMATS)
def quantized(request):
    model = tiny_target()
    return model, quantize_in_place(model, request.param), request.param


@pytest.mark.parametrize("x_int8", [False, True])
def test_runner_streams_the_blocks_and_matches_the_dequantised_float_runner(quantized, x_int8, monkeypatch):
    import poss.models.quant_weight as qw

    monkeypatch.setattr(qw, "X_INT8", x_int8)
    model, blocks, fmt = quantized
    q = TargetRunner(model, max_batch=1, max_seq=64, dtype=torch.float32, quantized=blocks)
    f = TargetRunner(model, max_batch=1, max_seq=64, dtype=torch.float32)
    assert q.quantized and q.weight_formats() == {fmt: 4 * len(q.layers) + 1}
    # Kept with rows interleaved by 8 where they are whole groups of 8, the file's layout elsewhere; the
    # file's bytes either way.
    held = [getattr(p, k) for p in q.layers for k in ("w_qkv", "w_o", "w_gate_up", "w_down")] + [q.lm_head_blocks]
    assert all(w.format == (fmt + "x8" if w.shape[0] % 8 == 0 else fmt) for w in held)
    assert any(w.format.endswith("x8") for w in held)
    assert torch.equal(q.lm_head_blocks.plain().blocks, blocks["lm_head.weight"].blocks)
    assert q.fingerprint() == f.fingerprint()  # a draft trained on the float target attaches
    prompt = [eval_prompts(1)[0]]
    lq, fq = q.prefill(prompt)
    lf, ff = f.prefill(prompt)
    if not x_int8:
        # The same weights and ops; only the dot products' summation order differs (fp32 both).
        torch.testing.assert_close(lq, lf, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fq, ff, rtol=1e-4, atol=1e-4)
    else:
        # Activations rounded to 8 bits per block of 32 (at most 1/254 of the block's largest): close,
        # and not the fp32 path.
        torch.testing.assert_close(lq, lf, rtol=0.05, atol=0.05)
        torch.testing.assert_close(fq, ff, rtol=0.05, atol=0.05)
        assert not torch.equal(lq, lf)


def test_the_stats_line_names_the_block_formats(quantized):
    from poss.cli.generate import speed_line

    model, blocks, fmt = quantized
    gen = generator(model, blocks, torch.float32, draft=False)
    res = gen.generate([eval_prompts(1)[0]], 4)
    assert f"; weights {fmt} x{4 * len(gen.runner.layers) + 1};" in speed_line(res, gen)
    plain = generator(model, None, torch.float32, draft=False)
    assert "weights" not in speed_line(plain.generate([eval_prompts(1)[0]], 4), plain)


def test_mixed_formats_stay_float_where_a_fused_weight_mixes_them():
    """q and k in q4_0, v in q8_0 (as Qwen2.5's file has): the fused q|k|v runs dequantised, the
    others stay blocks."""
    model = tiny_target()
    blocks = quantize_in_place(model, "q4_0")
    v = "model.layers.0.self_attn.v_proj.weight"
    blocks[v] = QuantWeight(torch.from_numpy(gguf_quants.quantize(blocks[v].dequantize().numpy(),
                                                                  GGML_TYPE["q8_0"])), "q8_0")
    runner = TargetRunner(model, max_batch=1, max_seq=64, dtype=torch.bfloat16, quantized=blocks)
    assert isinstance(runner.layers[0].w_o, QuantWeight) and not isinstance(runner.layers[0].w_qkv, QuantWeight)
    assert isinstance(runner.layers[1].w_qkv, QuantWeight)
    assert runner.weight_formats() == {"q4_0": 4 * len(runner.layers), "bfloat16": 1}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_speculation_is_identical_to_the_ar_loop_on_the_quantized_target(quantized, dtype):
    model, blocks, fmt = quantized
    prompts = eval_prompts(n_per_set=2)
    want = generator(model, blocks, dtype, draft=False).generate(prompts, NEW).token_ids
    res = generator(model, blocks, dtype, draft=True).generate(prompts, NEW)
    for i, (g, w) in enumerate(zip(res.token_ids, want)):
        assert g == w, f"{fmt} {dtype}: prompt {i} parts at token {next(k for k in range(len(g)) if g[k] != w[k])}"
    # multi-token paths were really verified
    assert max(k for s in res.stats for k, c in enumerate(s.accept_hist) if c) >= 2


@pytest.mark.parametrize("fmt, draft_vocab", [("q4_1", 0), pytest.param("q4_0", 12, marks=pytest.mark.slow)])
def test_sampling_follows_the_quantized_target(fmt, draft_vocab):
    """The chi-square test of tests/decode/test_loop_sampling.py on a quantized target (its lm_head too,
    so the draft's head runs the target's head blocks, all rows or a reduced vocabulary's): the first
    three sampled tokens of speculation follow the distribution of the model the blocks decode to."""
    from helpers.sampling import V, chi2_pvalue, exact_distribution, sample

    model = tiny_target(vocab=V, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    blocks = quantize_in_place(model, fmt)
    probs = exact_distribution(model)
    runner = TargetRunner(model, max_batch=1, max_seq=64, dtype=torch.float32, quantized=blocks)
    gen = Generator(runner, draft=random_draft(runner, n=3, ppl=1, aligned=True, draft_vocab=draft_vocab))
    assert gen.draft._head_blocks is not None
    counts, accepted = sample(gen, calls=40, depth=3, num_nodes=12, beam_width=4)
    assert counts[probs == 0].sum() == 0
    assert chi2_pvalue(counts, probs) > 1e-3
    assert 0 < accepted < 2 * counts.sum()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_reduced_vocab_draft_scores_the_target_head_rows_exactly(quantized, dtype):
    """The draft's head on a quantized lm_head: the rows of its token map, gathered as whole block rows,
    decode to the file's values exactly, and its logits are the target head's columns bit for bit."""
    model, blocks, fmt = quantized
    runner = TargetRunner(model, max_batch=1, max_seq=64, dtype=dtype, quantized=blocks)
    draft = random_draft(runner, n=1, draft_vocab=100)
    head = draft._head_blocks
    assert head.format == fmt and head.blocks.shape[0] == 100
    assert torch.equal(head.dequantize(), blocks["lm_head.weight"].dequantize()[draft.token_map])
    x = torch.randn(5, runner.hidden_size).to(dtype)
    assert torch.equal(draft.logits(x), runner.logits(x)[:, draft.token_map])
    # A float target keeps the float rows.
    assert random_draft(TargetRunner(model, max_batch=1, max_seq=64, dtype=dtype), draft_vocab=100)._head_blocks is None


def test_bad_blocks_are_refused_at_load_naming_the_weight():
    model = tiny_target()
    blocks = quantize_in_place(model, "q4_1")
    name = "model.layers.1.mlp.down_proj.weight"
    good = blocks[name]

    def runner_with(q, key=name):
        return TargetRunner(model, max_batch=1, max_seq=64, dtype=torch.float32, quantized={**blocks, key: q})

    short = QuantWeight(good.blocks[:, :-20].contiguous(), "q4_1")  # one block of 32 weights short per row
    with pytest.raises(ValueError, match=rf"quantized\['{name}'\]: q4_1 blocks .* expected \[256, 192\]"):
        runner_with(short)
    with pytest.raises(ValueError, match="expected"):
        runner_with(QuantWeight(good.blocks[:-1].contiguous(), "q4_1"))  # a row missing
    with pytest.raises(ValueError, match="not a whole number of q4_1 blocks"):
        QuantWeight(good.blocks[:, :-3].contiguous(), "q4_1")
    for field, at in (("scale", 0), ("min", 2)):
        bad = good.blocks.clone()
        bad[7, 3 * 20 + at: 3 * 20 + at + 2] = torch.tensor([float("nan")], dtype=torch.float16).view(torch.uint8)
        with pytest.raises(ValueError, match=rf"{name}.*1 q4_1 block\(s\) with an inf or NaN {field}, "
                                             "the first at row 7, block 3"):
            runner_with(QuantWeight(bad, "q4_1"))
    with pytest.raises(ValueError, match="'model.layers.9.mlp.up_proj.weight' is not a weight"):
        runner_with(good, "model.layers.9.mlp.up_proj.weight")


def test_a_gguf_file_with_an_inf_scale_is_refused_naming_the_tensor(tmp_path):
    from gguf import GGUFReader

    from helpers.gguf_files import write_gguf
    from poss.models.gguf_weights import read_gguf_linears

    path = write_gguf(tiny_target(), tmp_path / "bad.gguf", layers="q8_0")
    t = next(t for t in GGUFReader(str(path)).tensors if t.name == "blk.1.ffn_up.weight")
    data = bytearray(path.read_bytes())
    at = t.data_offset + 2 * 8 * 34 + 34  # row 2 (of 8 blocks), block 1: its fp16 scale
    data[at:at + 2] = torch.tensor([float("inf")], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"bad.gguf: tensor blk.1.ffn_up.weight: 1 q8_0 block\(s\) with an inf "
                                         r"or NaN scale, the first at row 2, block 1"):
        read_gguf_linears(path, 4, 2)


def test_gguf_dtype_needs_a_gguf_file_and_the_cpu(tmp_path):
    from poss.decode.loader import gguf_blocks

    with pytest.raises(ValueError, match="needs a GGUF target"):
        gguf_blocks(tmp_path, "cpu")
    with pytest.raises(ValueError, match="CPU only"):
        gguf_blocks("smollm2-135m", "cuda")


@pytest.mark.slow
def test_real_smollm2_blocks_are_the_dequantised_weights_and_speculation_is_lossless():
    """The shipped Q4_1 file: every block read (q/k rows unpermuted) decodes to the weight transformers
    loaded, bit for bit; greedy speculation with the shipped draft on the blocks equals our AR loop on them."""
    import poss
    from poss.decode.params import TreeParams
    from poss.models.gguf_weights import read_gguf_linears
    from poss.models.registry import fetch_gguf, load_model

    _, model = load_model("smollm2-135m")
    cfg = model.config
    linears = read_gguf_linears(fetch_gguf("smollm2-135m"), cfg.num_attention_heads, cfg.num_key_value_heads)
    assert linears.dequantised() == {}
    assert {linears.types[k] for k in linears.types} == {"Q4_1", "Q8_0"}  # lm_head: the tied Q8_0 token_embd
    params = dict(model.named_parameters())
    for name, q in linears.blocks.items():
        want = params.get(name, params["model.embed_tokens.weight"])
        assert torch.equal(q.dequantize(), want), name
    spec = poss.load("smollm2-135m", draft=poss.shipped_draft("smollm2-135m"), dtype="gguf",
                     tree=TreeParams(num_nodes=16, depth=4), speculate_max_batch=None)
    ar = poss.load("smollm2-135m", dtype="gguf")
    assert ar.runner.weight_formats() == {"q4_1": 4 * cfg.num_hidden_layers, "q8_0": 1}
    from poss.data import load_eval_set

    texts = [load_eval_set(name)[1]["turns"][0] for name in ("gsm8k", "humaneval", "qa", "mt_bench")]
    prompts = [spec.encode(t) for t in texts]
    got, want = spec.generate(prompts, 48).token_ids, ar.generate(prompts, 48).token_ids
    assert got == want
