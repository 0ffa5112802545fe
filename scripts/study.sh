#!/usr/bin/env bash
# The calibration study of docs/study.md, end to end and resumable (finished jobs are skipped):
#   scripts/study.sh embedded | debian | sweep | grpo | long | all
# Results, per-article rows and plots land under docs/study/ (no weights: save_final_policy=false).
set -euo pipefail
cd "$(dirname "$0")/.."
JL=${JL:-.venv/bin/judgeloop}
CFG=configs/feedback_loop/study.yaml
GRPO=configs/feedback_loop/study_grpo.yaml
LONG=configs/feedback_loop/study_long.yaml
DEBIAN=${DEBIAN:-../shared/data/debian/debian_synopsis_dev.jsonl}
# the calibrated arm of the sweep: chosen on the validation slice of the embedded study (the best mean
# validation neutral ROUGE-L among the calibrated arms, docs/study.md); 3 seeds unless SWEEP_SEEDS says
SWEEP_ARM=${SWEEP_ARM:-style_residual}
SWEEP_SEEDS=${SWEEP_SEEDS:-[0,1,2]}
W=$(grep -E '^  style_weight:' "$CFG" | awk '{print $2}')

embedded() { $JL ablate --config "$CFG" output_dir=docs/study/embedded; }
debian() {
  $JL ablate --config "$CFG" data.format=debian "data.path=$DEBIAN" data.max_articles=1200 \
    "policy.prompt_template=Write a one-line synopsis of this package description.

{article}" output_dir=docs/study/debian
}
sweep() {
  # style_weight = W is the embedded study itself; 0 and 2W are run here. The starting policy is the same,
  # so the sweep reads the study's shared start work (greedy summaries, samples) instead of recomputing it.
  for w in 0 "$(python3 -c "print(2 * float('$W'))")"; do
    mkdir -p "docs/study/sweep/w$w" docs/study/embedded/_shared
    [ -e "docs/study/sweep/w$w/_shared" ] || ln -s ../../embedded/_shared "docs/study/sweep/w$w/_shared"
    $JL ablate --config "$CFG" "judge.style_weight=$w" "ablation.arms=[raw,$SWEEP_ARM]" \
      "ablation.seeds=$SWEEP_SEEDS" output_dir="docs/study/sweep/w$w"
  done
}
grpo() {
  # the DPO study's settings under GRPO, with the group's std dividing the advantages (TRL's GRPO) and
  # without (Dr. GRPO); the starting policy is the same, so both read one shared start work
  mkdir -p docs/study/grpo/group/_shared docs/study/grpo/none
  [ -e docs/study/grpo/none/_shared ] || ln -s ../group/_shared docs/study/grpo/none/_shared
  for scale in group none; do
    $JL ablate --config "$GRPO" "loss.scale_rewards=$scale" output_dir="docs/study/grpo/$scale"
  done
}
long() {
  # the same question at 48 steps of 8 articles, the length the pilot chose on validation; 15 jobs of
  # 20-35 min each on one core: to use two cores, run the lines of `--list-jobs` as two `--job ARM:SEED` lanes
  $JL ablate --config "$LONG" output_dir=docs/study/long
}
case "${1:-all}" in
  embedded) embedded ;;
  debian) debian ;;
  sweep) sweep ;;
  grpo) grpo ;;
  long) long ;;
  all) embedded; sweep; debian; grpo; long ;;
  *) echo "usage: scripts/study.sh embedded|debian|sweep|grpo|long|all" >&2; exit 2 ;;
esac
