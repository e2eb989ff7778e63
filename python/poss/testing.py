"""Tiny random models for tests, benchmarks and examples: a random HF Llama target, a random PosS draft
on it, a :class:`Generator` over both, and byte-level prompts from the packaged eval sets.

Nothing here is trained: the models run the real code paths in milliseconds, without a download.
"""

import torch

from poss.data.eval_sets import EVAL_SETS, load_eval_set
from poss.decode.generator import Generator
from poss.models.draft import PosSDraft
from poss.models.draft_config import DraftConfig
from poss.models.target import TargetRunner


def tiny_target(vocab=300, layer_scale=0.1, seed=0, dtype=torch.float32, **over):
    """A random HF Llama. ``layer_scale < 1`` shrinks what the layers add to the residual stream, so
    the next token depends mostly on the current one (a draft can then learn nothing and still agree
    with it often: a cheap way to exercise long accepted paths)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab, hidden_size=256, intermediate_size=192, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=2,
               bos_token_id=1, pad_token_id=0)
    cfg.update(over)
    config = LlamaConfig(**cfg)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(layer_scale)
    return model.to(dtype)


def random_draft(runner, n=1, ppl=1, seed=0, aligned=False, draft_vocab=0, schedule=(), fc_per_specialist=False,
                 features="last", feature_layers=()):
    """A randomly initialised PosS draft on ``runner``. ``aligned``: fc passes the token embedding
    through and the specialists add little, so the draft guesses the target's bigram map.
    ``draft_vocab = K``: a reduced draft vocabulary of K random token ids (seeded). ``schedule`` /
    ``fc_per_specialist``: a depth-aware layout (:class:`DraftConfig`). ``features="eagle3"``: an
    EAGLE-3 draft (``n = 1``) or PosS on EAGLE-3 features over the target's ``feature_layers`` (default
    EAGLE-3's); the runner is set to return them (:func:`align_eagle3` for ``aligned``)."""
    cfg = DraftConfig.for_target(runner.config, "tiny", runner.fingerprint(), n_specialists=n,
                                 positions_per_specialist=ppl, fc_bias=features == "last", draft_vocab=draft_vocab,
                                 schedule=list(schedule), fc_per_specialist=fc_per_specialist, features=features,
                                 feature_layers=list(feature_layers))
    torch.manual_seed(seed)
    d = PosSDraft(cfg)
    if draft_vocab:
        d.token_map.copy_(torch.randperm(cfg.vocab)[:draft_vocab].sort().values)
    H = cfg.hidden
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.copy_(torch.randn_like(p) * (0.05 if p.dim() == 2 else 0.2) + (1.0 if name.endswith("norm") else 0.0))
        if aligned and d.eagle3:
            align_eagle3(d, runner)
        elif aligned:
            for fc in {id(d.fc_for(j)): d.fc_for(j) for j in range(n)}.values():
                fc.weight.mul_(0.1)
                fc.weight[:, :H] += torch.diag(runner.final_norm_w.float())  # the target head sees norm(h) * w
                fc.bias.zero_()
            for layer in d.layers:
                layer.o_proj.weight.mul_(0.02)
                layer.down_proj.weight.mul_(0.02)
    runner.set_feature_layers(d.feature_layers_for(len(runner.layers)))
    return d.to(runner.dtype).attach(runner, max_batch=1, max_seq=64)


@torch.no_grad()
def align_eagle3(d: PosSDraft, runner, sharp: float = 2.0) -> None:
    """Make a random EAGLE-3 draft guess the target's bigram map: each layer attends (almost) only to
    its own token and copies the first ``Hkv * D`` coordinates of its normalised embedding into the
    output, which the draft's head (the target's final norm and lm_head rows) scores. fc and the MLP
    add little. Needs ``kv_heads * head_dim <= hidden``."""
    c = d.config
    H, D, Hq, Hkv = c.hidden, c.head_dim, c.heads, c.kv_heads
    if Hkv * D > H:
        raise ValueError("align_eagle3 needs kv_heads * head_dim <= hidden")
    d.fc.weight.mul_(0.01)
    d.norm.copy_(runner.final_norm_w.float())
    rows = torch.arange(c.vocab) if d.token_map is None else d.token_map
    d.lm_head.weight.copy_(runner.lm_head.float().cpu()[rows])
    eye = torch.eye(D)
    for layer in d.layers:
        w = layer.qkv_proj.weight
        w.zero_()
        layer.input_norm.fill_(1.0)
        for h in range(Hq):
            g = h // (Hq // Hkv)
            w[h * D:(h + 1) * D, g * D:(g + 1) * D] = sharp * eye  # q: the token's own coordinates
        for g in range(Hkv):
            k0, v0 = Hq * D + g * D, Hq * D + Hkv * D + g * D
            w[k0:k0 + D, g * D:(g + 1) * D] = sharp * eye  # k: the same, so a token matches itself
            w[v0:v0 + D, g * D:(g + 1) * D] = eye  # v: copied
        o = layer.o_proj.weight
        o.zero_()
        for g in range(Hkv):
            h = g * (Hq // Hkv)  # the first query head of each group writes its group's coordinates
            o[g * D:(g + 1) * D, h * D:(h + 1) * D] = 3.0 * eye
        layer.down_proj.weight.mul_(0.02)


def make_generator(model, draft=None, dtype=None, **draft_kw):
    """A :class:`Generator` on ``model`` (batch 1, 64 positions), with a :func:`random_draft` when ``draft``."""
    runner = TargetRunner(model, max_batch=1, max_seq=64, dtype=dtype)
    d = random_draft(runner, **draft_kw) if draft else None
    eos = model.generation_config.eos_token_id
    return Generator(runner, draft=d, end_ids={eos} if eos is not None else set())


def eval_prompts(n_per_set=4, max_len=48, vocab=300):
    """``6 * n_per_set`` prompts, ``n_per_set`` from each eval set, as UTF-8 bytes folded into the vocab."""
    out = []
    for name in sorted(EVAL_SETS):
        records = load_eval_set(name)
        for i in range(n_per_set):
            text = records[(17 * i + 3) % len(records)]["turns"][0]
            out.append([b % vocab for b in text.encode()][:max_len])
    return out


def byte_chat_tokenizer():
    """An HF fast tokenizer with one token per byte (ids < 256) and a two-token chat template
    (``<user>`` text ``<bot>``): enough for the code that applies chat templates (``gen.encode`` of
    messages, ``poss.train.regenerate``) on a :func:`tiny_target` (vocab 300)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, additional_special_tokens=["<user>", "<bot>"],
                                   eos_token="<bot>")
    fast.chat_template = ("{% for m in messages %}{{ ('<user>' if m['role'] == 'user' else '<bot>') + m['content'] }}"
                          "{% endfor %}{% if add_generation_prompt %}{{ '<bot>' }}{% endif %}")
    return fast
