#!/usr/bin/env bash
# The calibration study of docs/study.md, end to end and resumable (finished jobs are skipped):
#   scripts/study.sh embedded | debian | sweep | all
# Results, per-article rows and plots land under docs/study/ (no weights: save_final_policy=false).
set -euo pipefail
cd "$(dirname "$0")/.."
JL=${JL:-.venv/bin/judgeloop}
CFG=configs/feedback_loop/study.yaml
DEBIAN=${DEBIAN:-../shared/data/debian/debian_synopsis_dev.jsonl}
# the calibrated arm of the sweep; chosen on the validation slice of the embedded study (docs/study.md)
SWEEP_ARM=${SWEEP_ARM:-feature_platt}
W=$(grep -E '^  style_weight:' "$CFG" | awk '{print $2}')

embedded() { $JL ablate --config "$CFG" output_dir=docs/study/embedded; }
debian() {
  $JL ablate --config "$CFG" data.format=debian "data.path=$DEBIAN" data.max_articles=1200 \
    "policy.prompt_template=Write a one-line synopsis of this package description.

{article}" output_dir=docs/study/debian
}
sweep() {
  for w in 0 "$W" "$(python3 -c "print(2 * float('$W'))")"; do
    $JL ablate --config "$CFG" "judge.style_weight=$w" "ablation.arms=[raw,$SWEEP_ARM]" \
      output_dir="docs/study/sweep/w$w"
  done
}
case "${1:-all}" in
  embedded) embedded ;;
  debian) debian ;;
  sweep) sweep ;;
  all) embedded; sweep; debian ;;
  *) echo "usage: scripts/study.sh embedded|debian|sweep|all" >&2; exit 2 ;;
esac
