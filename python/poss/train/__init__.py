"""Draft training (EAGLE-2, HASS, PosS-n): data, features, aligned attention, objective, loop, DDP."""
