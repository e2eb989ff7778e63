#!/usr/bin/env bash
# EAGLE-2, EAGLE-3 and PosS-2 on EAGLE-3 features for SmolLM2-135M at one equal budget: every method
# starts from the same kind of start (random layers, seed 0; EAGLE-3's own head from the target's rows),
# sees the same answers once (the first TRAIN_SIZE training answers of the shipped bf16 data, 8,192-token
# draft vocabulary), with the same batch and learning rate. EAGLE-3 and PosS-on-EAGLE-3 run the same
# training-time test (STEPS drafted positions, EAGLE-3's 0.8^k weights), so the specialists are the one
# difference between them.
#
#   mkdir -p runs/distill-bf16 && xz -dc data/distill-smollm2-135m-bf16/records.jsonl.xz > runs/distill-bf16/records.jsonl
#   cp data/distill-smollm2-135m-bf16/meta.json runs/distill-bf16/
#   scripts/train_eagle3_compare.sh eagle3 eagle2-scratch &     # one core
#   scripts/train_eagle3_compare.sh poss2-e3 &          # the other
#
# Every run checkpoints every CKPT_MIN minutes and resumes when re-run; a finished run (RUNS/<name>/draft/)
# is skipped. Then score them on MT-Bench (docs/training.md, "EAGLE-3 at an equal budget").
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-runs/e3b}
DATA=${DATA:-runs/distill-bf16}
TRAIN_SIZE=${TRAIN_SIZE:-1200}
EPOCHS=${EPOCHS:-1}
STEPS=${STEPS:-6}   # the depth of the 60-node trees the evaluation verifies
PY=${PY:-python}
export PYTHONPATH="$PWD:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"

common=(--target smollm2-135m --data "$DATA" --batch-size 4 --lr 3e-4 --threads 1 --train-size "$TRAIN_SIZE"
        --draft-vocab 8192 --features online --checkpoint-minutes "${CKPT_MIN:-5}" --validate-every-epoch
        --resume --epochs "$EPOCHS" --seed 0)

run() {  # name, extra args...
  local name=$1; shift
  if [[ -f "$RUNS/$name/draft/config.json" ]]; then echo "$name: done ($RUNS/$name/draft)"; return; fi
  mkdir -p "$RUNS/$name"
  echo "$name: training -> $RUNS/$name ($(date -u))"
  "$PY" -m poss.cli train "${common[@]}" --out "$RUNS/$name" "$@" >> "$RUNS/$name/train.log" 2>&1
  echo "$name: finished ($(date -u))"
}

for m in ${*:-eagle2-scratch eagle3 poss2-e3}; do
  case $m in
    eagle2-scratch) run eagle2-scratch --method eagle2 ;;
    eagle3)         run eagle3 --method eagle3 --steps "$STEPS" ;;
    poss2-e3)       run poss2-e3 --method poss --draft-features eagle3 --steps "$STEPS" --positions-per-specialist 2 \
                        --position-weights eagle3 ;;
    *) echo "unknown run $m (eagle2-scratch eagle3 poss2-e3)"; exit 2 ;;
  esac
done
