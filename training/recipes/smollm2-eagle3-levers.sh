#!/bin/bash
# The eagle3 small-data levers on SmolLM2-135M-Instruct, on the same self-distilled data as the experimental
# same-data heads (checkpoints/experimental/smollm2-135m-instruct-eagle3): each lever alone for one epoch, then
# eagle, eagle3 and eagle3 with the levers for three. Resumable: a run whose heads exist is skipped. ~50 min on
# 2 CPU cores. Figures: eval/README.md, "eagle3 levers at small data".
#
#   bash training/recipes/smollm2-eagle3-levers.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
DATA=runs/data/smollm2-sd1200.jsonl
[ -f runs/levers/data.done ] || {
  mkdir -p runs/levers
  $PY training/generate_data.py --model smollm2-135m-instruct --data sharegpt --split train --max-examples 1250 \
    --max-new-tokens 160 --max-prompt-tokens 384 --batch-size 48 --dtype bfloat16 --out $DATA
  touch runs/levers/data.done
}
train() {  # output folder, config, flags...
  local out=$1 cfg=$2
  shift 2
  [ -f "$out/heads/heads.safetensors" ] && return
  mkdir -p "$(dirname "$out")"
  $PY training/train_heads.py --config "$cfg" --output-dir "$out" "$@" > "$out.log" 2>&1
}
EAGLE=training/configs/smollm2-eagle-samedata.json
EAGLE3=training/configs/smollm2-eagle3-samedata.json
LEVERS=(--loss-arg feature_weight=1.0 --loss-arg topk_weight=1.0 --head-arg train_lm_head=false)
WARM=(--warm-start checkpoints/smollm2-135m-instruct-eagle)
# one epoch (244 steps), each lever alone
ONE=(--epochs 1 --warmup-steps 20)
train runs/levers/1/base $EAGLE3 "${ONE[@]}"
train runs/levers/1/feature $EAGLE3 "${ONE[@]}" --loss-arg feature_weight=1.0
train runs/levers/1/topk $EAGLE3 "${ONE[@]}" --loss-arg topk_weight=1.0
train runs/levers/1/frozen-lm $EAGLE3 "${ONE[@]}" --head-arg train_lm_head=false
train runs/levers/1/curriculum $EAGLE3 "${ONE[@]}" --loss-arg curriculum_steps=60
train runs/levers/1/warm $EAGLE3 "${ONE[@]}" "${WARM[@]}"
# three epochs (732 steps): eagle vs eagle3 on the same data, then eagle3 with the levers (and warm started)
train runs/levers/3/eagle $EAGLE
train runs/levers/3/eagle3 $EAGLE3
train runs/levers/3/levers $EAGLE3 "${LEVERS[@]}"
train runs/levers/3/levers-warm $EAGLE3 "${LEVERS[@]}" "${WARM[@]}"
# the eagle heads' MLP is 1152 wide (eagle3's default, the target's 1536): at that width every MLP tensor fits too
train runs/levers/3/warm-fit $EAGLE3 --head-arg intermediate_size=1152 "${WARM[@]}"
grep -o 'epoch [0-9]*: held-out top-1 by depth \[[^]]*\]' runs/levers/*/*.log
