#!/usr/bin/env bash
# Full training run for the three tiers on one GPU machine (what produced the
# committed GGUFs), in two stages that fit the device's 10-minute calls. Run
# from the repository root:
#   STAGE=1 bash models/recipe/gpu_pipeline.sh /tmp/work    # corpus; the stage-1 tiers
#   STAGE=2 bash models/recipe/gpu_pipeline.sh /tmp/work    # the stage-2 tiers; every reference
# A tier trains for its own time budget (MIN_<tier> minutes, bf16, torch.compile);
# tiers of one stage share the GPU. t3 trains alone in stage 1 because the
# largest tier needs the most tokens and runs at a third of its speed when it
# shares the GPU. After training, each tier's llama.cpp greedy references are
# recomputed (reference.py, CPU), split over REF_SHARDS processes and merged.
# The committed models: STAGE1_TIERS=t3 MIN_T3=7.5, then t1 (MIN_T1=3.5) and
# t2 (MIN_T2=3.5) in stage-2 calls (logs in recipe/logs/).
set -euo pipefail
WORK=${1:-/tmp/mesh-train}
STAGE=${STAGE:-all}
EXAMPLES=${EXAMPLES:-600000}
STAGE1_TIERS=${STAGE1_TIERS:-t3}
STAGE2_TIERS=${STAGE2_TIERS:-t1 t2}
MIN_T1=${MIN_T1:-3.5}
MIN_T2=${MIN_T2:-3.5}
MIN_T3=${MIN_T3:-7.5}
EVAL_N=${EVAL_N:-25}               # quick held-out evaluation after training (the card is measured separately)
REF_SHARDS=${REF_SHARDS:-10}       # parallel reference.py processes per tier (REF_SHARDS_T3=... for one tier)
REF_TIMEOUT=${REF_TIMEOUT:-infinity}  # per shard; a shard writes each case as it finishes, so a timeout keeps what is done
COPY_TO=${COPY_TO:-}   # where finished artefacts go as soon as they exist (GGUFs split at 15 MiB)
mkdir -p "$WORK/fixtures"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'

minutes() { case $1 in t1) echo "$MIN_T1" ;; t2) echo "$MIN_T2" ;; t3) echo "$MIN_T3" ;; esac; }

publish() {
  [ -n "$COPY_TO" ] || return 0
  local t=$1
  mkdir -p "$COPY_TO/$t"
  cp "$WORK/$t.out" "$COPY_TO/$t/" 2>/dev/null || true
  cp "$WORK/fixtures/greedy-$t.json" "$COPY_TO/$t/" 2>/dev/null || true
  rm -f "$COPY_TO/$t/$t-q8_0.gguf"*
  if [ -f "$WORK/$t/$t-q8_0.gguf" ]; then
    if [ "$(stat -c %s "$WORK/$t/$t-q8_0.gguf")" -gt 15728640 ]; then
      split -b 15M "$WORK/$t/$t-q8_0.gguf" "$COPY_TO/$t/$t-q8_0.gguf.part-"
    else
      cp "$WORK/$t/$t-q8_0.gguf" "$COPY_TO/$t/"
    fi
  fi
  return 0
}

fit() {
  local t=$1
  python3 models/recipe/train.py fit --tier "$t" --data "$WORK/data" --out "$WORK/$t" --minutes "$(minutes "$t")" \
    --compile --eval-n "$EVAL_N" > "$WORK/$t.out" 2>&1
  cp "$WORK/$t/greedy.json" "$WORK/fixtures/greedy-$t.json"
}

# reference.py's exact ggml emulation is slow (about 4 / 9 / 25 s per case and
# core for t1 / t2 / t3), so the 100 cases are split over N processes and merged.
references() {
  local t=$1 k pids=() n
  n=$(eval echo "\${REF_SHARDS_${t^^}:-$REF_SHARDS}")
  for k in $(seq 0 $((n - 1))); do
    timeout "$REF_TIMEOUT" python3 models/recipe/reference.py --tier "$t" --models "$WORK/$t" --fixtures "$WORK/fixtures" \
      --shard "$k/$n" --shard-out "$WORK/ref-$t-$k.json" > "$WORK/ref-$t-$k.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || echo "[$t] a reference shard stopped early" >> "$WORK/$t.out"; done
  python3 models/recipe/reference.py --fixtures "$WORK/fixtures" --merge "$WORK"/ref-"$t"-*.json >> "$WORK/$t.out" 2>&1
}

[ -f "$WORK/data/tokens.npy" ] || python3 models/recipe/train.py data --out "$WORK/data" --examples "$EXAMPLES"
if [ "$STAGE" = 1 ] || [ "$STAGE" = all ]; then
  for t in $STAGE1_TIERS; do (fit "$t" && publish "$t") & done
  wait
fi
if [ "$STAGE" = 2 ] || [ "$STAGE" = all ]; then
  for t in $STAGE2_TIERS; do (fit "$t" && publish "$t" && references "$t" && publish "$t") & done
  for t in $STAGE1_TIERS; do (references "$t" && publish "$t") & done
  wait
fi
tail -n 14 "$WORK"/t?.out
