"""A tiny random target + synthetic data for the training tests; also a script (resume and torchrun tests).

    python tests/helpers/train_tiny.py OUT [--max-batches N] [--resume] [--ckpt-minutes M] [--method ...]
    torchrun --nproc_per_node 2 tests/helpers/train_tiny.py OUT --grad-dump   # gradient-averaging check
"""

import argparse
from pathlib import Path

import torch

from poss.models.target import TargetRunner  # noqa: E402
from poss.train.data import Example  # noqa: E402


def tiny_target(seed=0, dtype=torch.float32, max_batch=2, max_seq=48):
    """A runner on poss.testing's random Llama, made smaller (vocab 128, hidden 128) for training tests."""
    from poss.testing import tiny_target as random_llama

    model = random_llama(vocab=128, layer_scale=1.0, seed=seed, hidden_size=128, intermediate_size=96,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         pad_token_id=None)
    return TargetRunner(model, max_batch=max_batch, max_seq=max_seq, dtype=dtype)


CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def randomize(draft, seed=0):
    """``draft`` with every parameter moved by seeded noise (std 0.05), in place: a draft whose layers
    differ from their initialisation, so tests see every weight at work."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return draft


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges (one token per byte, ids < 256) plus ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                   eos_token="<|im_end|>")
    fast.chat_template = CHATML
    return fast


def tiny_examples(n, seed=0, min_len=12, max_len=40, vocab=128):
    """Token streams with a learnable pattern (each token mostly follows from the previous one)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.empty(L, dtype=torch.int64)
        ids[0] = torch.randint(1, vocab, (1,), generator=g)
        for t in range(1, L):
            ids[t] = ((ids[t - 1] * 7 + 3) % vocab if torch.rand(1, generator=g) < 0.8
                      else torch.randint(1, vocab, (1,), generator=g))
        mask = torch.zeros(L, dtype=torch.int64)
        mask[L // 3:] = 1
        out.append(Example(ids, mask))
    return out


def make_trainer(out, method="poss", steps=4, ppl=2, n_train=8, batch_size=2, epochs=2, ckpt_minutes=10.0,
                 max_batches=None, info=None, noise=0.2, lr=1e-3, init_from=None, feature_cache=None, seed=0,
                 validate_every_epoch=False, draft_features=None, feature_layers=None, token_map=None):
    from poss.train.ddp import DistInfo
    from poss.train.loop import TrainConfig, Trainer

    torch.set_num_threads(1)
    runner = tiny_target(max_batch=batch_size)
    cfg = TrainConfig(method=method, steps=steps, positions_per_specialist=ppl, epochs=epochs, batch_size=batch_size,
                      lr=lr, noise_std=noise, checkpoint_minutes=ckpt_minutes, max_batches=max_batches, autocast="none",
                      warmup_frac=0.1, seed=seed, validate_every_epoch=validate_every_epoch,
                      draft_features=draft_features, feature_layers=feature_layers)
    return Trainer(runner, cfg, tiny_examples(n_train), tiny_examples(4, seed=1), out, target_name="tiny",
                   info=info or DistInfo(), progress_bar=False, init_from=init_from, feature_cache=feature_cache,
                   token_map=token_map)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--max-batches", type=int, default=None)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--n-train", type=int, default=8)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--ckpt-minutes", type=float, default=10.0)
    ap.add_argument("--slow", type=float, default=0.0, help="sleep per batch (gives a kill time to land)")
    ap.add_argument("--grad-dump", action="store_true")
    a = ap.parse_args()
    from poss.train.ddp import init_distributed, shutdown

    info = init_distributed("cpu")
    tr = make_trainer(a.out, n_train=a.n_train, epochs=a.epochs, ckpt_minutes=a.ckpt_minutes,
                      max_batches=a.max_batches, info=info, noise=0.0 if a.grad_dump else 0.2)
    if a.grad_dump:
        # One batch per rank: local gradients, then the averaged ones, plus the weights after one step.
        order = tr.order(0)
        idx = order[info.rank * tr.cfg.batch_size:(info.rank + 1) * tr.cfg.batch_size]
        tr.compute_gradients(idx, noise=False)
        local = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                 for n, p in tr.draft.named_parameters()}
        from poss.train.ddp import average_gradients

        average_gradients(tr.params, info)
        avg = {n: p.grad.clone() for n, p in tr.draft.named_parameters()}
        tr.opt.step()
        torch.save({"idx": idx, "local": local, "avg": avg, "weights": tr.draft.state_dict()},
                   Path(a.out) / f"rank{info.rank}.pt")
        shutdown(info)
        return
    if a.slow:
        import time

        orig = tr.optimizer_step

        def slow_step():
            orig()
            time.sleep(a.slow)

        tr.optimizer_step = slow_step
    if a.resume:
        tr.resume()
    tr.fit()
    shutdown(info)


if __name__ == "__main__":
    main()
