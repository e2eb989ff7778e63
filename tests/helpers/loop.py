"""Tiny random targets and drafts for the loop tests (from :mod:`poss.testing`), plus the independent
references they use."""

import pytest
import torch

from poss.testing import eval_prompts, make_generator, random_draft, tiny_target  # noqa: F401


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Loop tests run on one CPU thread: the tiny models' steps are microseconds of math, so more
    OpenMP threads only add synchronisation (and spin-waits on a busy 2-core host cost several x)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def hf_greedy(model, prompt, max_new_tokens, **kw):
    """``transformers`` greedy continuation of one prompt (end token included, as HF returns it), on
    the model's device."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, num_beams=1, **kw)
    return out[0, len(prompt):].tolist()


def assert_lossless_in_dtype(dtype, fp32_model, prompts, got, want) -> int:
    """Speculation (``got``) against our AR loop (``want``), both in ``dtype``. Where poss::linear runs
    one of our row-invariant kernels for ``dtype`` (bf16 on AVX512-BF16 or AVX2, fp32 on AVX2 + FMA)
    they must be identical; with the vendor GEMM a path may part at a near-tie (see
    :func:`assert_divergences_are_near_ties`). Returns how many parted."""
    import poss_ext

    if poss_ext.ops.cpu_linear_kernel(dtype) != "aten":
        for i, (g, w) in enumerate(zip(got, want)):
            first = next((k for k, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            assert g == w, f"prompt {i}: speculation parts from decoding in {dtype} at token {first}"
        return 0
    return assert_divergences_are_near_ties(fp32_model, prompts, got, want)


def assert_divergences_are_near_ties(fp32_model, prompts, got, want, tolerance: float = 0.05) -> int:
    """bf16 speculation against the bf16 AR loop: where a greedy path parts from ``want``, the fp32
    model's logits there must nearly tie between the two tokens (gap below ``tolerance`` x the largest
    logit magnitude): a rounding difference, not a wrong acceptance rule. Returns how many parted."""
    parted = 0
    for p, g, w in zip(prompts, got, want):
        if g == w:
            continue
        parted += 1
        k = next(i for i in range(min(len(g), len(w))) if g[i] != w[i])
        with torch.no_grad():
            ref = fp32_model(torch.tensor([p + w[:k]])).logits[0, -1].float()
        gap = float(ref[w[k]] - ref[g[k]])
        assert abs(gap) < tolerance * float(ref.abs().max()), f"divergence at token {k} is not a near-tie (gap {gap})"
    return parted


class ByteTokenizer:
    """A 256-token byte-level tokenizer (no chat template, no special tokens) for stop-string tests."""

    eos_token_id = None
    eos_token = None
    chat_template = None

    def get_vocab(self):
        return {}

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")
