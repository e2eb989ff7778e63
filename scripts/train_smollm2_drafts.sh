#!/usr/bin/env bash
# Train the SmolLM2-135M-Instruct drafts: EAGLE-2 first, then HASS and PosS-1/2/3 initialised from it.
# Every run is resumable: re-running this script continues each unfinished run from its last
# checkpoint (written every CKPT_MIN minutes) and skips finished ones (RUNS/<name>/draft/ exists).
#
#   mkdir -p runs && nohup scripts/train_smollm2_drafts.sh > runs/driver.log 2>&1 &   # all, in order
#   scripts/train_smollm2_drafts.sh eagle2                                              # only some
#   RUNS=DIR PY=PYTHON scripts/train_smollm2_drafts.sh                                  # elsewhere, another Python
#
# RUNS (default runs/ in the repo root) holds one folder per run; PY (default: the python on PATH)
# must have poss's dependencies; the source tree is put first on PYTHONPATH.
#
# Budget (measured on the shared, busy 2-core dev machine, bs 1, max_len 1024):
# EAGLE-2 ~450-900 tok/s with cached features (~100 on the first pass, which also fills the feature
# cache), PosS (6 steps) ~58 tok/s, both while another run shared the CPU. TRAIN_SIZE=440 (~405 kept,
# ~340k tokens) x 1 epoch keeps each PosS run under ~2 h there; every method gets the same data
# and epochs. LR 3e-4 (not the paper's 3e-5): with only ~400 optimizer steps a 3e-5 run barely
# moves a fresh draft (probe: 40 steps at 1e-3 / 3e-4 both reach ~12% top-1 agreement).
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-runs}
PY=${PY:-python}
TRAIN_SIZE=${TRAIN_SIZE:-440}
VAL_SIZE=${VAL_SIZE:-50}
MAX_LEN=${MAX_LEN:-1024}
EPOCHS=${EPOCHS:-1}
LR=${LR:-3e-4}
CKPT_MIN=${CKPT_MIN:-10}
STEPS=6   # draft positions trained, as the paper does at 13B
export PYTHONPATH="$PWD:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"

common=(--target smollm2-135m --train-size "$TRAIN_SIZE" --val-size "$VAL_SIZE" --max-len "$MAX_LEN"
        --epochs "$EPOCHS" --lr "$LR" --checkpoint-minutes "$CKPT_MIN" --features cache --resume)

run() {  # name, extra args...
  local name=$1; shift
  local out="$RUNS/$name"
  if [[ -f "$out/draft/config.json" ]]; then echo "$name: done ($out/draft)"; return; fi
  mkdir -p "$out"
  echo "$name: training -> $out ($(date -u))"
  "$PY" -m poss.cli train "${common[@]}" --out "$out" "$@" >> "$out/train.log" 2>&1
  echo "$name: finished ($(date -u))"
}

want=("${@:-eagle2 hass poss1 poss2 poss3}")
want=(${want[@]})
for m in "${want[@]}"; do
  case $m in
    eagle2) run eagle2 --method eagle2 ;;
    hass)   run hass --method hass --steps 3 --init-from "$RUNS/eagle2/draft" ;;
    poss1)  run poss1 --method poss --steps $STEPS --positions-per-specialist 1 --init-from "$RUNS/eagle2/draft" ;;
    poss2)  run poss2 --method poss --steps $STEPS --positions-per-specialist 2 --init-from "$RUNS/eagle2/draft" ;;
    poss3)  run poss3 --method poss --steps $STEPS --positions-per-specialist 3 --init-from "$RUNS/eagle2/draft" ;;
    *) echo "unknown run $m (eagle2 hass poss1 poss2 poss3)"; exit 2 ;;
  esac
done
