"""Training tokens/s with the reduced draft vocabulary against the full one, for EAGLE-2 (1 step) and
PosS-2 (6 steps, 2 positions per specialist), on a ``poss distill`` folder, one after another in one run.

    PYTHONPATH=.:python python bench/bench_train_throughput.py runs/distill --batches 15 --threads 1
    PYTHONPATH=.:python pytest bench/bench_train_throughput.py --benchmark-disable -q   (tiny random model, seconds)

Each row is ``--batches`` optimizer steps of ``poss train``'s trainer (:class:`poss.train.loop.Trainer`,
batch 4, lr 1e-3, no checkpoint in between) on the same first training answers, the target's features
cached by the data set as ``poss train --data`` uses them; tokens/s = training tokens / seconds of those
steps. A fresh draft each row, so rows do not warm each other up beyond the shared feature files.
"""

import argparse
import tempfile

import torch

# (name, TrainConfig fields): EAGLE-2 and PosS-2, as poss train's --method / --steps /
# --positions-per-specialist set them.
METHODS = (("eagle2", dict(method="eagle2")), ("poss", dict(method="poss", steps=6, positions_per_specialist=2)))


def throughput(runner, data, method: dict, token_map, batches: int, out, batch_size: int = 4) -> dict:
    """``batches`` optimizer steps of a fresh draft (``method``: TrainConfig fields; ``token_map``: the
    reduced vocabulary, None for the full one) on ``data`` (a :class:`poss.train.dataset.Dataset`)."""
    from poss.train.loop import TrainConfig, Trainer
    from poss.train.validate import draft_autocast

    cfg = TrainConfig(batch_size=batch_size, lr=1e-3, max_batches=batches, checkpoint_minutes=1e6,
                      autocast=draft_autocast(runner.dtype), **method)
    trainer = Trainer(runner, cfg, data.train, data.val, out, feature_cache=data.feature_cache,
                      data_info=data.info, progress_bar=False, token_map=token_map, train_ids=data.train_ids)
    p = trainer.fit()["progress"]
    return {"steps": p["step"], "tokens": p["tokens"], "seconds": p["seconds"],
            "tokens_per_s": p["tokens"] / p["seconds"]}


def rows(runner, data, vocab_sizes, batches: int, vocab: int, end_ids=(), log=print) -> list:
    """:func:`throughput` for every method of :data:`METHODS` at every draft vocabulary size (0: full)."""
    from poss.train.draft_vocab import answer_vocabulary

    out = []
    for name, method in METHODS:
        for k in vocab_sizes:
            token_map = answer_vocabulary(data.train, k, vocab, end_ids) if k else None
            with tempfile.TemporaryDirectory() as d:
                r = {"method": name, "draft_vocab": k, **throughput(runner, data, method, token_map, batches, d)}
            log(f"| {name} | {f'{k:,}' if k else f'full ({vocab:,})'} | {r['tokens']} | {r['seconds']:.1f} | "
                f"{r['tokens_per_s']:.0f} |")
            out.append(r)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", help="a `poss distill` output folder (records and cached features)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--batches", type=int, default=15, help="optimizer steps per row")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft-vocab", type=int, nargs="+", default=[8192, 0], metavar="K",
                    help="draft vocabulary sizes (0: the full vocabulary)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    a = ap.parse_args(argv)
    from poss.decode.stopping import end_token_ids
    from poss.hardware import header, resolve_dtype
    from poss.models.registry import load_model
    from poss.models.target import TargetRunner
    from poss.train.dataset import distilled_dataset

    torch.set_num_threads(a.threads)
    dtype = resolve_dtype(a.dtype, "cpu", training=True)
    tokenizer, hf = load_model(a.target, dtype=dtype)
    runner = TargetRunner(hf, max_batch=4, max_seq=1024, dtype=dtype)
    data = distilled_dataset(a.data, runner.fingerprint(), 1024, 4 * a.batches, 0)
    print(header(dtype, a.threads) + f"; {a.batches} optimizer steps of batch 4 per row\n")
    print("| method | draft vocabulary | tokens | seconds | tokens/s |\n|---|---|---|---|---|")
    rows(runner, data, a.draft_vocab, a.batches, hf.config.vocab_size,
         end_token_ids(tokenizer, getattr(hf, "generation_config", None)))


# -- smoke (pytest): a tiny random target, online features ------------------------------------------
def test_rows_tiny(benchmark, bench_threads):
    from poss.models.target import TargetRunner
    from poss.testing import tiny_target
    from poss.train.data import Example
    from poss.train.dataset import Dataset

    runner = TargetRunner(tiny_target(), max_batch=4, max_seq=48)
    g = torch.Generator().manual_seed(0)
    examples = []
    for _ in range(9):
        ids = torch.randint(1, 300, (32,), generator=g)
        examples.append(Example(ids, (torch.arange(32) >= 12).long()))
    data = Dataset(examples[:8], examples[8:], None, {})
    got = benchmark.pedantic(rows, (runner, data, [40, 0], 2, 300), {"log": lambda _: None}, rounds=1, iterations=1)
    assert [(r["method"], r["draft_vocab"]) for r in got] == [("eagle2", 40), ("eagle2", 0), ("poss", 40), ("poss", 0)]
    assert all(r["steps"] == 2 and r["tokens"] == 2 * 4 * 32 and r["tokens_per_s"] > 0 for r in got)


if __name__ == "__main__":
    main()
