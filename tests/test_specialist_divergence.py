"""scripts/specialist_divergence.py: relative distances between a PosS draft's specialists and other drafts."""

import pytest
import torch
from safetensors.torch import save_file

from helpers.scripts import load_script


@pytest.fixture(scope="module")
def sd():
    return load_script("specialist_divergence")


def write_draft(folder, layers):
    folder.mkdir()
    tensors = {"fc.weight": torch.ones(2, 4)}
    for j, weights in enumerate(layers):
        tensors.update({f"layers.{j}.{name}": t for name, t in weights.items()})
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_distances_are_relative_norms(sd, tmp_path):
    g = torch.Generator().manual_seed(0)
    base = {name: torch.randn(6, 4, generator=g) for name in sd.WEIGHTS}
    delta = {name: torch.randn(6, 4, generator=g) for name in sd.WEIGHTS}
    moved = {name: base[name] + 0.1 * delta[name] for name in sd.WEIGHTS}
    poss = write_draft(tmp_path / "poss", [base, {n: t.clone() for n, t in base.items()}, moved])
    eagle = write_draft(tmp_path / "eagle", [moved])
    rows = dict(sd.divergence(poss, [eagle]))
    assert set(rows) == {"specialist 1 vs 0", "specialist 2 vs 0", "specialist 2 vs 1",
                         f"specialist 0 vs {eagle}", f"specialist 1 vs {eagle}", f"specialist 2 vs {eagle}"}
    for name in sd.WEIGHTS:
        assert rows["specialist 1 vs 0"][name] == 0.0  # identical copies
        want = (0.1 * delta[name]).norm() / base[name].norm()
        assert rows["specialist 2 vs 0"][name] == pytest.approx(want.item(), rel=1e-5)
        assert rows[f"specialist 2 vs {eagle}"][name] == 0.0
        assert rows[f"specialist 0 vs {eagle}"][name] == pytest.approx(
            ((base[name] - moved[name]).norm() / moved[name].norm()).item(), rel=1e-5)
    assert sd.table(sd.divergence(poss, [])).count("\n") == 2 + 3


def test_a_file_without_layers_is_named(sd, tmp_path):
    empty = write_draft(tmp_path / "empty", [])
    with pytest.raises(SystemExit, match="no layers"):
        sd.divergence(empty, [])


def test_uniform_specialist_copies_one_specialist_everywhere(tmp_path):
    from poss.models.draft import DraftConfig, PosSDraft

    us = load_script("uniform_specialist")
    cfg = DraftConfig(hidden=8, heads=2, kv_heads=1, head_dim=4, ffn=16, vocab=10, n_specialists=3,
                      positions_per_specialist=2)
    torch.manual_seed(0)
    d = PosSDraft(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn_like(p))
    d.save(tmp_path / "src")
    us.uniform(tmp_path / "src", tmp_path / "all2", 2)
    src, out = PosSDraft.load(tmp_path / "src"), PosSDraft.load(tmp_path / "all2")
    assert out.config == src.config
    half = lambda t: t.half().float()  # noqa: E731  (the copy is written in fp16)
    for layer in out.layers:
        for p, q in zip(layer.parameters(), src.layers[2].parameters()):
            assert torch.equal(p, half(q))
    assert torch.equal(out.fc.weight, half(src.fc.weight))
    with pytest.raises(SystemExit, match="--specialist must be in"):
        us.uniform(tmp_path / "src", tmp_path / "bad", 3)
