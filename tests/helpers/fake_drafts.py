"""Fake draft folders and validation records for the release and draft-report tests: a config.json as
``poss train`` writes it (a PosS-2 recipe unless told otherwise) and weights that are only placeholder bytes."""

import json
from pathlib import Path


def fake_config(method="poss", ppl=2, steps=6, autocast="bf16", tokens=257868, epoch=None, epochs=1,
                init_from="absent"):
    n_spec = 3 if method == "poss" else 1
    training = {
        "recipe": {"method": method, "steps": steps, "positions_per_specialist": ppl, "n_specialists": n_spec,
                   "epochs": epochs, "lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01, "warmup_frac": 0.01,
                   "clip_value": 0.5, "noise_std": 0.2, "v_weight": 1.0, "p_weight": 0.1, "topk_weight": 0.0,
                   "autocast": autocast, "batch_size": 4, "seed": 0, "max_batches": None},
        "data": {"source": "poss distill", "decoding": "greedy", "dtype": "float32", "max_new_tokens": 384,
                 "prompt_source": "sharegpt first user turn, English", "n_train": 732, "n_val": 100, "max_len": 1024,
                 "train_tokens": 257868, "train_fingerprint": "06dfb3821e6001a5",
                 "val_fingerprint": "7b020dbc9d6cad1f"},
        "world_size": 1, "train_seconds": 935.6, "tokens": tokens,
        "val": {"acc": [0.361, 0.276, 0.262, 0.256, 0.254, 0.248][:steps], "loss": [0.8] * steps},
    }
    if epoch is not None:
        training["epoch"] = epoch
    if init_from != "absent":
        training["init_from"] = init_from
    return {"target_name": "smollm2-135m", "target_fingerprint": "13bc15c4cd0799d1", "n_specialists": n_spec,
            "positions_per_specialist": ppl, "hidden": 576, "heads": 9, "kv_heads": 3, "ffn": 1536,
            "draft_vocab": 8192, "vocab": 49152, "training": training}


def fake_val(acc):
    key = {"draft_sha256_16": "0" * 16, "steps": 6, "dtype": "bfloat16", "autocast": "bf16",
           "split": "poss distill runs/distill", "val_fingerprint": "7b020dbc9d6cad1f", "n_val": 100}
    return {"key": key, "acc": acc, "loss": [0.9] * len(acc), "tokens": 27695}


def write_draft(folder: Path, cfg: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").write_bytes(b"not really weights")
    return folder
