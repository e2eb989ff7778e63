"""Draft training (EAGLE-2, HASS, PosS-n): data sets (ShareGPT, distilled), target features, the aligned
multi-step objective, the training loop, validation, checkpoints and DDP. Builds on :mod:`poss.models`.
"""
