"""The draft/verify loop from Python (README.md § In Python; more in docs/decoding.md).

    python examples/generate.py [--tiny]

Loads SmolLM2-135M with its shipped PosS draft (downloaded and converted on first use, ~700 MB in
~/.cache/poss). ``--tiny`` runs the same calls on a random tiny model instead (no download, no text).
"""

import sys

import poss

if "--tiny" in sys.argv:
    from poss.testing import eval_prompts, make_generator, tiny_target

    gen = make_generator(tiny_target(), draft=True, n=3, ppl=2, aligned=True)
    res = gen.generate(eval_prompts(1)[:1], max_new_tokens=16)
    print(res.token_ids[0], res.stats[0].tau, res.stats[0].accept_hist)
    sys.exit(0)

gen = poss.load("smollm2-135m", draft=poss.shipped_draft("smollm2-135m"))   # draft=None: plain AR
res = gen.generate(["Explain KV caches."], max_new_tokens=128)       # greedy = the target's own output
print(res.texts[0], res.stats[0].tau, res.stats[0].accept_hist)
for piece in gen.stream("Write a haiku.", 64, temperature=0.7, top_p=0.9):
    print(piece, end="")
print()
