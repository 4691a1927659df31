#!/usr/bin/env bash
# Full training run for the three tiers on one GPU machine (what produced the
# committed GGUFs). Run from the repository root:
#   MINUTES=10 bash models/recipe/gpu_pipeline.sh /tmp/work
# Trains t1, t2 and t3 concurrently on the one GPU, each for $MINUTES minutes.
set -euo pipefail
WORK=${1:-/tmp/mesh-train}
MINUTES=${MINUTES:-10}
EXAMPLES=${EXAMPLES:-400000}
mkdir -p "$WORK"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
[ -f "$WORK/data/tokens.npy" ] || python3 models/recipe/train.py data --out "$WORK/data" --examples "$EXAMPLES"
for t in t1 t2 t3; do
  python3 models/recipe/train.py fit --tier $t --data "$WORK/data" --out "$WORK/$t" --minutes "$MINUTES" \
    > "$WORK/$t.out" 2>&1 &
done
wait
tail -n 12 "$WORK"/t?.out
