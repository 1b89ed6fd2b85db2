#!/usr/bin/env bash
# Device call 2 of session 2: training run 4 of fluxion-tiny-retrieval, resumed from run 3's
# checkpoint (copied to tools/train/ckpt, carried), on the TASKS.md v2 definitions (vt in RULER's
# form, lowercase passages), lr decaying from step 14000, then the full-attention evaluation at
# 1K/4K/16K (n = 50) and the export. Carry ["tools/train/ckpt"] (37 MB: no room for a bundle).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
PYTHONUNBUFFERED=1 python3 tools/train/train.py --out /tmp/r4 --resume tools/train/ckpt \
  --lr 6e-4 --decay-start 14000 --max-steps 17700 --time-budget-s 395 --deadline-s 560 --workers 8 \
  --label-weights vt=3,aggregate=2,passage=1.5 --no-decay-embed-norm \
  --final-eval 50 --final-lengths 1024,4096,16384 --export /tmp/export 2>&1 | grep -v Warning | tail -40
mkdir -p "$out/r4/model"
cp /tmp/r4/log.txt /tmp/r4/results.json /tmp/r4/eval_final.json "$out/r4/" 2>/dev/null
cp /tmp/r4/model/config.json /tmp/r4/model/model.safetensors "$out/r4/model/" 2>/dev/null
ls -la "$out" "$out/r4" "$out/r4/model"
