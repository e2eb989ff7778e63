"""Tiny random HF targets (Llama, Qwen2, Mistral) for the target-runner and draft tests."""

import torch

from poss.data import EVAL_SETS, load_eval_set


def tiny_model(kind="llama", seed=0, **over):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(vocab_size=300, hidden_size=256, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=10000.0)
    common.update(over)
    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
           "mistral": (MistralConfig, MistralForCausalLM)}[kind]
    cfg = cls[0](**common)
    cfg._attn_implementation = "eager"
    model = cls[1](cfg).eval()
    # Random init leaves the norm weights at 1 and biases at 0; perturb them so they are tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def eval_prompts(n, max_len, vocab, seed=0):
    """Prompts from the eval sets, encoded as bytes folded into the tiny vocab."""
    lines = [r for name in sorted(EVAL_SETS) for r in load_eval_set(name)]
    texts = [lines[(seed * 37 + 11 * i) % len(lines)]["turns"][0] for i in range(n)]
    return [[b % vocab for b in t.encode()][:max_len] for t in texts]


def tiny_chat_folder(root, drafts=()):
    """A tiny random Llama with a ChatML byte tokenizer saved as an HF folder ``root/target``, and one
    random draft per ``(name, n_specialists, draft_vocab)`` in ``drafts`` saved as ``root/name``."""
    from helpers.train_tiny import byte_tokenizer
    from poss.models.target import TargetRunner
    from poss.testing import random_draft, tiny_target

    model = tiny_target(vocab=300)
    tok = byte_tokenizer()
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    runner = TargetRunner(model, max_batch=1, max_seq=64)
    for name, n, vocab in drafts:
        random_draft(runner, n=n, ppl=1, aligned=True, draft_vocab=vocab).save(root / name)
    return root
