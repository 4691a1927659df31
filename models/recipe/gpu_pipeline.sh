#!/usr/bin/env bash
# Full training run for the three tiers on one GPU machine (what produced the
# committed GGUFs). Run from the repository root:
#   bash models/recipe/gpu_pipeline.sh /tmp/work
# Writes the corpus, trains t1, t2 and t3 concurrently on the one GPU (each for
# its own time budget, so the small tiers free the GPU for t3's last minutes),
# then continues t3 alone from its exported weights for CONTINUE_T3 minutes (the
# largest tier needs the most tokens and got the least GPU while sharing it), and
# recomputes each tier's llama.cpp greedy references (reference.py, CPU) as soon
# as that tier is final. The committed models: MIN_T1=4.5 MIN_T2=5.5 MIN_T3=6.5
# CONTINUE_T3=8 (run as two device calls; logs in recipe/logs/).
set -euo pipefail
WORK=${1:-/tmp/mesh-train}
EXAMPLES=${EXAMPLES:-600000}
MIN_T1=${MIN_T1:-5}
MIN_T2=${MIN_T2:-6}
MIN_T3=${MIN_T3:-7}
CONTINUE_T3=${CONTINUE_T3:-8}
REF_TIMEOUT=${REF_TIMEOUT:-0}   # seconds per tier for reference.py; 0 = no limit (t3 takes ~40 min on one core)
COPY_TO=${COPY_TO:-}   # where finished artefacts go as soon as they exist (GGUFs split at 15 MiB)
mkdir -p "$WORK/fixtures"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
[ -f "$WORK/data/tokens.npy" ] || python3 models/recipe/train.py data --out "$WORK/data" --examples "$EXAMPLES"
publish() {
  [ -n "$COPY_TO" ] || return 0
  local t=$1
  mkdir -p "$COPY_TO/$t"
  cp "$WORK/$t.out" "$WORK/$t/train.log" "$COPY_TO/$t/" 2>/dev/null || true
  cp "$WORK/fixtures/greedy-$t.json" "$COPY_TO/$t/" 2>/dev/null || true
  [ -f "$WORK/$t/$t-q8_0.gguf" ] && split -b 15M "$WORK/$t/$t-q8_0.gguf" "$COPY_TO/$t/$t-q8_0.gguf.part-"
  return 0
}
tier() {
  local t=$1 minutes=$2
  python3 models/recipe/train.py fit --tier "$t" --data "$WORK/data" --out "$WORK/$t" --minutes "$minutes" \
    --compile --eval-n 50 > "$WORK/$t.out" 2>&1
  if [ "$t" = t3 ] && [ "$CONTINUE_T3" != 0 ]; then
    mv "$WORK/t3" "$WORK/t3-first"
    python3 models/recipe/train.py fit --tier t3 --data "$WORK/data" --out "$WORK/t3" --minutes "$CONTINUE_T3" \
      --init "$WORK/t3-first/t3-q8_0.gguf" --lr 5e-4 --compile --eval-n 25 >> "$WORK/$t.out" 2>&1
  fi
  cp "$WORK/$t/greedy.json" "$WORK/fixtures/greedy-$t.json"
  publish "$t"
  timeout "${REF_TIMEOUT/#0/infinity}" python3 models/recipe/reference.py --tier "$t" --models "$WORK/$t" \
    --fixtures "$WORK/fixtures" --threads 4 >> "$WORK/$t.out" 2>&1 || echo "[$t] reference.py did not finish" >> "$WORK/$t.out"
  [ -z "$COPY_TO" ] || rm -rf "${COPY_TO:?}/$t"
  publish "$t"
}
tier t1 "$MIN_T1" &
tier t2 "$MIN_T2" &
tier t3 "$MIN_T3" &
wait
tail -n 14 "$WORK"/t?.out
