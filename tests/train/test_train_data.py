"""ShareGPT parsing (truncated JSON), chat-template loss masks, splits and batching."""

import json

import pytest
import torch

from helpers.train_tiny import byte_tokenizer
from poss.train.data import (
    Example,
    build_split,
    collate,
    data_fingerprint,
    parse_truncated_array,
    split_indices,
    to_messages,
    tokenize_conversation,
)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def records(n):
    return [{"id": str(i), "conversations": [{"from": "human", "value": f"question {i}?"},
                                             {"from": "gpt", "value": f"answer {i}."}]} for i in range(n)]


def test_truncated_array_keeps_complete_records():
    text = json.dumps(records(5), indent=2)
    cut = text[: text.index('"answer 4.')]  # cut inside the last record
    got, skipped = parse_truncated_array(cut)
    assert [r["id"] for r in got] == ["0", "1", "2", "3"] and skipped == 1
    got, skipped = parse_truncated_array(text)  # an intact file loses nothing
    assert len(got) == 5 and skipped == 0
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut)


def test_to_messages_roles_and_rejections():
    assert to_messages(records(1)[0]) == [{"role": "user", "content": "question 0?"},
                                          {"role": "assistant", "content": "answer 0."}]
    assert to_messages({"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "q"},
                                          {"from": "gpt", "value": "a"}]})[0]["role"] == "user"
    assert to_messages({"conversations": [{"from": "human", "value": "only a question"}]}) is None
    assert to_messages({"conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "a"}]}) is None


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Say bye"}, {"role": "assistant", "content": "Bye."}]
    ids, mask = tokenize_conversation(tokenizer, msgs, 10_000)
    assert len(ids) == len(mask)
    masked = [i for i, m in zip(ids, mask) if m]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # content of both assistant turns, each followed by its end-of-turn marker
    assert masked == tokenizer.encode("Hello! How can I help?", add_special_tokens=False) + [end] + \
        tokenizer.encode("Bye.", add_special_tokens=False) + [end]
    text = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    assert "Hi there" in text and "Say bye" in text and "Bye." not in text


def test_truncation_and_split(tokenizer):
    msgs = [{"role": "user", "content": "q" * 50}, {"role": "assistant", "content": "a" * 50}]
    ids, mask = tokenize_conversation(tokenizer, msgs, 40)
    assert len(ids) == 40 and sum(mask) == 0  # the answer was cut off entirely
    ex = build_split(tokenizer, [msgs] * 3, [0, 1, 2], 40)
    assert ex == []  # no assistant tokens left -> dropped
    tr, va = split_indices(100, 10, seed=3)
    assert len(va) == 10 and not set(tr) & set(va) and sorted(tr + va) == list(range(100))
    assert split_indices(100, 10, seed=3)[1] == va and split_indices(100, 10, seed=4)[1] != va


def test_collate_pads_right_and_fingerprint_changes():
    a = Example(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 1]))
    b = Example(torch.tensor([8]), torch.tensor([1]))
    out = collate([a, b])
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]] and out["lengths"].tolist() == [3, 1]
    assert data_fingerprint([a, b]) != data_fingerprint([b, a])


def test_real_sharegpt_file_if_cached():
    from poss.models.downloads import cache_root

    path = cache_root() / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.exists():
        pytest.skip("ShareGPT JSON not in the poss cache (fetched by `poss train`)")
    from poss.train.data import load_sharegpt

    c = load_sharegpt(path)
    assert c.n_records == 17671 and c.skipped_truncated == 1
    assert len(c.messages) + c.skipped_unusable == c.n_records


def test_regenerate_replaces_assistant_turns_and_caches(tokenizer, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from poss.train.regenerate import regenerate

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()
    convs = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "ORIGINAL"},
              {"role": "user", "content": "More"}, {"role": "assistant", "content": "ORIGINAL2"}]]
    calls = []
    gen = model.generate

    def counting(ids, **kw):
        calls.append(ids.shape[1])
        return gen(ids, **kw)

    model.generate = counting
    out = regenerate(tokenizer, model, convs, [0], tmp_path / "regen.jsonl", max_new_tokens=5, progress=False)[0]
    assert [m["role"] for m in out] == ["user", "assistant", "user", "assistant"]
    assert out[0]["content"] == "Hi" and out[2]["content"] == "More"
    assert "ORIGINAL" not in out[1]["content"] + out[3]["content"]
    assert len(calls) == 2 and calls[1] > calls[0]  # the second answer is conditioned on the first (regenerated) one
    # greedy: the regenerated first answer equals a direct greedy continuation of the prompt
    prompt = tokenizer.apply_chat_template(convs[0][:1], add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    # (an explicit attention mask: pad == eos == <|im_end|> also occurs inside the prompt)
    ref = gen(prompt["input_ids"], attention_mask=prompt["attention_mask"], max_new_tokens=5, do_sample=False,
              pad_token_id=tokenizer.eos_token_id)
    assert out[1]["content"] == tokenizer.decode(ref[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    again = regenerate(tokenizer, model, convs, [0], tmp_path / "regen.jsonl", max_new_tokens=5, progress=False)[0]
    assert again == out and len(calls) == 2  # served from the cache


def test_the_regenerated_answers_length_cap_keys_every_cache(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import poss.train.dataset as dataset
    import poss.train.regenerate as regenerate_mod

    monkeypatch.setenv("POSS_CACHE", str(tmp_path))
    convs = SimpleNamespace(messages=[[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]] * 6,
                            fingerprint="f" * 16, n_records=6, skipped_truncated=0, skipped_unusable=0)
    monkeypatch.setattr(dataset, "load_sharegpt", lambda: convs)
    monkeypatch.setattr(dataset, "build_split", lambda tok, msgs, idx, max_len: [
        Example(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 1])) for _ in idx])
    files = []
    monkeypatch.setattr(regenerate_mod, "regenerate", lambda tok, model, msgs, idx, path, max_new, progress: (
        files.append((path.name, max_new)) or {}))

    def build(**kw):
        recipe = dataset.DataRecipe(train_size=4, val_size=2, **kw)
        return dataset.build_dataset(None, None, "t" * 16, recipe, main=False)

    a, b = build(regenerate=True, regen_max_new_tokens=64), build(regenerate=True, regen_max_new_tokens=128)
    assert [m for _, m in files] == [64, 128]  # the second cap did not reuse the first's tokenized answers
    assert files[0][0] != files[1][0] and a.feature_cache != b.feature_cache
    assert (a.info["regen_max_new_tokens"], b.info["regen_max_new_tokens"]) == (64, 128)
    # without regeneration the cap shapes nothing, and changes no key
    c, d = build(regen_max_new_tokens=64), build(regen_max_new_tokens=128)
    assert c.feature_cache == d.feature_cache and "regen_max_new_tokens" not in c.info
