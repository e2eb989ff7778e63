"""Answer every question of the chosen sets with each method, timed per turn, resumable.

A method is the autoregressive loop (``ar``: our runner with no draft, the speedup baseline), a
draft folder (speculative decoding on the same runner), or ``hf`` (``transformers`` ``generate``,
greedy, as the external reference). Multi-turn questions (MT-Bench) ask turn 2 after the method's
own answer to turn 1. Each finished question is appended to ``records.jsonl``, so an interrupted
run resumes at the next question; each record carries the run's settings and its draft's weights hash,
and a resume with other ones is refused rather than mixed into one table.
"""

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from poss.decode.params import SamplingParams, TreeParams
from poss.jsonl import open_for_append, read_jsonl


@dataclass
class Settings:
    max_new_tokens: int = 512
    num_nodes: int = 60
    depth: int = 6
    beam_width: int = 10  # draft candidates kept per level
    temperature: float = 0.0
    seed: int = 0
    max_turns: Optional[int] = None  # ask only the first K turns of each question (None: all)
    lookup: int = 0  # prompt-lookup tokens merged into each tree (TreeParams.lookup)
    draft_vocab: str = "trained"  # the lm_head rows a draft scores (PosSDraft.load's vocab)


def method_name(draft: Optional[str], draft_vocab: str = "trained") -> str:
    """``ar``, ``hf``, or the draft folder's name (its run folder's for ``RUN/draft`` and ``RUN/draft-fp16``),
    with ``+full-vocab`` when it scores every lm_head row (so both settings can share one results folder)."""
    if draft is None or draft == "hf":
        return draft or "ar"
    p = Path(draft)
    name = p.parent.name if p.name in ("draft", "draft-fp16") else p.name
    return name if draft_vocab == "trained" else f"{name}+{draft_vocab}-vocab"


def read_done(path: Path) -> Dict[tuple, dict]:
    """``(method, dataset, question_id) -> record`` of the questions already answered."""
    return {(r["method"], r["dataset"], r["question_id"]): r for r in read_jsonl(path)}


def run_settings(s: Settings, dtype) -> Dict:
    """What every record of one results folder must share, stored in each record: the settings
    (``draft_vocab`` is part of the method name instead), the dtype and the thread count."""
    out = {k: v for k, v in asdict(s).items() if k != "draft_vocab"}
    return {**out, "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads()}


def draft_sha256(draft: str) -> str:
    """The first 16 hex digits of the sha256 of a draft folder's weights: two drafts with one
    folder name are told apart."""
    return hashlib.sha256((Path(draft) / "model.safetensors").read_bytes()).hexdigest()[:16]


class ResumeConflict(ValueError):
    """An ``--out`` folder whose records cannot be continued by this run."""


def check_resumable(done: Dict[tuple, dict], settings: Dict, drafts: Dict[str, Optional[str]], path: Path) -> None:
    """Raise :class:`ResumeConflict` when ``path`` holds records made with other settings, or by another draft
    under one of this run's method names: resuming would mix them into one table. Records written
    before settings were stored carry none and are not checked."""
    for (name, _, _), r in done.items():
        have = r.get("settings")
        if have is not None and have != settings:
            diff = ", ".join(f"{k} {have.get(k)!r} (now {v!r})" for k, v in settings.items() if have.get(k) != v)
            raise ResumeConflict(f"{path} holds records made with other settings: {diff}; "
                                 f"use a new --out or the same settings")
        sha = drafts.get(name)
        if sha is not None and r.get("draft_sha256") not in (None, sha):
            raise ResumeConflict(f"{path} holds answers of another draft named {name!r} ({r.get('draft')}); "
                                 f"use a new --out")


class HFMethod:
    """``transformers`` greedy ``generate`` behind the small interface :func:`answer` uses."""

    def __init__(self, gen, model):
        self.tokenizer, self.model, self.encode = gen.tokenizer, model, gen.encode
        self.end_ids = sorted(gen.end_ids)

    @torch.inference_mode()
    def turn(self, messages, s: Settings) -> dict:
        ids = torch.tensor([self.encode(messages)])
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=s.max_new_tokens,
                                  do_sample=False, eos_token_id=self.end_ids, pad_token_id=self.end_ids[0])
        dt = time.perf_counter() - t0
        new = out[0, ids.shape[1]:].tolist()
        return {"tokens": len(new), "rounds": len(new), "accept_hist": [len(new)], "seconds": dt,
                "text": self.tokenizer.decode(new, skip_special_tokens=True), "token_ids": new}


def poss_turn(gen, messages, s: Settings) -> dict:
    """One turn with our generator (``gen.draft`` None: autoregressive), with the round phases timed."""
    gen.profile = {}
    t0 = time.perf_counter()
    res = gen.generate(messages, s.max_new_tokens, SamplingParams(temperature=s.temperature, seed=s.seed),
                       TreeParams(num_nodes=s.num_nodes, depth=s.depth, beam_width=s.beam_width,
                                  lookup=s.lookup if gen.draft is not None else 0))  # ar stays plain decoding
    dt = time.perf_counter() - t0
    prof, gen.profile = gen.profile, None
    st = res.stats[0]
    return {"tokens": st.tokens, "rounds": st.rounds, "accept_hist": list(st.accept_hist), "seconds": dt,
            "draft_s": sum(prof.get("draft", [])), "verify_s": sum(prof.get("verify", [])),
            "commit_s": sum(prof.get("commit", [])), "text": res.texts[0], "token_ids": res.token_ids[0]}


def answer(method, record: dict, s: Settings) -> List[dict]:
    """Every turn of one question; turn k is asked after the method's own answers to turns < k."""
    messages, turns = [], []
    for text in record["turns"][: s.max_turns]:
        messages.append({"role": "user", "content": text})
        t = method.turn(messages, s) if isinstance(method, HFMethod) else poss_turn(method, messages, s)
        turns.append(t)
        messages.append({"role": "assistant", "content": t["text"]})
    return turns


def evaluate(target: str, drafts: Iterable[Optional[str]], datasets: Dict[str, List[dict]], out, s: Settings,
             dtype=torch.float32, limit: Optional[int] = None, shard: Tuple[int, int] = (0, 1),
             progress: bool = True) -> Path:
    """Run every method over every dataset (the first ``limit`` questions of each; of those, with
    ``shard=(i, n)``, the ones at positions i, i + n, ...); returns the ``records.jsonl`` path.
    ``drafts`` holds None (ar), "hf", or draft folders."""
    from tqdm import tqdm

    import poss

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "records.jsonl"
    drafts = list(drafts)
    shas = {method_name(d, s.draft_vocab): draft_sha256(d) for d in drafts if d not in (None, "hf")}
    settings = run_settings(s, dtype)
    with open_for_append(path) as f:
        done = read_done(path)
        check_resumable(done, settings, shas, path)
        for d in drafts:
            name = method_name(d, s.draft_vocab)
            gen = poss.load(target, draft=None if d in (None, "hf") else d, dtype=dtype, draft_vocab=s.draft_vocab)
            if d == "hf":
                from poss.models.registry import load_model

                method = HFMethod(gen, load_model(target, dtype=dtype)[1])
            else:
                method = gen
            warm = False
            for ds, records in datasets.items():
                mine = records[:limit][shard[0]::shard[1]]
                todo = [r for r in mine if (name, ds, r["question_id"]) not in done]
                if not todo:
                    continue
                if not warm:  # first-call costs (allocation, thread pools) stay out of the timings
                    answer(method, {"turns": ["Hello"]}, Settings(max_new_tokens=8, num_nodes=s.num_nodes,
                                                                 depth=s.depth, beam_width=s.beam_width,
                                                                 lookup=s.lookup))
                    warm = True
                for r in tqdm(todo, desc=f"{name} {ds}", disable=not progress, dynamic_ncols=True):
                    rec = {"method": name, "draft": None if d in (None, "hf") else str(d),
                           "draft_sha256": shas.get(name), "settings": settings, "dataset": ds,
                           "question_id": r["question_id"], "turns": answer(method, r, s)}
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
            if gen.draft is not None:
                info = {"method": name, "draft_params_mb": sum(p.numel() * p.element_size()
                                                               for p in gen.draft.parameters()) / 2 ** 20}
                (out / f"draft-{name}.json").write_text(json.dumps(info))
    return path
