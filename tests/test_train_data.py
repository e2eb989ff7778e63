"""ShareGPT parsing (truncated JSON), chat-template loss masks, splits and batching."""

import json

import pytest
import torch

from poss.train.data import (Example, build_split, collate, data_fingerprint, parse_truncated_array, split_indices,
                             to_messages, tokenize_conversation)

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE tokenizer without merges (one token per byte) plus ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHATML
    return fast


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
    assert to_messages(records(1)[0]) == [{"role": "user", "content": "question 0?"}, {"role": "assistant", "content": "answer 0."}]
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
    from poss.models.cache import cache_root

    path = cache_root() / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.exists():
        pytest.skip("ShareGPT JSON not in the poss cache (fetched by `poss train`)")
    from poss.train.data import load_sharegpt

    c = load_sharegpt(path)
    assert c.n_records == 17671 and c.skipped_truncated == 1
    assert len(c.messages) + c.skipped_unusable == c.n_records
