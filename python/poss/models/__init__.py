"""Models on the poss ops: offline loading (registry), the static-cache target runner and the PosS draft."""
