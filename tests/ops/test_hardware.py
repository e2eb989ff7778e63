"""dtype="auto" and the machine facts the benchmarks report."""

import pytest
import torch

from poss import hardware


@pytest.mark.parametrize("flags,want", [({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),
                                        ({"avx2", "amx_bf16", "amx_tile"}, torch.bfloat16),
                                        ({"avx2", "fma"}, torch.bfloat16),  # our AVX2 bf16 kernel
                                        ({"avx2", "fma", "avx512f"}, torch.bfloat16),
                                        ({"avx2"}, torch.float32),
                                        ({"sse4_2"}, torch.float32),
                                        (set(), torch.float32)])  # e.g. no /proc/cpuinfo flags line
def test_auto_picks_bf16_only_where_it_is_fast(monkeypatch, flags, want):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))
    assert hardware.resolve_dtype("auto", "cpu") == want
    assert hardware.resolve_dtype("auto", "cuda") == torch.bfloat16
    # Training runs torch's GEMMs under autocast: bf16 only with hardware bf16.
    hw = bool({"avx512_bf16", "amx_bf16"} & flags)
    assert hardware.resolve_dtype("auto", "cpu", training=True) == (torch.bfloat16 if hw else torch.float32)
    assert hardware.resolve_dtype("auto", "cuda", training=True) == torch.bfloat16


def test_names_and_dtypes_pass_through():
    assert hardware.resolve_dtype("bf16") == torch.bfloat16
    assert hardware.resolve_dtype("float32") == torch.float32
    assert hardware.resolve_dtype(torch.float16) == torch.float16


@pytest.mark.parametrize("bad", ["fp8", "", torch.int32])
def test_bad_dtype_names_the_argument(bad):
    with pytest.raises(ValueError, match="dtype must be"):
        hardware.resolve_dtype(bad)


def test_this_machine_is_described():
    d = hardware.describe(torch.float32, threads=1)
    assert d["threads"] == 1 and d["dtype"] == "float32"
    assert d["fast_bf16"] == bool({"amx_bf16", "avx512_bf16"} & set(hardware.cpu_flags()))
    assert d["torch_cpu_capability"] in hardware.header(torch.float32, 1)


def test_read_bandwidth_is_plausible():
    gbs = hardware.read_bandwidth_gbs(megabytes=64, repeats=2)
    assert 0.1 < gbs < 10_000


@pytest.mark.parametrize("fast", [False, True], ids=["avx2-fp32", "amx-bf16"])
def test_load_resolves_auto_dtype(tmp_path, monkeypatch, fast):
    """``poss.load`` defaults to ``dtype="auto"``: the runner computes in the resolved dtype."""
    import poss
    from helpers.loop import tiny_target
    from helpers.train_tiny import byte_tokenizer

    model, tok = tiny_target(vocab=300), byte_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16"} if fast else {"avx2"}))
    want = hardware.resolve_dtype("auto", "cpu")
    assert want == (torch.bfloat16 if fast else torch.float32)
    gen = poss.load(tmp_path)
    assert gen.runner.dtype == want and gen.runner.lm_head.dtype == want
    assert poss.load(tmp_path, dtype=torch.float32).runner.dtype == torch.float32
    assert poss.load(tmp_path, dtype="bf16").runner.dtype == torch.bfloat16
