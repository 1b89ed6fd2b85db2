#!/usr/bin/env bash
# Session 24: training run 5 of fluxion-tiny-retrieval (issue 18: bring `vt` to >= 0.8 with full
# attention). Continues from the committed export (run 4's weights; its checkpoint was not kept)
# with a fresh optimizer at run 4's data position (step 17304), vt's answer loss weighted 4 (run 4:
# 3; its vt loss was still falling when the run ended), aggregate 2, passage 1.5, no weight decay on
# the embeddings and norms; lr 4e-4 after a 100-step warmup, decaying linearly from step 17800 to
# 0.1x at 21600 (about what ~390 s of training reaches: run 4 ran 4,330 steps in 387 s). Then the
# full-attention evaluation at 1K / 4K / 16K (n = 50, the card's seeds) and the export.
# Needs nothing built: the device host's python3 has torch and transformers. Nothing carried.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out/r5/model"
PYTHONUNBUFFERED=1 python3 tools/train/train.py --out /tmp/r5 \
  --init-from models/fluxion-tiny-retrieval --start-step 17304 --warmup 100 \
  --lr 4e-4 --decay-start 17800 --max-steps 21600 --time-budget-s 395 --deadline-s 560 --workers 8 \
  --label-weights vt=4,aggregate=2,passage=1.5 --no-decay-embed-norm \
  --final-eval 50 --final-lengths 1024,4096,16384 --export /tmp/export 2>&1 | grep -v Warning | tail -45
cp /tmp/r5/log.txt /tmp/r5/results.json /tmp/r5/eval_final.json "$out/r5/" 2>/dev/null
cp /tmp/r5/model/config.json /tmp/r5/model/model.safetensors "$out/r5/model/" 2>/dev/null
ls -la "$out/r5" "$out/r5/model"
