#!/bin/bash
# The one prepared run for a machine with one GPU (about 5-8 minutes on one H200): the GPU-path check
# (a few loop steps at real size: bf16 autocast, float32 master weights) and the GPU benchmarks against
# TRL's OnlineDPOTrainer and sentence-transformers, at fp32 and at bf16. Models are built from config
# (random weights), the data is the embedded corpus: the machine needs no network and no shared data.
#
#   bash scripts/gpu_check.sh                         # on the GPU machine: DEVICE=cuda SIZE=real
#   DEVICE=cpu SIZE=dry bash scripts/gpu_check.sh     # the dry run of the same steps on CPU, toy widths
#   DEVICE=cpu SIZE=dry DS=0 ONLY=served bash scripts/gpu_check.sh   # the served-judge section alone
#
# The served-judge section (SERVED=0 skips it) serves SmolLM2-135M-Instruct with `vllm serve` on the GPU
# (SERVED_SERVER=loopback: the project's own openai_compat server, the CPU dry run's default), checks the
# `vllm` route against the in-process choice judge (scripts/served_parity.py) and runs
# scripts/bench_served_judge.py against that server: OUT/served_parity.json, OUT/bench_served.json.
#
# Then the 2-process DeepSpeed ZeRO-2 / ZeRO-3 checks (tests/test_deepspeed.py: the loop, full and LoRA,
# and the retriever against one process, resumes, clipping; the whole recipe under ZeRO-3). They pin
# DS_ACCELERATOR=cpu and device=cpu, so on a GPU machine they check the same CPU path; then the whole recipe
# (recipes/feedback_loop.py) under the shipped ZeRO-3 and ZeRO-2 files on this GPU, one process, bf16.
# Needs deepspeed (pip install -e .[deepspeed]); DS=0 skips them.
#
# Writes OUT/loop/check.json, OUT/bench_loop_{no,bf16}.json and OUT/bench_retriever_{no,bf16}.json, and
# prints every table; a failing step stops the script (set -e) with that step's error last.
set -euo pipefail
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-real}
OUT=${OUT:-runs/gpu_check}
PY=${PY:-python}
if [ "$SIZE" = dry ]; then STEPS=2; BATCH=2; TOKENS=8; RSTEPS=3; RBATCH=8; QUERIES=40; DOCS=200
else STEPS=6; BATCH=8; TOKENS=64; RSTEPS=20; RBATCH=64; QUERIES=600; DOCS=3000; fi
mkdir -p "$OUT"
if [ "${ONLY:-}" != served ]; then
echo "== GPU-path check: a few loop steps ($DEVICE, $SIZE)"
$PY scripts/gpu_loop_check.py --device "$DEVICE" --size "$SIZE" --out "$OUT/loop"
for P in no bf16; do
  echo "== loop benchmark vs TRL, precision $P"
  $PY scripts/bench_loop.py --device "$DEVICE" --size "$SIZE" --steps $STEPS --repeats 1 --batch-size $BATCH \
      --max-new-tokens $TOKENS --precision $P --json "$OUT/bench_loop_$P.json"
  echo "== retriever benchmark vs sentence-transformers, precision $P (both sides)"
  $PY scripts/bench_retriever.py --device "$DEVICE" --size "$SIZE" --data embedded --steps $RSTEPS \
      --batch-size $RBATCH --num-queries $QUERIES --num-docs $DOCS --precision $P --peer-precision $P \
      --json "$OUT/bench_retriever_$P.json"
done
if [ "${DS:-1}" = 1 ]; then
  echo "== DeepSpeed ZeRO-2 / ZeRO-3 on 2 processes (the shipped launch files), against 1 process"
  $PY -m pytest -q tests/test_deepspeed.py
  if [ "$DEVICE" = cuda ]; then
    for Z in 3 2; do
      echo "== the whole loop under ZeRO-$Z on this GPU (1 process, bf16; the shipped launch file)"
      $PY -m accelerate.commands.launch --config_file configs/accelerate/deepspeed_zero$Z.yaml --num_processes 1 \
          recipes/feedback_loop.py --config configs/feedback_loop/tiny.yaml device=cuda judge.device=cuda \
          max_steps=2 eval_every_n_steps=2 progress_bar=false output_dir="$OUT/zero$Z"
    done
  fi
fi
fi  # ONLY
if [ "${SERVED:-1}" = 1 ]; then
  # The served judge on a real server: SmolLM2-135M-Instruct (the packaged offline folder) behind
  # `vllm serve` on this GPU, the parity of its `vllm` route with the in-process choice judge, then the bench
  # against that running server. SERVED_SERVER=loopback (the dry run's default) serves it with the project's
  # own server (judgeloop.testing.openai_compat, which answers vLLM's fields) on CPU instead.
  SERVED_SERVER=${SERVED_SERVER:-$([ "$DEVICE" = cuda ] && echo vllm || echo loopback)}
  SMOL=$($PY -m judgeloop.models HuggingFaceTB/SmolLM2-135M-Instruct)
  PORT=${SERVED_PORT:-8011}
  if [ "$SIZE" = dry ]; then SPAIRS=4; SCONC="1 4"; else SPAIRS=64; SCONC="1 4 16"; fi
  echo "== served judge: $SERVED_SERVER serving $SMOL on port $PORT"
  if [ "$SERVED_SERVER" = vllm ]; then
    vllm serve "$SMOL" --port "$PORT" --dtype float32 --max-logprobs 64 >"$OUT/served_server.log" 2>&1 &
  else
    $PY -m judgeloop.testing.openai_compat "$SMOL" --port "$PORT" >"$OUT/served_server.log" 2>&1 &
  fi
  SERVER_PID=$!
  trap 'kill "$SERVER_PID" 2>/dev/null || true' EXIT
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -20 "$OUT/served_server.log"; exit 1; }
    sleep 1
  done
  echo "== served judge: parity of the vllm route with the in-process choice judge ($DEVICE)"
  $PY scripts/served_parity.py --base-url "http://127.0.0.1:$PORT" --model "$SMOL" --route vllm \
      --device "$DEVICE" --pairs "$SPAIRS" --out "$OUT/served_parity.json"
  echo "== served judge: bench against the running server (logprob route vs text, batched vs sequential)"
  # without SummEval beside the clone (a lent machine), the short embedded articles, said so in the JSON
  ARTICLES=""
  [ -f ../shared/data/summeval/summeval_dev.jsonl ] || ARTICLES=--embedded-articles
  # shellcheck disable=SC2086 # SCONC is a list of levels; ARTICLES is empty or one flag
  $PY scripts/bench_served_judge.py --base-url "http://127.0.0.1:$PORT" --model "$SMOL" --route vllm \
      --prompt-format ids --pairs "$SPAIRS" --concurrency $SCONC --out "$OUT/bench_served.json" $ARTICLES
  kill "$SERVER_PID" 2>/dev/null || true
  wait "$SERVER_PID" 2>/dev/null || true
  trap - EXIT
fi
echo "== done: $OUT"
