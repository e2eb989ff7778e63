#!/usr/bin/env bash
# Training tokens/s with the reduced draft vocabulary against the full one, EAGLE-2 (1 step) and
# PosS-2 (6 steps), on a `poss distill` folder, one after another in one run:
#   bash scripts/train_throughput.sh runs/distill [batches] [threads]
set -euo pipefail
data=${1:?usage: train_throughput.sh DISTILL_DIR [batches] [threads]}
batches=${2:-15}
threads=${3:-1}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
printf '| method | draft vocabulary | tokens | seconds | tokens/s |\n|---|---|---|---|---|\n'
for method in "eagle2" "poss --steps 6 --positions-per-specialist 2"; do
  for k in 8192 0; do
    name=${method%% *}-$k
    python -m poss.cli train --data "$data" --method $method --draft-vocab "$k" --batch-size 4 --lr 1e-3 \
      --max-batches "$batches" --threads "$threads" --checkpoint-minutes 1000 --out "$out/$name" \
      > "$out/$name.json" 2> "$out/$name.log"
    python - "$out/$name.json" "${method%% *}" "$k" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
p = json.loads(text[text.index("{"):])["progress"]
k = "full (49,152)" if sys.argv[3] == "0" else sys.argv[3]
print(f"| {sys.argv[2]} | {k} | {p['tokens']} | {p['seconds']:.1f} | {p['tokens'] / p['seconds']:.0f} |")
PY
  done
done
