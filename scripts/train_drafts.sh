#!/usr/bin/env bash
# Train a target's drafts on its on-policy data (by default SmolLM2-135M-Instruct, data/distill-smollm2-135m,
# with the 8,192-token draft vocabulary): one shared EAGLE-2 initialisation, then EAGLE-2, HASS and
# PosS-1/2/3 each trained EPOCHS more epochs from it, with the same data, batch and learning rate (the
# paper's protocol: every method starts from the same EAGLE-2 and gets the same budget in epochs).
#
#   mkdir -p runs && nohup scripts/train_drafts.sh > runs/driver.log 2>&1 &   # all, in order
#   scripts/train_drafts.sh hass poss2                                          # only some
#   RUNS=DIR PY=PYTHON INIT=drafts/eagle2 scripts/train_drafts.sh poss2        # skip the init run
#
# Another target: TARGET (registry name, HF folder or .gguf), VOCAB (draft vocabulary), INIT_ARGS (the
# init run's schedule), e.g. the Qwen2.5-Coder drafts (data/distill-qwen2.5-coder-0.5b):
#   TARGET=qwen2.5-coder-0.5b VOCAB=16384 INIT_ARGS="--epochs 3" DATA=runs/distill-coder RUNS=runs/coder \
#     scripts/train_drafts.sh eagle2-init hass poss2
#
# Every run is resumable (re-running continues each unfinished run from its last checkpoint and skips
# finished ones: RUNS/<name>/draft/ exists). RUNS/distill must hold the data with its features:
#   mkdir -p runs/distill && xz -dc data/distill-smollm2-135m/records.jsonl.xz > runs/distill/records.jsonl
#   cp data/distill-smollm2-135m/meta.json runs/distill/ && poss distill --out runs/distill --rebuild-features
#
# Round 2 (continue every draft on more data): INIT_EACH=DIR starts each method from DIR/<name>
# (e.g. drafts: the shipped eagle2, hass, poss2) instead of the shared INIT, and TRAIN_START=K
# trains only on the training answers from the K-th on (those a later data set added):
#   DATA=runs/distill-bf16 INIT_EACH=drafts TRAIN_START=1116 RUNS=runs/round2 scripts/train_drafts.sh eagle2 hass poss2
#
# EXTRA="--feature-weight 0" passes more `poss train` flags to every run (here: EAGLE-3's objective,
# cross-entropy only, for the multi-step methods).
#
# The init run is the shipped drafts/eagle2 of 2026-11-30: epoch 3 of a 6-epoch linear schedule, the run
# stopped there (183 optimizer steps per epoch at batch 4 over the 732 training answers, so
# --max-batches 549). INIT is that run's best validated epoch; a stop on an epoch's last batch validates
# that epoch too (before 2026-12-05 it did not, so best covered epochs 1-2 only). Set INIT to an
# existing draft folder to start from it instead.
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-runs}
TARGET=${TARGET:-smollm2-135m}
VOCAB=${VOCAB:-8192}
INIT_ARGS=${INIT_ARGS:---epochs 6 --max-batches 549}
PY=${PY:-python}
DATA=${DATA:-$RUNS/distill}
INIT=${INIT:-$RUNS/eagle2-init/best}
EPOCHS=${EPOCHS:-1}
# 3e-4: a learning-rate probe from drafts/eagle2 (scripts/lr_probe.sh, removed in c546da9) (60 steps on the same batches): 3e-4 lowered the loss at
# every logged step, 1e-3 first undid part of the init's training, 3e-3 and 1e-2 diverged.
LR=${LR:-3e-4}
BATCH=${BATCH:-4}
THREADS=${THREADS:-1}
CKPT_MIN=${CKPT_MIN:-5}
INIT_EACH=${INIT_EACH:-}
TRAIN_START=${TRAIN_START:-0}
TRAIN_SIZE=${TRAIN_SIZE:-1000}
read -r -a EXTRA <<< "${EXTRA:-}"
STEPS=6   # draft positions trained by PosS, as the paper does
export PYTHONPATH="$PWD:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"

common=(--target "$TARGET" --data "$DATA" --batch-size "$BATCH" --lr "$LR" --threads "$THREADS"
        --checkpoint-minutes "$CKPT_MIN" --validate-every-epoch --resume --train-start "$TRAIN_START"
        --train-size "$TRAIN_SIZE" ${EXTRA[@]+"${EXTRA[@]}"})

run() {  # name, extra args...
  local name=$1; shift
  local out="$RUNS/$name"
  if [[ -f "$out/draft/config.json" ]]; then echo "$name: done ($out/draft)"; return; fi
  mkdir -p "$out"
  echo "$name: training -> $out ($(date -u))"
  "$PY" -m poss.cli train "${common[@]}" --out "$out" "$@" >> "$out/train.log" 2>&1
  echo "$name: finished ($(date -u))"
}

init_of() { [[ -n "$INIT_EACH" ]] && echo "$INIT_EACH/$1" || echo "$INIT"; }
after() { echo --epochs "$EPOCHS" --init-from "$(init_of "$1")"; }
want=("${@:-eagle2-init eagle2 hass poss1 poss2 poss3}")
want=(${want[@]})
for m in "${want[@]}"; do
  case $m in
    eagle2-init) [[ -f "$INIT/config.json" ]] || run eagle2-init --method eagle2 --draft-vocab "$VOCAB" $INIT_ARGS ;;
    eagle2) run eagle2 --method eagle2 $(after eagle2) ;;
    hass)   run hass --method hass --steps 3 $(after hass) ;;
    poss1)  run poss1 --method poss --steps $STEPS --positions-per-specialist 1 $(after poss1) ;;
    poss2)  run poss2 --method poss --steps $STEPS --positions-per-specialist 2 $(after poss2) ;;
    poss3)  run poss3 --method poss --steps $STEPS --positions-per-specialist 3 $(after poss3) ;;
    *) echo "unknown run $m (eagle2-init eagle2 hass poss1 poss2 poss3)"; exit 2 ;;
  esac
done
