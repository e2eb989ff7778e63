#!/usr/bin/env bash
# Learning-rate probe for continuing a draft: STEPS optimizer steps (batch 4) of EAGLE-2 from INIT at
# each peak LR in LRS, on the same batches (same seed and data order); prints the training loss and
# step-1 accuracy logged every 10 steps, which is enough to see which LR moves the draft forward and
# which one first undoes its training or diverges.
#
#   DATA=runs/distill INIT=drafts/eagle2 scripts/lr_probe.sh            # -> runs/lr-probe/lr*/metrics.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-runs/distill}
INIT=${INIT:-drafts/eagle2}
LRS=${LRS:-3e-4 1e-3 3e-3 1e-2}
STEPS=${STEPS:-60}
OUT=${OUT:-runs/lr-probe}
PY=${PY:-python}
export PYTHONPATH="$PWD:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
for lr in $LRS; do
  run="$OUT/lr$lr"
  [[ -f "$run/metrics.jsonl" ]] || "$PY" -m poss.cli train --target smollm2-135m --data "$DATA" --method eagle2 \
    --init-from "$INIT" --epochs 1 --batch-size 4 --lr "$lr" --max-batches "$STEPS" --threads 1 --out "$run" > "$run.log" 2>&1
  "$PY" - "$run/metrics.jsonl" "$lr" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith('{"step"')]
print(f"lr {sys.argv[2]:>6}: " + "  ".join(f"step {r['step']}: loss {r['loss']:.3f} acc@1 {r['acc'][0]:.3f}" for r in rows))
PY
done
