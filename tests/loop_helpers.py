"""Tiny random targets and drafts for the loop tests, plus the independent references they use."""

import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from poss.decode.generator import Generator
from poss.models.draft import PosSDraft
from poss.models.draft_config import DraftConfig
from poss.models.target import TargetRunner

EVAL = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "eval"
if not EVAL.exists():
    EVAL = Path("/work/shared/data/eval")


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Loop tests run on one CPU thread: the tiny models' steps are microseconds of math, so more
    OpenMP threads only add synchronisation (and spin-waits on a busy 2-core host cost several x)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
SETS = ("alpaca", "gsm8k", "humaneval", "mt_bench", "qa", "sum")


def tiny_target(vocab=300, layer_scale=0.1, seed=0, dtype=torch.float32, **over):
    """A random HF Llama. ``layer_scale < 1`` shrinks what the layers add to the residual stream, so
    the next token depends mostly on the current one (a draft can then learn nothing and still agree
    with it often: a cheap way to exercise long accepted paths)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab, hidden_size=256, intermediate_size=192, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=2,
               bos_token_id=1, pad_token_id=0)
    cfg.update(over)
    config = LlamaConfig(**cfg)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(layer_scale)
    return model.to(dtype)


def random_draft(runner, n=1, ppl=1, seed=0, aligned=False):
    """A randomly initialised PosS draft on ``runner``. ``aligned``: fc passes the token embedding
    through and the specialists add little, so the draft guesses the target's bigram map."""
    cfg = DraftConfig.for_target(runner.config, "tiny", runner.fingerprint(), n_specialists=n,
                                 positions_per_specialist=ppl, fc_bias=True)
    torch.manual_seed(seed)
    d = PosSDraft(cfg)
    H = cfg.hidden
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.copy_(torch.randn_like(p) * (0.05 if p.dim() == 2 else 0.2) + (1.0 if "post_norm" in name else 0.0))
        if aligned:
            d.fc.weight.mul_(0.1)
            d.fc.weight[:, :H] += torch.diag(runner.final_norm_w.float())  # the target head sees norm(h) * w
            d.fc.bias.zero_()
            for layer in d.layers:
                layer.o_proj.weight.mul_(0.02)
                layer.down_proj.weight.mul_(0.02)
    return d.to(runner.dtype).attach(runner, max_batch=1, max_seq=64)


def make_generator(model, draft=None, dtype=None, **draft_kw):
    runner = TargetRunner(model, max_batch=1, max_seq=64, dtype=dtype)
    d = random_draft(runner, **draft_kw) if draft else None
    eos = model.generation_config.eos_token_id
    return Generator(runner, draft=d, end_ids={eos} if eos is not None else set())


def eval_prompts(n_per_set=4, max_len=48, vocab=300):
    """``6 * n_per_set`` prompts, ``n_per_set`` from each eval set, as UTF-8 bytes folded into the vocab."""
    out = []
    for name in SETS:
        lines = [json.loads(l) for l in open(EVAL / f"{name}.jsonl") if l.strip()]
        for i in range(n_per_set):
            text = lines[(17 * i + 3) % len(lines)]["turns"][0]
            out.append([b % vocab for b in text.encode()][:max_len])
    return out


def hf_greedy(model, prompt, max_new_tokens, **kw):
    """``transformers`` greedy continuation of one prompt (end token included, as HF returns it)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, num_beams=1, **kw)
    return out[0, len(prompt):].tolist()


class ByteTokenizer:
    """A 256-token byte-level tokenizer (no chat template, no special tokens) for stop-string tests."""

    eos_token_id = None
    eos_token = None
    chat_template = None

    def get_vocab(self):
        return {}

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")
