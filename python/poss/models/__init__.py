"""Models on the poss ops: what poss knows by name (registry, downloads, GGUF conversion), the
static-cache target runner, and the PosS draft (config, eager specialist, tree encoding, KV cache).

Depends only on ``poss_ext``; the decoding loop (:mod:`poss.decode`) and training (:mod:`poss.train`)
build on it.
"""
