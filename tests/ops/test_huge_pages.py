"""Weights packed onto 2 MB pages: equal values, kept ties, the mapping really asks for huge pages,
and the target runner's output does not change."""

from pathlib import Path

import pytest
import torch

from helpers.targets import eval_prompts, tiny_model
from poss import huge_pages
from poss.huge_pages import huge_pages_available, pack_on_huge_pages
from poss.models.target import TargetRunner

needs_thp = pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages here")


def vm_flags_of(address: int) -> set:
    """The ``VmFlags`` of the mapping of this process that holds ``address`` (from /proc/self/smaps)."""
    flags, inside = set(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            flags = set(line.split()[1:])
    return flags


@needs_thp
def test_pack_keeps_values_shapes_dtypes_and_ties():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 70, generator=g).to(torch.bfloat16)
    ints = torch.randint(0, 1000, (33,), generator=g)
    odd = torch.randn(5, 7, generator=g).t()  # not contiguous
    ins = [w, None, ints, w, odd, torch.ones(3, dtype=torch.float16)]
    out = pack_on_huge_pages(ins)
    assert out[1] is None
    for a, b in zip(ins, out):
        if a is None:
            continue
        assert b.dtype == a.dtype and b.shape == a.shape and b.is_contiguous()
        assert torch.equal(a, b)
        assert b.data_ptr() % 64 == 0
        assert b.data_ptr() != a.data_ptr()
    assert out[0].data_ptr() == out[3].data_ptr()  # one copy of a tied tensor
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in out if t is not None)
    spans = sorted(set(spans))
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))  # no overlap
    assert "hg" in vm_flags_of(out[0].data_ptr())  # madvise(MADV_HUGEPAGE) reached the kernel


def test_pack_is_a_no_op_without_huge_pages(monkeypatch):
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: False)
    t = torch.randn(4, 4)
    assert pack_on_huge_pages([t, None])[0] is t


@needs_thp
def test_packed_arena_outlives_the_caller_and_stays_writable():
    out = pack_on_huge_pages([torch.zeros(1000)])[0]
    import gc
    gc.collect()
    out += 2
    assert float(out.sum()) == 2000.0


@needs_thp
def test_runner_on_huge_pages_matches_4k_pages():
    model = tiny_model("llama", tie_word_embeddings=True)
    prompts = eval_prompts(2, 40, model.config.vocab_size, seed=5)
    plain = TargetRunner(model, max_batch=2, max_seq=64, huge_pages=False)
    packed = TargetRunner(model, max_batch=2, max_seq=64, huge_pages=True)
    assert "hg" in vm_flags_of(packed.layers[0].w_qkv.data_ptr())
    # The plain runner's weights are their own allocations, the packed ones views of one arena. (Not
    # VmFlags: NumPy madvises its own large arrays, and malloc may reuse that memory for torch's.)
    w_plain, w_packed = plain.layers[0].w_qkv, packed.layers[0].w_qkv
    nbytes = w_plain.numel() * w_plain.element_size()
    assert w_plain.untyped_storage().nbytes() == nbytes < w_packed.untyped_storage().nbytes()
    assert packed.embed.data_ptr() == packed.lm_head.data_ptr()  # the tie survives
    assert packed.fingerprint() == plain.fingerprint()
    a, fa = plain.prefill(prompts)
    b, fb = packed.prefill(prompts)
    assert torch.equal(a, b) and torch.equal(fa, fb)


@needs_thp
@pytest.mark.parametrize("draft_vocab", [0, 48])
def test_a_draft_attached_to_a_cpu_target_moves_its_weights_unchanged(draft_vocab):
    from poss.models.draft import PosSDraft
    from poss.models.draft_config import DraftConfig

    model = tiny_model("llama")
    runner = TargetRunner(model, max_batch=1, max_seq=64, huge_pages=True)
    cfg = DraftConfig.for_target(runner.config, "tiny", runner.fingerprint(), n_specialists=2,
                                 positions_per_specialist=1, fc_bias=True, draft_vocab=draft_vocab)
    d = PosSDraft(cfg)
    if draft_vocab:
        d.token_map.copy_(torch.arange(draft_vocab) * 2)
    before = {k: v.clone() for k, v in d.state_dict().items()}
    d.attach(runner, max_batch=1, max_seq=64)
    after = d.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(isinstance(p, torch.nn.Parameter) for p in d.parameters())
    assert "hg" in vm_flags_of(d.fc.weight.data_ptr())
    assert "hg" in vm_flags_of(d.layers[1].down_proj.weight.data_ptr())
    assert "hg" in vm_flags_of(d._head.data_ptr())
    assert torch.equal(d._head, d.head_rows(runner.lm_head))
