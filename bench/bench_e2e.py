"""End-to-end decoding speed, side by side, all measured in one run on the same prompts: our AR loop,
our shipped drafts (EAGLE-2, HASS, PosS) at the measured ``auto`` tree and at fixed trees, HF
``generate`` greedy and HF prompt lookup, and llama.cpp (plain and prompt lookup) on the same GGUF.

Every system decodes the same chat-templated MT-Bench first turns (token ids from our tokenizer), batch
1, greedy, exactly ``--new`` tokens per prompt (end tokens ignored, so every row does the same work), on
the same torch / llama.cpp thread count. tokens/s = generated tokens / wall time including the prefill.
Our AR loop and every draft's ``auto`` row, the ratios the issue's bars are about, are timed prompt by
prompt in turn (:func:`interleaved`), so a shared machine's drift over the run hits them alike; the
other rows run one after another.

Run (the table in docs/benchmarks.md):
    PYTHONPATH=.:python python bench/bench_e2e.py --prompts 4 --new 128 --threads 1 --out docs/bench/e2e_cpu.json
    PYTHONPATH=.:python python bench/e2e_report.py docs/bench/e2e_cpu.json --png docs/img/e2e_cpu.png
The issue's full size is ``--prompts 16 --new 256``. The coder on HumanEval prompts:
    PYTHONPATH=.:python python bench/bench_e2e.py --target qwen2.5-coder-0.5b --prompt-set humaneval164 \
        --sweep-draft coder-eagle2 --prompts 8 --new 256 --threads 1 --out docs/bench/e2e_coder.json
Smoke (tiny random model, seconds):
    PYTHONPATH=.:python pytest bench/bench_e2e.py --benchmark-disable -q

llama.cpp rows need ``llama-cpp-python`` (``pip install ".[bench]"``), built from source by pip; they
are skipped when it is not importable. On an AVX2-only machine (no AVX512) build it with
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF" \\
        pip install --no-binary llama-cpp-python "llama-cpp-python==0.3.36"
on an AMX machine add ``-DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF``
(the default GGML_NATIVE build died there with an illegal instruction); about 10 minutes on 2 cores.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest
import torch


# -- rows ----------------------------------------------------------------------------------------------
def _row(name: str, kind: str, ids: List[List[int]], seconds: float, **extra) -> Dict:
    toks = sum(len(x) for x in ids)
    return {"name": name, "kind": kind, "tokens": toks, "seconds": seconds, "tokens_per_s": toks / seconds,
            "token_ids": ids, **extra}


def ours(gen, prompts: Sequence[List[int]], new: int, name: str, tree=None, kind="ours") -> Dict:
    """``gen.generate`` one prompt at a time; tau and the per-phase profile (ms per round) alongside."""
    from poss.decode.params import TreeParams

    tree = tree or TreeParams(num_nodes=1, depth=0)
    saved = gen.end_ids
    gen.end_ids = set()
    try:
        gen.generate([prompts[0]], 4, tree=tree)  # warm-up: allocations, oneDNN primitives
        gen.profile = {}
        out, rounds = [], 0
        t = time.perf_counter()
        for p in prompts:
            res = gen.generate([p], new, tree=tree)
            out.append(res.token_ids[0])
            rounds += res.stats[0].rounds
        wall = time.perf_counter() - t
        prof = {k: 1e3 * sum(v) / len(v) for k, v in gen.profile.items()}
        decode_s = sum(sum(v) for v in gen.profile.values())
    finally:
        gen.profile, gen.end_ids = None, saved
    toks = sum(len(x) for x in out)
    return _row(name, kind, out, wall, tree=shape_of(tree), rounds=rounds,
                tau=(toks - len(prompts)) / max(rounds, 1), round_ms=prof, decode_seconds=decode_s)


def interleaved(gen, prompts: Sequence[List[int]], new: int, configs) -> List[Dict]:
    """:func:`ours` rows for ``configs`` = ``[(name, kind, draft, tree, datastore[, generator])]`` (draft
    None: our AR loop; the generator, ``gen`` unless given, has its ``draft`` / ``datastore`` set to
    them), timed prompt by prompt in turn: every config runs a prompt before any runs the next, so a
    shared machine's drift over the run (tens of seconds per config) hits all of them alike, and their
    ratios are fair within one run."""
    parts: Dict[str, List[Dict]] = {name: [] for name, *_ in configs}
    gens = {id(g): g for g in [gen] + [c[5] for c in configs if len(c) > 5]}
    saved = {k: (g.draft, g.datastore) for k, g in gens.items()}
    try:
        for p in prompts:
            for name, kind, draft, tree, datastore, *own in configs:
                g = own[0] if own else gen
                g.draft, g.datastore = draft, datastore
                parts[name].append(ours(g, [p], new, name, tree, kind))
    finally:
        for k, (draft, store) in saved.items():
            gens[k].draft, gens[k].datastore = draft, store
    rows = []
    for name, kind, *_ in configs:
        rs = parts[name]
        rounds = sum(r["rounds"] for r in rs)
        ms: Dict[str, float] = {}
        for r in rs:
            for k, v in r["round_ms"].items():
                ms[k] = ms.get(k, 0.0) + v * r["rounds"]
        ids = [r["token_ids"][0] for r in rs]
        toks = sum(len(x) for x in ids)
        rows.append(_row(name, kind, ids, sum(r["seconds"] for r in rs), tree=rs[0]["tree"], rounds=rounds,
                         tau=(toks - len(prompts)) / max(rounds, 1),
                         round_ms={k: v / max(rounds, 1) for k, v in ms.items()},
                         decode_seconds=sum(r["decode_seconds"] for r in rs), interleaved=True))
    return rows


def hf(model, prompts: Sequence[List[int]], new: int, name: str, **gen_kw) -> Dict:
    """HF ``generate`` greedy (``gen_kw``: e.g. ``prompt_lookup_num_tokens=10``)."""
    def one(p, n):
        ids = torch.tensor([p])
        with torch.no_grad():
            o = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, num_beams=1, **gen_kw)
        return o[0, len(p):].tolist()

    one(prompts[0], 4)
    t = time.perf_counter()
    out = [one(p, new) for p in prompts]
    return _row(name, "hf", out, time.perf_counter() - t)


_PROBE_EXTRA_BUFTS = """
import sys, llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
next(llm.generate([1, 2, 3], temp=0.0, top_k=1))
"""


def llama_extra_bufts_work(gguf: Path) -> bool:
    """Whether llama.cpp decodes with its extra weight buffers (repacked and AMX layouts), tried in a child
    process: with llama-cpp-python 0.3.36 on an AMX Xeon VM (2026-12-08) the first decode segfaulted
    there, while it runs with them off (its AVX512 / VNNI kernels on the file's blocks)."""
    probe = subprocess.run([sys.executable, "-c", _PROBE_EXTRA_BUFTS, str(gguf)], capture_output=True, timeout=300)
    return probe.returncode == 0


@contextlib.contextmanager
def _llama_model_params(**fields):
    """llama_cpp.Llama builds its model parameters from llama_model_default_params(), and takes no argument
    for these fields: set them there for the block."""
    import llama_cpp.llama as llama_module

    default = llama_module.llama_cpp.llama_model_default_params

    def patched():
        params = default()
        for k, v in fields.items():
            setattr(params, k, v)
        return params

    llama_module.llama_cpp.llama_model_default_params = patched
    try:
        yield
    finally:
        llama_module.llama_cpp.llama_model_default_params = default


def llama_cpp_rows(gguf: Path, prompts: Sequence[List[int]], new: int, threads: int, log=print) -> List[Dict]:
    """llama.cpp plain greedy and its prompt-lookup decoding (10 tokens; needs ``logits_all=True``), with
    its extra weight buffers where they run on this CPU (:func:`llama_extra_bufts_work`)."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    rows = []
    ctx = max(len(p) for p in prompts) + new + 64
    extra_bufts = llama_extra_bufts_work(gguf)
    if not extra_bufts:
        log("  llama.cpp crashed with its extra weight buffers (repack / AMX) on this CPU: rows without them")
    for name, kw in (("llama.cpp plain", {}),
                     ("llama.cpp prompt lookup (10)",
                      {"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=10), "logits_all": True})):
        with _llama_model_params(**({} if extra_bufts else {"use_extra_bufts": False})):
            llm = llama_cpp.Llama(str(gguf), n_ctx=ctx, n_threads=threads, n_threads_batch=threads, verbose=False,
                                  seed=0, **kw)

        def one(llm, p, n):
            llm.reset()
            got = []
            for tok in llm.generate(p, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
                got.append(int(tok))
                if len(got) == n:
                    break
            return got

        one(llm, prompts[0], 4)
        t = time.perf_counter()
        out = [one(llm, p, new) for p in prompts]
        rows.append(_row(name, "llama.cpp", out, time.perf_counter() - t,
                         llama_cpp_version=llama_cpp.__version__, gguf=gguf.name, extra_bufts=extra_bufts))
        del llm
    return rows


def batch_row(gen, prompts: Sequence[List[int]], new: int, batch: int, name: str, tree=None, kind="ours",
              limit=None) -> Dict:
    """``batch`` requests decoded together (``gen.generate`` on a list); tokens/s over all of them.
    ``limit``: the generator's ``speculate_max_batch`` for the row (None: speculate at any size)."""
    from poss.decode.params import TreeParams

    tree = tree or TreeParams(num_nodes=1, depth=0)
    saved = gen.end_ids, gen.speculate_max_batch
    gen.end_ids, gen.speculate_max_batch = set(), limit
    try:
        gen.generate(list(prompts[:batch]), 4, tree=tree)  # warm-up at this batch size
        t = time.perf_counter()
        res = gen.generate(list(prompts[:batch]), new, tree=tree)
        wall = time.perf_counter() - t
        resolved = gen.speculation_limit(tree) if limit is not None else None
    finally:
        gen.end_ids, gen.speculate_max_batch = saved
    rounds = max(s.rounds for s in res.stats)
    return _row(name, kind, res.token_ids, wall, tree=shape_of(tree), batch=batch, rounds=rounds,
                tau=sum(s.tau for s in res.stats) / len(res.stats), speculate_max_batch=resolved)


def compiled_rows(gen, prompts, new: int, draft_name: str, auto: Optional[Dict], log=print,
                  target: str = "smollm2-135m") -> List[Dict]:
    """Our AR loop and ``draft_name`` at its auto tree again, with ``torch.compile`` on the target and
    draft steps (:func:`poss.decode.loader.compile_steps`); compile time is outside the timing."""
    from poss.decode.loader import compile_steps
    from poss.decode.params import TreeParams
    from poss.models.draft import PosSDraft
    from poss.models.registry import shipped_drafts

    compile_steps(gen)
    t = time.perf_counter()
    for p in prompts[:2]:  # compile, then the recompile that marks the changing sizes dynamic
        gen.generate([p], 4, num_nodes=1, depth=0)
    rows = [ours(gen, prompts, new, "our AR loop, torch.compile")]
    rows[0]["compile_seconds"] = time.perf_counter() - t
    log(f"  {rows[0]['name']}: {rows[0]['tokens_per_s']:.1f} tok/s (compiled in {rows[0]['compile_seconds']:.0f} s)")
    folder = next((f for f in shipped_drafts(target) if f.name == draft_name), None)
    if folder is not None and auto is not None:
        T, d, K = auto["params"]
        if d:
            gen.draft = PosSDraft.load(folder, dtype=gen.runner.dtype).attach(gen.runner, 1, 256)
            gen.draft.step = torch.compile(gen.draft.step, mode=None)
            tree = TreeParams(num_nodes=T, depth=d, lookup=K)
            for p in prompts[:2]:
                gen.generate([p], 8, tree=tree)
            r = ours(gen, prompts, new, f"{draft_name} auto (= {shape_of(tree)}), torch.compile", tree, "draft")
            r["draft"] = draft_name
            rows.append(r)
            log(f"  {r['name']}: {r['tokens_per_s']:.1f} tok/s, tau {r['tau']:.2f}")
            gen.draft = None
    return rows


def small_pages_row(gen, model, prompts, new: int) -> Dict:
    """Our AR loop on a second runner over the HF ``model`` (``gen``'s target), its weights left on 4 KB
    pages (``huge_pages=False``)."""
    from poss.decode.generator import Generator
    from poss.models.target import TargetRunner

    runner = TargetRunner(model, max_batch=1, max_seq=256, dtype=gen.runner.dtype, huge_pages=False)
    plain = Generator(runner, tokenizer=gen.tokenizer, end_ids=gen.end_ids)
    row = ours(plain, prompts, new, "our AR loop, 4 KB pages")
    row["bandwidth"] = bandwidth(row, runner)
    return row


def weight_bytes(runner) -> int:
    """Bytes an AR step streams: every layer weight (GGUF blocks as stored), the final norm and the lm_head."""
    def size(t):
        t = getattr(t, "blocks", t)  # a QuantWeight: its blocks
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    n = sum(size(t) for lp in runner.layers for t in vars(lp).values())
    head = getattr(runner, "lm_head_blocks", None) or runner.lm_head
    return n + size(head) + runner.final_norm_w.numel() * 4


def bandwidth(row: Dict, runner) -> Dict:
    """gpt-fast style: weight bytes x AR steps / decode time (prefill excluded)."""
    wb = weight_bytes(runner)
    return {"weight_bytes": wb, "steps": row["rounds"],
            "achieved_gbs": wb * row["rounds"] / row["decode_seconds"] / 1e9}


def matches(rows: List[Dict], ref: Dict, refs: Optional[Dict[str, Dict]] = None) -> None:
    """Each row's ``identical_to_ar``: its answers against the AR row of its weights (``refs`` by a row's
    ``weights``, e.g. ``"gguf"``), else against ``ref``."""
    for r in rows:
        base = (refs or {}).get(r.get("weights"), ref)
        same = sum(a == b for a, b in zip(r["token_ids"], base["token_ids"]))
        r["identical_to_ar"] = f"{same}/{min(len(r['token_ids']), len(ref['token_ids']))}"  # batch rows: their prompts


# -- the whole run ------------------------------------------------------------------------------------
def run(n_prompts: int = 4, new: int = 128, threads: int = 1, dtype="auto", drafts: Optional[List[str]] = None,
        fixed=((60, 6), (16, 4), (8, 3), (4, 2)), sweep_draft: str = "poss2",
        llama: bool = True, hf_rows: bool = True, compiled: bool = False, batches: Sequence[int] = (),
        fixed_all: bool = True, pages_row: bool = True, hf_extra_dtypes: Sequence[str] = (),
        lookups: Sequence[str] = (), gguf: bool = False, target: str = "smollm2-135m",
        prompt_set: str = "mt_bench", log=print) -> Dict:
    """Every row on a real registry target (SmolLM2-135M-Instruct by default) and its shipped drafts,
    on the first turns of the packaged eval set ``prompt_set`` (MT-Bench by default; ``humaneval164``
    for the coder).

    ``fixed``: the (nodes, depth) trees the ``sweep_draft`` is also timed at; with ``fixed_all`` every
    other draft is timed at the first of them too (the paper's 60/6 by default). ``pages_row``: our AR
    loop again with the weights on 4 KB pages (what 2 MB pages buy), where the OS has huge pages.
    ``hf_extra_dtypes``: HF rows also in these dtypes (named "HF generate (float32)" etc.), e.g. fp32 on
    a CPU where torch's own bf16 GEMMs are slow while ours run bf16. ``lookups``: ``"K"`` times the
    ``sweep_draft`` at its auto tree plus a K-token prompt-lookup chain, and our loop with the chain
    alone (no draft); ``"N/D+K"`` the sweep draft at the fixed N/D tree plus the chain. ``gguf``: a
    second target on the GGUF file's own blocks (``dtype="gguf"``), its AR loop and every draft at its
    own auto tree in the same interleaved pass (rows marked ``weights: "gguf"``, checked against the
    gguf AR loop's answers).
    """
    import poss
    from poss import hardware
    from poss.data.eval_sets import load_eval_set
    from poss.decode.autotune import calibrate, choose, score_table
    from poss.decode.params import TreeParams
    from poss.huge_pages import huge_page_bytes, huge_pages_available
    from poss.models.draft import PosSDraft
    from poss.models.registry import fetch_gguf, load_model, resolve, shipped_drafts

    torch.set_num_threads(threads)
    dt = hardware.resolve_dtype(dtype)
    out = {"header": hardware.header(dt, threads), "machine": hardware.describe(dt, threads),
           "read_bandwidth_gbs": hardware.read_bandwidth_gbs(), "prompts": n_prompts, "new_tokens": new,
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": [], "auto": {},
           "loadavg_start": os.getloadavg()}
    log(out["header"])
    t0 = time.perf_counter()
    out["target"], out["prompt_set"] = target, prompt_set
    gen = poss.load(target, dtype=dt)
    out["huge_page_mb"] = huge_page_bytes() / 2**20  # how much of the process the kernel put on 2 MB pages
    questions = load_eval_set(prompt_set)
    prompts = [gen.encode(r["turns"][0]) for r in questions[:n_prompts]]
    batch_prompts = [gen.encode(r["turns"][0]) for r in questions[:max(batches, default=0)]]
    # Each draft's auto tree first (calibration), then our AR loop and every auto row prompt by prompt in
    # turn (interleaved): the headline ratios come from one pass over the prompts.
    attached = {}
    for folder in shipped_drafts(target):
        if drafts and folder.name not in drafts:
            continue
        gen.draft = attached[folder.name] = PosSDraft.load(folder, dtype=dt).attach(gen.runner, 1, 256)
        t = time.perf_counter()
        cal = calibrate(gen)
        auto = choose(cal)
        out["auto"][folder.name] = {"tree": shape_of(auto), "params": [auto.num_nodes, auto.depth, auto.lookup],
                                    "calibration": cal.to_json(),
                                    "calibration_seconds": time.perf_counter() - t,
                                    "top": score_table(cal)[:6]}
        log(f"  {folder.name}: auto = {shape_of(auto)} ({time.perf_counter() - t:.0f} s of calibration)")
    gen.draft = None
    store = gen.datastore
    autos = [(f"{name} auto (= {a['tree']})", "draft", attached[name],
              TreeParams(num_nodes=a["params"][0], depth=a["params"][1], lookup=a["params"][2]), store)
             for name, a in out["auto"].items()]
    quant = gguf_configs(drafts, dt, log, out, target) if gguf else []
    ar, *auto_rows = interleaved(gen, prompts, new, [("our AR loop", "ours", None, None, None)] + autos + quant)
    quant_rows = auto_rows[len(autos):]
    auto_rows = auto_rows[:len(autos)]
    ar["bandwidth"] = bandwidth(ar, gen.runner)
    rows = [ar]
    log(f"  {ar['name']}: {ar['tokens_per_s']:.1f} tok/s")
    for r, c in zip(quant_rows, quant):
        r["weights"] = "gguf"
        if c[2] is None:
            r["bandwidth"] = bandwidth(r, c[5].runner)
        rows.append(r)
        log(f"  {r['name']}: {r['tokens_per_s']:.1f} tok/s" + (f", tau {r['tau']:.2f}" if c[2] is not None else ""))
    if pages_row and huge_pages_available():
        rows.append(small_pages_row(gen, load_model(resolve(target), dtype=dt)[1], prompts, new))
        log(f"  {rows[-1]['name']}: {rows[-1]['tokens_per_s']:.1f} tok/s")
    for name, r in zip(out["auto"], auto_rows):
        r["draft"] = name
        rows.append(r)
        log(f"  {r['name']}: {r['tokens_per_s']:.1f} tok/s, tau {r['tau']:.2f}")
        gen.draft = attached[name]
        for T, d in (fixed if name == sweep_draft else fixed[:1 if fixed_all else 0]):
            r = ours(gen, prompts, new, f"{name} {T}/{d}", TreeParams(num_nodes=T, depth=d), "draft")
            r["draft"] = name
            rows.append(r)
            log(f"  {r['name']}: {r['tokens_per_s']:.1f} tok/s, tau {r['tau']:.2f}")
    folder = next((f for f in shipped_drafts(target) if f.name == sweep_draft), None)
    sweep = PosSDraft.load(folder, dtype=dt).attach(gen.runner, 1, 256) if lookups and folder else None
    for spec in lookups:  # prompt lookup merged into the tree (poss.decode.lookup): rows apart from the drafts
        T, d, K = lookup_of(spec)
        if sweep is not None and (T or sweep_draft in out["auto"]):
            name = f"{sweep_draft} {T}/{d}"
            if not T:
                T, d, _ = out["auto"][sweep_draft]["params"]
                name = f"{sweep_draft} auto (= {T}/{d})"
            gen.draft = sweep
            r = ours(gen, prompts, new, f"{name} + lookup {K}", TreeParams(num_nodes=T, depth=d, lookup=K), "draft")
            r["draft"] = sweep_draft
            rows.append(r)
            log(f"  {r['name']}: {r['tokens_per_s']:.1f} tok/s, tau {r['tau']:.2f}")
        gen.draft = None
        if spec == str(K):
            rows.append(ours(gen, prompts, new, f"our prompt lookup {K} (no draft)", TreeParams(1, 0, lookup=K)))
            log(f"  {rows[-1]['name']}: {rows[-1]['tokens_per_s']:.1f} tok/s, tau {rows[-1]['tau']:.2f}")
    for B in batches:  # our AR loop and the sweep draft at its (batch-1) auto tree, B requests together
        gen.draft = None
        rows.append(batch_row(gen, batch_prompts, new, B, f"our AR loop, batch {B}"))
        log(f"  {rows[-1]['name']}: {rows[-1]['tokens_per_s']:.1f} tok/s")
        folder = next((f for f in shipped_drafts(target) if f.name == sweep_draft), None)
        if folder is not None and sweep_draft in out["auto"]:
            T, d, K = out["auto"][sweep_draft]["params"]
            gen.draft = PosSDraft.load(folder, dtype=dt).attach(gen.runner, 1, 256)
            tree = TreeParams(num_nodes=T, depth=d, lookup=K)
            rows.append(batch_row(gen, batch_prompts, new, B, f"{sweep_draft} auto (= {shape_of(tree)}), batch {B}",
                                  tree, "draft"))
            log(f"  {rows[-1]['name']}: {rows[-1]['tokens_per_s']:.1f} tok/s")
            # What poss.load gives: plain rounds above the measured batch limit.
            rows.append(batch_row(gen, batch_prompts, new, B, f"{sweep_draft} auto, batch {B}, speculation limit auto",
                                  tree, "draft", limit="auto"))
            rows[-1]["name"] += f" (= {rows[-1]['speculate_max_batch']})"
            log(f"  {rows[-1]['name']}: {rows[-1]['tokens_per_s']:.1f} tok/s")
    gen.draft = None
    if compiled:
        rows += compiled_rows(gen, prompts, new, sweep_draft, out["auto"].get(sweep_draft), log, target)
    hf_dtypes = [dt] + [d for d in map(hardware.resolve_dtype, hf_extra_dtypes) if d != dt]
    for hdt in hf_dtypes if hf_rows else []:
        _, model = load_model(resolve(target), dtype=hdt)
        model.generation_config.eos_token_id = None
        suffix = "" if hdt == dt else f" ({str(hdt).replace('torch.', '')})"
        for name, kw in (("HF generate", {}), ("HF prompt lookup (10)", {"prompt_lookup_num_tokens": 10})):
            rows.append(hf(model, prompts, new, name + suffix, **kw))
            log(f"  {rows[-1]['name']}: {rows[-1]['tokens_per_s']:.1f} tok/s")
    if llama:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            log("  llama_cpp not importable: llama.cpp rows skipped")
        else:
            for r in llama_cpp_rows(fetch_gguf(target), prompts, new, threads, log):
                rows.append(r)
                log(f"  {r['name']}: {r['tokens_per_s']:.1f} tok/s")
    matches(rows, ar, {"gguf": quant_rows[0]} if quant_rows else None)
    out["rows"] = rows
    out["wall_seconds"] = time.perf_counter() - t0
    out["loadavg_end"] = os.getloadavg()
    return out


def gguf_configs(drafts: Optional[List[str]], draft_dtype, log, out: Dict,
                 target: str = "smollm2-135m") -> List[tuple]:
    """:func:`interleaved` configs on a second copy of ``target`` running its GGUF file's own blocks: our AR
    loop, then every shipped draft (in ``draft_dtype``, as ``poss.load`` attaches it) at the auto tree
    calibrated on that target (recorded in ``out["auto"]`` under ``"NAME (gguf)"``)."""
    import poss
    from poss.decode.autotune import calibrate, choose
    from poss.models.draft import PosSDraft
    from poss.models.registry import shipped_drafts

    gq = poss.load(target, dtype="gguf", threads=None)
    log(f"  gguf target: {gq.runner.weight_formats()}")
    configs = [("our AR loop (gguf)", "ours", None, None, None, gq)]
    for folder in shipped_drafts(target):
        if drafts and folder.name not in drafts:
            continue
        gq.draft = PosSDraft.load(folder, dtype=draft_dtype).attach(gq.runner, 1, 256)
        t = time.perf_counter()
        cal = calibrate(gq)
        auto = choose(cal)
        out["auto"][f"{folder.name} (gguf)"] = {"tree": shape_of(auto), "params": [auto.num_nodes, auto.depth,
                                                                                    auto.lookup],
                                                 "calibration": cal.to_json(),
                                                 "calibration_seconds": time.perf_counter() - t}
        log(f"  {folder.name} (gguf): auto = {shape_of(auto)} ({time.perf_counter() - t:.0f} s of calibration)")
        configs.append((f"{folder.name} auto (= {shape_of(auto)}) (gguf)", "draft", gq.draft, auto, gq.datastore, gq))
    gq.draft = None
    return configs


def shape_of(tree) -> str:
    """``"T/d"``, or ``"T/d+K"`` with a K-token lookup chain."""
    return f"{tree.num_nodes}/{tree.depth}" + (f"+{tree.lookup}" if tree.lookup else "")


def lookup_of(spec: str):
    """``"K"`` -> (0, 0, K) (the auto tree), ``"N/D+K"`` -> (N, D, K)."""
    tree, _, k = spec.rpartition("+")
    T, d = tree_of(tree) if tree else (0, 0)
    return T, d, int(k)


def tree_of(text: str):
    """``"60/6"`` -> ``(60, 6)``; ValueError for anything else."""
    nodes, depth = (int(x) for x in text.split("/"))  # ValueError: not two integers
    if nodes < 1 or depth < 0:
        raise ValueError(text)
    return nodes, depth


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--drafts", nargs="*", help="shipped draft folder names (default: all)")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--hf-extra-dtypes", nargs="*", default=[], metavar="DTYPE",
                    help="HF rows also in these dtypes (e.g. float32 where torch's bf16 GEMMs are slow)")
    ap.add_argument("--compile", action="store_true", help="add torch.compile rows (AR and the sweep draft at auto)")
    ap.add_argument("--batch", type=int, nargs="*", default=[],
                    help="also decode this many requests together (e.g. 4 16)")
    ap.add_argument("--sweep-draft", default="poss2", help="the shipped draft also timed at the fixed trees")
    ap.add_argument("--fixed", nargs="*", default=["60/6", "16/4", "8/3", "4/2"], metavar="NODES/DEPTH",
                    help="fixed trees the sweep draft is also timed at (none: only auto)")
    ap.add_argument("--no-fixed-others", action="store_true",
                    help="time the other drafts at auto only (not also at the first fixed tree)")
    ap.add_argument("--no-pages-row", action="store_true", help="skip the AR row on 4 KB pages")
    ap.add_argument("--lookup", nargs="*", default=[], metavar="K|N/D+K",
                    help="rows with a K-token prompt-lookup chain: K = the sweep draft at auto plus it, and it "
                         "alone; N/D+K = the sweep draft at the N/D tree plus it")
    ap.add_argument("--gguf", action="store_true",
                    help="also our AR loop and every draft at auto on the GGUF file's own blocks (dtype gguf), "
                         "interleaved with the other auto rows")
    ap.add_argument("--target", default="smollm2-135m", help="registry target whose shipped drafts run")
    ap.add_argument("--prompt-set", default="mt_bench", help="packaged eval set whose first turns are the prompts "
                    "(mt_bench, humaneval164, ...)")
    ap.add_argument("--out", default="out/e2e.json")
    args = ap.parse_args(argv)
    try:
        fixed = tuple(tree_of(f) for f in args.fixed)
        for spec in args.lookup:
            lookup_of(spec)
    except ValueError:
        ap.error(f"--fixed / --lookup: expected NODES/DEPTH pairs such as 60/6 (nodes >= 1, depth >= 0) and K or "
                 f"NODES/DEPTH+K, got {args.fixed} / {args.lookup}")
    res = run(args.prompts, args.new, args.threads, args.dtype, args.drafts, sweep_draft=args.sweep_draft,
              llama=not args.no_llama, hf_rows=not args.no_hf, compiled=args.compile,
              batches=args.batch, fixed=fixed, fixed_all=not args.no_fixed_others, pages_row=not args.no_pages_row,
              hf_extra_dtypes=args.hf_extra_dtypes, lookups=args.lookup, gguf=args.gguf,
              target=args.target, prompt_set=args.prompt_set)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out} ({res['wall_seconds']:.0f} s)")


# -- smoke (pytest): tiny random models, seconds ------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from poss.testing import eval_prompts, make_generator, tiny_target

    model = tiny_target()
    model.generation_config.eos_token_id = None
    gen = make_generator(model, draft=True, n=3, ppl=2, aligned=True)
    return model, gen, eval_prompts(n_per_set=1)[:2]


def test_rows_tiny(benchmark, tiny, bench_threads, tmp_path, monkeypatch):
    from poss.decode.autotune import calibrate, choose
    from poss.decode.params import TreeParams
    from poss.huge_pages import huge_pages_available
    from poss.testing import make_generator

    monkeypatch.setenv("POSS_CACHE", str(tmp_path))
    model, gen, prompts = tiny
    gen.draft.config.training = {"val": {"acc": [0.5, 0.4, 0.3]}}
    draft = gen.draft
    gen.draft = None
    ar = ours(gen, prompts, 16, "our AR loop")
    gen.draft = draft
    auto = choose(calibrate(gen, new_tokens=8, prompts=prompts))
    rows = [ar, benchmark.pedantic(ours, (gen, prompts, 16, "auto", auto), rounds=1, iterations=1),
            ours(gen, prompts, 16, "60/6", TreeParams()), hf(model, prompts, 16, "HF generate"),
            hf(model, prompts, 16, "HF prompt lookup", prompt_lookup_num_tokens=10),
            batch_row(gen, prompts, 16, 2, "auto, batch 2", auto, "draft"),
            ours(gen, prompts, 16, "3/1 + lookup 3", TreeParams(3, 1, lookup=3), "draft")]
    gen.draft = None
    rows.append(ours(gen, prompts, 16, "prompt lookup 4", TreeParams(1, 0, lookup=4)))
    gen.draft = draft
    turns = interleaved(gen, prompts, 16, [("AR, interleaved", "ours", None, None, None),
                                           ("auto, interleaved", "draft", draft, auto, None)])
    # the same greedy work as the rows timed one config at a time, and the generator left as it was
    assert gen.draft is draft and [r["rounds"] for r in turns] == [ar["rounds"], rows[1]["rounds"]]
    assert turns[1]["tree"] == shape_of(auto) and turns[1]["tau"] == rows[1]["tau"]
    rows += turns
    # a config on a second generator (the --gguf rows' path): its own draft slot, checked against its own AR
    other = make_generator(model)
    two = interleaved(gen, prompts, 16, [("AR, other", "ours", None, None, None, other),
                                         ("auto, other", "draft", draft, auto, None, other)])
    assert other.draft is None and gen.draft is draft and two[1]["tau"] == rows[1]["tau"]
    for r in two:
        r["weights"] = "other"
    matches(two, rows[0], {"other": two[0]})
    assert [r["identical_to_ar"] for r in two] == ["2/2", "2/2"]
    if huge_pages_available():
        rows.append(small_pages_row(gen, model, prompts, 16))
        assert rows[-1]["bandwidth"]["steps"] == ar["rounds"]
    bw = bandwidth(ar, gen.runner)
    assert bw["steps"] == ar["rounds"] and bw["achieved_gbs"] > 0
    matches(rows, ar)
    assert all(r["identical_to_ar"] == "2/2" for r in rows)  # lossless, and HF agrees in fp32
    assert all(r["tokens"] == 32 for r in rows)


def test_llama_cpp_rows_when_available(bench_threads):
    pytest.importorskip("llama_cpp")
    from poss.models.registry import gguf_path

    gguf = gguf_path("smollm2-135m")
    if not gguf.exists():
        pytest.skip("the SmolLM2 GGUF is not in the cache (no download in the smoke run)")
    rows = llama_cpp_rows(gguf, [[1, 2, 3, 4, 5, 6]], 8, 1)
    assert [r["tokens"] for r in rows] == [8, 8]
    # (no identity check: llama.cpp scores a looked-up batch with other kernels than single tokens, and
    # with Q4_1 weights greedy paths can part after a few tokens)


def test_report_renders(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("e2e_report", Path(__file__).with_name("e2e_report.py"))
    rep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rep)
    res = {"header": "cpu, 1 threads, float32", "read_bandwidth_gbs": 10.0, "prompts": 1, "new_tokens": 4,
           "auto": {"poss2": {"tree": "8/3"}},
           "rows": [{"name": "our AR loop", "kind": "ours", "tokens_per_s": 20.0, "tree": "1/0", "tau": 1.0,
                     "identical_to_ar": "1/1", "bandwidth": {"achieved_gbs": 5.0, "weight_bytes": 1, "steps": 1}},
                    {"name": "poss2 auto", "kind": "draft", "tokens_per_s": 25.0, "tree": "8/3", "tau": 1.6,
                     "identical_to_ar": "1/1", "interleaved": True},
                    {"name": "HF generate", "kind": "hf", "tokens_per_s": 10.0, "identical_to_ar": "1/1"},
                    {"name": "llama.cpp plain", "kind": "llama.cpp", "tokens_per_s": 8.0, "identical_to_ar": "0/1"}]}
    md = rep.table(res)
    assert md.count("\n|") >= 5 and "1.25" in md and "5.0 GB/s" in md
    # x our AR | x HF | x llama.cpp: our AR 20/20, 20/10, 20/8; poss2 25/20, 25/10, 25/8
    assert "| x llama.cpp |" in md and "| 1.00 | 2.00 | 2.50 |" in md and "| 1.25 | 2.50 | 3.12 |" in md
    assert "| poss2 auto † |" in md and "| HF generate |" in md and "† timed prompt by prompt" in md
    png = tmp_path / "x.png"
    rep.chart(res, png)
    assert png.stat().st_size > 1000


if __name__ == "__main__":
    main()
