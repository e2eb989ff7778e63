"""The model layer: an offline target, the static-cache runner and a PosS draft.

(docs/models.md § Models: offline targets, the static-cache runner and the PosS draft)

    python examples/models.py

Loads SmolLM2-135M (downloaded and converted on first use, ~700 MB in ~/.cache/poss).
"""

from poss.models.draft import PosSDraft
from poss.models.draft_config import DraftConfig
from poss.models.registry import load_model
from poss.models.target import TargetRunner

tok, hf = load_model("smollm2-135m")          # or "qwen2.5-coder-0.5b", an HF folder, a .gguf file
target = TargetRunner(hf, max_batch=4, max_seq=2048)        # fp32; dtype=torch.bfloat16 works too
prompts = [tok("Hello").input_ids, tok("Hi there").input_ids]
last_logits, features = target.prefill(prompts)             # ragged prompts, one forward
print("next tokens:", last_logits.argmax(-1).tolist(), "features:", tuple(features.shape))
cfg = DraftConfig.for_target(hf.config, "smollm2-135m", target.fingerprint(),
                             n_specialists=3, positions_per_specialist=2)   # PosS-2; N=1 is EAGLE-2/HASS
draft = PosSDraft(cfg).attach(target, max_batch=4, max_seq=2048)
print("draft position 5 runs specialist", draft.specialist_for(5), "of", cfg.n_specialists)
