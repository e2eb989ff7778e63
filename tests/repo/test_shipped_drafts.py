"""The trained drafts shipped in ``drafts/``: each is fp16 trainable weights that load and match their
model card; the default one is lossless (greedy output is the target's own) and is accepted far more
often than a random draft (tau well above 1)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers.loop import single_thread  # noqa: F401  (autouse: one CPU thread)
from poss.data import load_eval_set
from poss.decode.params import TreeParams
from poss.models.registry import DRAFTS_DIR, shipped_draft

SHIPPED = sorted(p.parent for p in DRAFTS_DIR.glob("*/config.json")) if DRAFTS_DIR.is_dir() else []
pytestmark = pytest.mark.skipif(not SHIPPED, reason="no trained draft in drafts/")


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda p: p.name)
def test_shipped_draft_is_fp16_trainable_weights_with_a_card(folder):
    from poss.models.draft import PosSDraft

    cfg = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    token_map = weights.pop("token_map", None)  # a reduced draft vocabulary: K full-vocabulary ids
    assert (token_map is None) == (not cfg.get("draft_vocab"))
    if token_map is not None:
        assert token_map.dtype == torch.int64 and token_map.numel() == cfg["draft_vocab"]
        assert (bool((token_map[1:] > token_map[:-1]).all()) and 0 <= int(token_map[0])
                and int(token_map[-1]) < cfg["vocab"])
    assert all(v.dtype == torch.float16 for v in weights.values())
    assert all(k.startswith(("fc.", "layers.")) for k in weights)  # no embedding / lm_head copy
    assert ({k.split(".")[1] for k in weights if k.startswith("layers.")}
            == {str(j) for j in range(cfg["n_specialists"])})
    card = (folder / "README.md").read_text()
    t = cfg["training"]
    assert cfg["target_name"] in card and f"{t['train_seconds'] / 60:.0f} min" in card
    for a in t["val"]["acc"]:
        assert f"{100 * a:.1f}" in card
    assert PosSDraft.load(folder).config.n_specialists == cfg["n_specialists"]


@pytest.mark.slow
def test_default_shipped_draft_is_lossless_and_accepted():
    import poss

    folder = shipped_draft("smollm2-135m")
    assert folder is not None and "poss" in folder.name  # a PosS draft is preferred when one ships
    # fp32: identical to HF as well (test_loop_edges covers our AR loop in bf16 and fp32);
    # the fixed 60/6 tree: auto may pick a tree too small to show acceptance
    # speculate_max_batch=None: speculate at batch 2 too (auto would measure, and may decode plainly)
    gen = poss.load("smollm2-135m", draft=folder, tree=TreeParams(), dtype=torch.float32, speculate_max_batch=None)
    ar = poss.load("smollm2-135m", dtype=torch.float32)
    texts = [load_eval_set(name)[0]["turns"][0] for name in ("gsm8k", "mt_bench")]
    prompts = [gen.encode(t) for t in texts]
    spec = gen.generate(prompts, 40)
    base = ar.generate(prompts, 40)
    assert spec.token_ids == base.token_ids
    # A random draft gives tau ~1.0 here (test_loop_real); a trained one must be accepted often.
    tau = sum(s.tau * s.rounds for s in spec.stats) / sum(s.rounds for s in spec.stats)
    assert tau > 1.2, tau
