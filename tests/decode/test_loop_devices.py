"""The whole speculative loop on each device: greedy output against ``transformers`` on the same
device, and exact sampling of the first three tokens. The CPU half runs everywhere; the CUDA half
(marked ``cuda``) is the lossless check for a lent GPU, where the loop's ops are the CUDA kernels.

On CUDA the target's GEMMs run through cuBLAS at different row counts in verify (a tree) and in HF's
decode (one row), so a greedy path may part from HF's at a near-tie of the fp32 logits; any other
parting is a wrong acceptance rule and fails.
"""

import pytest
import torch

from helpers.devices import devices
from helpers.loop import eval_prompts, hf_greedy, make_generator, single_thread, tiny_target  # noqa: F401
from helpers.sampling import V, chi2_pvalue, exact_distribution, sample

NEW = 64


def generator_on(device, model, **kw):
    with torch.device(device):  # the random draft and its caches are made where the target lives
        return make_generator(model, draft=True, **kw)


def assert_matches_hf(model, prompts, outputs, device):
    """Each output equals HF greedy on ``model``, or parts from it only at a near-tie of fp64 logits;
    at most one prompt may part."""
    parted = 0
    for p, got in zip(prompts, outputs):
        want = hf_greedy(model, p, len(got))
        if got == want:
            continue
        parted += 1
        k = next(i for i in range(len(got)) if got[i] != want[i])
        with torch.no_grad():
            ref = model.double()(torch.tensor([p + want[:k]], device=device)).logits[0, -1]
            model.float()
        gap = float(ref[want[k]] - ref[got[k]])
        assert abs(gap) < 1e-4 * float(ref.abs().max()), f"prompt {p[:8]}: parted at token {k}, not a near-tie ({gap})"
    assert parted <= 1, f"{parted} of {len(prompts)} prompts parted from HF greedy"


def greedy_target(device):
    model = tiny_target().to(device)
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("lookup", [0, 4], ids=["tree", "tree+lookup"])
@pytest.mark.parametrize("device", devices())
def test_greedy_matches_hf_on_the_same_device(device, lookup):
    model = greedy_target(device)
    prompts = eval_prompts(n_per_set=2)
    gen = generator_on(device, model, n=3, ppl=2, aligned=True)
    gen.end_ids = set()
    res = gen.generate(prompts, NEW, depth=6, num_nodes=24, lookup=lookup)
    accepted = max(k for s in res.stats for k, c in enumerate(s.accept_hist) if c)
    assert accepted >= 2, "the aligned draft should have multi-token paths accepted"
    assert_matches_hf(model, prompts, res.token_ids, device)


@pytest.mark.cuda
def test_compiled_steps_with_cuda_graphs_match_hf():
    """``compile_steps`` on CUDA: mode reduce-overhead, the caches written in place inside CUDA graphs."""
    from poss.decode.loader import compile_steps

    model = greedy_target("cuda")
    prompts = eval_prompts(n_per_set=1)
    gen = compile_steps(generator_on("cuda", model, n=3, ppl=2, aligned=True))
    gen.end_ids = set()
    outputs = []
    for i in range(0, len(prompts), 2):
        outputs += gen.generate(prompts[i: i + 2], 32, depth=3, num_nodes=8).token_ids
    assert_matches_hf(model, prompts, outputs, "cuda")


@pytest.mark.parametrize("device", devices())
def test_sampling_follows_the_target_on_the_device(device):
    model = tiny_target(vocab=V, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    probs = exact_distribution(model)  # on the CPU, in float64 after the logits
    gen = generator_on(device, model.to(device), n=3, ppl=1, aligned=True)
    counts, accepted = sample(gen, 40, depth=3, num_nodes=12, beam_width=4)
    assert counts[probs == 0].sum() == 0
    assert chi2_pvalue(counts, probs) > 1e-3
    assert 0 < accepted < 2 * counts.sum()
