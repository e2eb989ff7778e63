"""Model-level benchmarks (SmolLM2-135M shapes, CPU).

1. ``specialist_forward`` (one fused op call) vs the same specialist as eager nn.Modules, for
   T in {1, 10, 60} new tokens behind a 512-token draft cache. Two eager baselines:
   ``hf_layer``: EAGLE's layout, transformers' own ``LlamaDecoderLayer`` (eager attention, input
   norm removed) with a DynamicCache and a precomputed additive tree mask, after ``fc``;
   ``eager_packed``: our plain-PyTorch ``Specialist.forward`` (packed q|k|v and gate|up weights,
   SDPA with a dense tree mask), the reference the tests compare against.
2. The target runner's 1-token and 60-token (tree) step vs HF's eager forward with a 512-token
   KV cache, on the real SmolLM2-135M (fetched and converted once; skipped if unavailable).

Run: ``PYTHONPATH=.:python pytest bench/bench_models.py --benchmark-only``
``POSS_BENCH_THREADS=1`` pins torch to one thread: on a shared machine, OpenMP barriers of a
2-thread run wait on descheduled threads and the timings measure the neighbours, not the code.
"""

import inspect
import os

import pytest
import torch

from poss.models.draft import PosSDraft
from poss.models.draft_config import DraftConfig
from poss.models.target import TargetRunner, chain_parents

PREFIX = 512
if os.environ.get("POSS_BENCH_THREADS"):
    torch.set_num_threads(int(os.environ["POSS_BENCH_THREADS"]))
SMOL = dict(hidden=576, heads=9, kv_heads=3, head_dim=64, ffn=1536, vocab=49152, rms_eps=1e-5)


def random_tree(B, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((B, N), -1, dtype=torch.int32)
    depth = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        for i in range(1, N):
            parents[b, i] = int(torch.randint(max(0, i - 4), i, (1,), generator=g))
            depth[b, i] = depth[b, parents[b, i]] + 1
    return parents, depth


@pytest.fixture(scope="module")
def draft():
    torch.manual_seed(0)
    d = PosSDraft(DraftConfig(**SMOL, n_specialists=2, positions_per_specialist=2)).eval()
    D = SMOL["head_dim"]
    inv_freq = 1.0 / 1e5 ** (torch.arange(0, D, 2).float() / D)
    emb = torch.randn(SMOL["vocab"], SMOL["hidden"]) * 0.02
    d.attach_tensors(emb, emb, inv_freq, max_batch=1, max_seq=PREFIX + 64)
    d.caches.k.normal_()
    d.caches.v.normal_()
    return d


def specialist_inputs(T):
    parents, depth = random_tree(1, T)
    prefix = torch.tensor([PREFIX], dtype=torch.int32)
    return (torch.randint(0, SMOL["vocab"], (1, T)), torch.randn(1, T, SMOL["hidden"]),
            PREFIX + depth, parents, prefix)


def hf_layer_step(draft, T):
    """EAGLE-style eager specialist: fc, then transformers' LlamaDecoderLayer without input norm."""
    from transformers import DynamicCache, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    c = draft.config
    cfg = LlamaConfig(hidden_size=c.hidden, num_attention_heads=c.heads, num_key_value_heads=c.kv_heads,
                      head_dim=c.head_dim, intermediate_size=c.ffn, rms_norm_eps=c.rms_eps, rope_theta=1e5,
                      max_position_embeddings=8192, num_hidden_layers=1)
    cfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(cfg, 0).eval()
    layer.input_layernorm = torch.nn.Identity()
    rotary = LlamaRotaryEmbedding(cfg)
    embed, fc = draft.target[0], draft.fc
    cache = DynamicCache(config=cfg)
    with torch.inference_mode():  # fill the 512-token context
        x = torch.randn(1, PREFIX, c.hidden)
        pos = torch.arange(PREFIX).view(1, -1)
        causal = torch.full((PREFIX, PREFIX), float("-inf")).triu(1).view(1, 1, PREFIX, PREFIX)
        layer(x, attention_mask=causal, position_ids=pos, cache=cache, use_cache=True,
              position_embeddings=rotary(x, pos))
    tokens, feats, positions, parents, _ = specialist_inputs(T)
    from poss.models.tree import tree_ancestor_mask

    visible = torch.cat([torch.ones(1, T, PREFIX, dtype=torch.bool), tree_ancestor_mask(parents)], -1)
    mask = torch.zeros(1, 1, T, PREFIX + T).masked_fill(~visible.unsqueeze(1), float("-inf"))

    def step():
        u = fc(torch.cat([torch.nn.functional.embedding(tokens, embed), feats], -1))
        out = layer(u, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                    position_embeddings=rotary(u, positions))
        cache.crop(-T)  # drop the step's tokens again
        return out

    return step


@pytest.mark.parametrize("T", [1, 10, 60])
@pytest.mark.parametrize("impl", ["fused", "hf_layer", "eager_packed"])
def test_specialist_forward(benchmark, draft, impl, T):
    args = specialist_inputs(T)
    if impl == "fused":
        fn = lambda: draft.step(0, *args)  # noqa: E731
    elif impl == "eager_packed":
        fn = lambda: draft.step(0, *args, eager=True)  # noqa: E731
    else:
        fn = hf_layer_step(draft, T)
    benchmark.group = f"specialist T={T}"
    with torch.inference_mode():
        benchmark.pedantic(fn, rounds=30 if T < 60 else 15, warmup_rounds=2)


@pytest.fixture(scope="module")
def smollm2():
    try:
        from poss.models.registry import load_model

        _, model = load_model("smollm2-135m")
    except Exception as e:  # noqa: BLE001  (offline machine without the wheel)
        pytest.skip(f"SmolLM2 unavailable: {e}")
    model.config._attn_implementation = "eager"
    return model


def hf_step(model, T):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    # transformers 5.25 renamed past_key_values to cache (the old name is to go in 5.40).
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        model(torch.randint(0, 49152, (1, PREFIX)), use_cache=True, **{name: cache})
    ids = torch.randint(0, 49152, (1, T))

    def step():
        with torch.inference_mode():
            model(ids, use_cache=True, **{name: cache})
        cache.crop(-T)  # drop the step's tokens again

    return step


def runner_step(model, T):
    runner = TargetRunner(model, max_batch=1, max_seq=PREFIX + 64)
    runner.prefill([torch.randint(0, 49152, (PREFIX,)).tolist()])
    parents, depth = random_tree(1, T) if T > 1 else (chain_parents([1], 1), torch.zeros(1, 1, dtype=torch.long))
    prefix = torch.tensor([PREFIX], dtype=torch.int32)
    ids = torch.randint(0, 49152, (1, T))
    return lambda: runner(ids, PREFIX + depth, parents, prefix)


@pytest.mark.parametrize("T", [1, 60])
@pytest.mark.parametrize("impl", ["runner", "hf_eager"])
def test_target_step(benchmark, smollm2, impl, T):
    fn = runner_step(smollm2, T) if impl == "runner" else hf_step(smollm2, T)
    benchmark.group = f"target step T={T}"
    benchmark.pedantic(fn, rounds=10, warmup_rounds=2)
