"""Acceptance of trained drafts in real greedy generation: tau and position-wise acceptance rates.

    python scripts/draft_tau.py drafts/eagle2 drafts/hass drafts/poss2 --sets mt_bench gsm8k --prompts 4

For each draft, generates greedily for the first ``--prompts`` first-turn prompts of each eval set
(the sets packaged in ``poss.data``, or JSONL files of the same form) and reports tau (tokens per
verify round) and, per draft position k, the acceptance rate
alpha_k = P(round accepts >= k tokens | it accepted >= k-1), the per-position metric of the PosS
paper. Every draft's output is checked to be token-identical to plain decoding.

``--teacher-forced`` also scores each draft the way training validates it (``poss.train.validate``:
top-1 agreement at draft steps 1..depth, later steps on the draft's own features) on the same plain
greedy answers, beside the held-out accuracy stored in the draft's config.json: whether that held-out
accuracy predicts acceptance on these prompts.
"""

import argparse
import sys
import time

import torch


def alphas(hist):
    """alpha_k for k = 1..depth from accept_hist[a] = rounds that accepted a draft tokens."""
    out = []
    for k in range(1, len(hist)):
        reached = sum(hist[k - 1:])
        out.append(sum(hist[k:]) / reached if reached else float("nan"))
    return out


def main(argv=None) -> int:
    import poss

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafts", nargs="+", help="draft folders")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--sets", nargs="+", default=["mt_bench", "gsm8k"],
                    help="packaged eval set names (poss.data.EVAL_SETS) or JSONL files with 'turns'")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-nodes", type=int, default=60)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--teacher-forced", action="store_true",
                    help="also score acc@k of each draft on the same answers as training validation does")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from poss.data import load_eval_set

    texts = [r["turns"][0] for name in a.sets for r in load_eval_set(name)[:a.prompts]]
    base = poss.load(a.target)
    prompts = [base.encode(t) for t in texts]
    want = [base.generate(p, a.max_new_tokens).token_ids[0] for p in prompts]
    rows, forced = [], []
    for d in a.drafts:
        gen = poss.load(a.target, draft=d)
        hist, t0 = [0] * (a.depth + 1), time.perf_counter()
        for p, w in zip(prompts, want):
            res = gen.generate(p, a.max_new_tokens, num_nodes=a.num_nodes, depth=a.depth)
            if res.token_ids[0] != w:
                raise SystemExit(f"{d}: output differs from plain greedy decoding (lossless check failed)")
            hist = [x + y for x, y in zip(hist, res.stats[0].accept_hist)]
        rounds = sum(hist)
        tau = sum((k + 1) * c for k, c in enumerate(hist)) / rounds
        rows.append((str(d), tau, alphas(hist), rounds, time.perf_counter() - t0))
        print(f"{d}: tau {tau:.2f} over {rounds} rounds", file=sys.stderr)
        if a.teacher_forced:
            forced.append((str(d),) + teacher_forced(d, gen.runner, prompts, want, a.depth))
    print("| draft | tau | " + " | ".join(f"alpha_{k}" for k in range(1, a.depth + 1)) + " | rounds |")
    print("|---|---|" + "---|" * a.depth + "---|")
    for name, tau, al, rounds, _ in rows:
        print(f"| {name} | {tau:.2f} | " + " | ".join(f"{x:.2f}" for x in al) + f" | {rounds} |")
    print(f"\n{len(prompts)} prompts ({', '.join(a.sets)}), {a.max_new_tokens} new tokens, greedy, "
          f"{a.num_nodes}-node trees of depth {a.depth}; every output equals plain greedy decoding.")
    if forced:
        print("\n| draft | acc@k on these answers (teacher-forced) | acc@k held out (config.json) |")
        print("|---|---|---|")
        for name, here, held in forced:
            print(f"| {name} | {' / '.join(f'{x:.3f}' for x in here)} | {' / '.join(f'{x:.3f}' for x in held)} |")
    return 0


def teacher_forced(draft_dir, runner, prompts, answers, steps):
    """(acc@1..steps on prompt + answer pairs, the held-out acc@k in the draft's config.json)."""
    from poss.models.draft import PosSDraft
    from poss.train.distill import record_example
    from poss.train.features import make_features
    from poss.train.objective import Objective
    from poss.train.validate import evaluate

    # Laid out as the training data: the answer positions in the loss, its last token a target only.
    examples = [record_example({"prompt_ids": list(p), "answer_ids": list(w)}) for p, w in zip(prompts, answers)]
    draft = PosSDraft.load(draft_dir, dtype=torch.float32, device=runner.device)
    here = evaluate(draft, make_features(runner), examples, list(range(len(examples))), Objective(steps=steps),
                    runner)["acc"]
    return here, (draft.config.training or {}).get("val", {}).get("acc", [])


if __name__ == "__main__":
    sys.exit(main())
