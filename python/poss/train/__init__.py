"""Draft training (EAGLE-2, HASS, PosS-n): data sets (ShareGPT, distilled), target features, the aligned
multi-step objective, the training loop, validation, checkpoints and DDP, and releasing drafts and data
with their cards. Builds on :mod:`poss.models`.
"""
