"""Helpers of the test suite (imported as ``helpers.*``; ``tests/`` is on ``sys.path`` under pytest).

- ``devices``: the devices a kernel test runs on; ``child_env``: the environment of a child process.
- ``tree_cases``: random trees and sampling parameters for the op tests.
- ``loop``: tiny models for the decoding-loop tests (from :mod:`poss.testing`) and HF references.
- ``sampling``: the chi-square check that the loop's first 3 sampled tokens follow the target's distribution.
- ``targets``: tiny random Llama / Qwen2 / Mistral models for the target-runner and draft tests.
- ``train_tiny``: a tiny target and synthetic data for the training tests; also a script.
- ``scripts``: ``load_script(name)``, a ``scripts/*.py`` file as a module.
- ``fake_drafts``: fake draft folders and validation records for the release and draft-report tests.
"""
