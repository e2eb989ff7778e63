"""``--regenerate``: replace each assistant turn with the target's own greedy answer (cached per conversation).

Drafts trained on the target's own outputs accept more at inference. Each assistant turn is regenerated
given the conversation so far (with the earlier turns already replaced), up to ``max_new_tokens``.
Generation uses HF ``generate`` for now; results are appended to a JSONL cache keyed by conversation index,
so an interrupted run continues where it stopped.
"""

import json
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from poss.jsonl import read_jsonl


@torch.no_grad()
def regenerate_conversation(tokenizer, model, messages: Sequence[Dict[str, str]],
                            max_new_tokens: int) -> List[Dict[str, str]]:
    out: List[Dict[str, str]] = []
    for m in messages:
        if m["role"] != "assistant":
            out.append(dict(m))
            continue
        prompt = tokenizer.apply_chat_template(out, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = prompt["input_ids"].to(model.device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
        out.append({"role": "assistant", "content": tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)})
    return out


def regenerate(tokenizer, model, convs: List[List[Dict[str, str]]], indices: Sequence[int], cache_file,
               max_new_tokens: int = 256, progress: bool = True) -> Dict[int, List[Dict[str, str]]]:
    """Regenerated conversations for ``indices``, reading and extending the JSONL ``cache_file``."""
    from tqdm import tqdm

    path = Path(cache_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    done: Dict[int, List[Dict[str, str]]] = {rec["index"]: rec["messages"] for rec in read_jsonl(path)}
    todo = [i for i in indices if i not in done]
    with open(path, "a") as f:
        for i in tqdm(todo, desc="regenerate", disable=not progress):
            done[i] = regenerate_conversation(tokenizer, model, convs[i], max_new_tokens)
            f.write(json.dumps({"index": i, "messages": done[i]}) + "\n")
            f.flush()
    return {i: done[i] for i in indices}
