#!/usr/bin/env bash
# Full training run for the three tiers on one GPU machine (what produced the
# committed GGUFs). Run from the repository root:
#   bash models/recipe/gpu_pipeline.sh /tmp/work            # both stages
#   STAGE=1 bash models/recipe/gpu_pipeline.sh /tmp/work    # then STAGE=2, STAGE=3 (three calls)
# Stage 1 writes the corpus and trains t1, t2 and t3 concurrently on the one GPU
# (each for its own time budget, so the small tiers free the GPU for t3's last
# minutes); t1's and t2's llama.cpp greedy references (reference.py, CPU) are
# computed as soon as each tier is final, in REF_SHARDS parallel processes.
# Stage 2 continues t3 alone from its exported weights for CONTINUE_T3 minutes
# (the largest tier needs the most tokens and got the least GPU while sharing
# it); stage 3 computes t3's references the same way. Stages 2 and 3 each fit in
# a 10-minute slot of a shared GPU machine; stage 1 does not once its references
# run (recipe/logs/pipeline.log says how the committed run was split). The
# committed models: MIN_T1=3.5 MIN_T2=4.5 MIN_T3=6 CONTINUE_T3=6.
set -euo pipefail
WORK=${1:-/tmp/mesh-train}
STAGE=${STAGE:-all}
EXAMPLES=${EXAMPLES:-600000}
MIN_T1=${MIN_T1:-3.5}
MIN_T2=${MIN_T2:-4.5}
MIN_T3=${MIN_T3:-6}
CONTINUE_T3=${CONTINUE_T3:-6}
REF_SHARDS=${REF_SHARDS:-8}        # parallel reference.py processes per tier (stage 1 runs two tiers at once)
REF_SHARDS_T3=${REF_SHARDS_T3:-15}
REF_TIMEOUT=${REF_TIMEOUT:-infinity}  # per shard; a shard writes each case as it finishes, so a timeout keeps what is done
COPY_TO=${COPY_TO:-}   # where finished artefacts go as soon as they exist (GGUFs split at 15 MiB)
mkdir -p "$WORK/fixtures"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'

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

# reference.py's exact ggml emulation is slow (about 4 / 9 / 25 s per case and
# core for t1 / t2 / t3), so the 100 cases are split over N processes and merged.
references() {
  local t=$1 n=$2 k pids=()
  cp "$WORK/$t/greedy.json" "$WORK/fixtures/greedy-$t.json"
  for k in $(seq 0 $((n - 1))); do
    timeout "$REF_TIMEOUT" python3 models/recipe/reference.py --tier "$t" --models "$WORK/$t" --fixtures "$WORK/fixtures" \
      --shard "$k/$n" --shard-out "$WORK/ref-$t-$k.json" > "$WORK/ref-$t-$k.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || echo "[$t] a reference shard failed" >> "$WORK/$t.out"; done
  python3 models/recipe/reference.py --fixtures "$WORK/fixtures" --merge "$WORK"/ref-"$t"-*.json >> "$WORK/$t.out" 2>&1
  tail -n 3 "$WORK"/ref-"$t"-*.log | grep -h "agree\|ggml" | tail -n 4 >> "$WORK/$t.out" || true
}

fit() {
  local t=$1 minutes=$2
  python3 models/recipe/train.py fit --tier "$t" --data "$WORK/data" --out "$WORK/$t" --minutes "$minutes" \
    --compile --eval-n 50 > "$WORK/$t.out" 2>&1
}

if [ "$STAGE" = 1 ] || [ "$STAGE" = all ]; then
  [ -f "$WORK/data/tokens.npy" ] || python3 models/recipe/train.py data --out "$WORK/data" --examples "$EXAMPLES"
  (fit t1 "$MIN_T1" && references t1 "$REF_SHARDS" && publish t1) &
  (fit t2 "$MIN_T2" && references t2 "$REF_SHARDS" && publish t2) &
  (fit t3 "$MIN_T3" && mv "$WORK/t3" "$WORK/t3-first" && mv "$WORK/t3.out" "$WORK/t3-first.out") &
  wait
fi
if [ "$STAGE" = 2 ] || [ "$STAGE" = all ]; then
  if [ "$CONTINUE_T3" != 0 ]; then
    cp "$WORK/t3-first.out" "$WORK/t3.out"
    python3 models/recipe/train.py fit --tier t3 --data "$WORK/data" --out "$WORK/t3" --minutes "$CONTINUE_T3" \
      --init "$WORK/t3-first/t3-q8_0.gguf" --lr 5e-4 --compile --eval-n 25 >> "$WORK/t3.out" 2>&1
  else
    mv "$WORK/t3-first" "$WORK/t3" && mv "$WORK/t3-first.out" "$WORK/t3.out"
  fi
  publish t3
fi
if [ "$STAGE" = 3 ] || [ "$STAGE" = all ]; then
  references t3 "$REF_SHARDS_T3"
  publish t3
fi
tail -n 14 "$WORK"/t?.out
