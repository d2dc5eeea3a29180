#!/usr/bin/env bash
# The prepared command for a GPU machine (a session has 15 minutes of device time, 10 a command). Here
# first, once: `bash scripts/gpu_wheels.sh NANOGPT_CHECKOUT` (fills the ignored .wheels/: the packages the machine's
# image lacks, GPT-2's tokenizer, nanoGPT's three files). There, from the repo root, with carry=[".wheels"]:
#   bash scripts/gpu_check.sh [bench] [profile] [lane] [dropout]  # default: all four, in that order; results in $OUT
#   bench    env.txt, bench.txt: GPT-2 124M (context 1024, batch 16, bf16, dropout 0) through train.py: eager (the
#            template) and BENCH_VARIANTS (name=overrides; default: each block and the head compiled, blocks:
#            model.compile=blocks; the whole model and its loss, compile: model.compile=true; each of eager and compile
#            with the vocabulary padded to 64 rows, pad and compile_pad) against nanoGPT's own train.py compiled (as it
#            comes, and with GPT-2's biases and vocabulary): step ms, tokens/s, MFU, the warm-up's extra seconds (what
#            compiling costs, for a model.compile default) and the ratios, one round (5.6 min
#            with three variants on an H200, 2026-11-27; ~7 with these four). TF32's default for fp32 runs:
#            BENCH_VARIANTS="fp32=trainer.precision=32-true tf32=trainer.precision=32-true,float32_matmul_precision=high"
#            torch.compile's modes (CUDA graphs against the idle GPU time a step; autotuned kernels):
#            BENCH_VARIANTS="compile=model.compile=true cg=model.compile=true,model.compile_mode=reduce-overhead \
#            tune=model.compile=true,model.compile_mode=max-autotune-no-cudagraphs \
#            workers=model.compile=true,data.num_workers=2" (the next batch read by worker processes, not after each step)
#   profile  profile.txt, metrics.csv: the compiled template's step under torch.profiler (bench/profile/profile_step.py:
#            its kernels by kind, and the GPU's idle time a step with the longest idle stretches), the throughput
#            callback's MFU beside it (~1.5 min)
#   lane     test_gpu.txt: make test-gpu's tests (tests/test_gpu.py), under 8 minutes by the issue; LANE_ARGS="-k X"
#            picks some
#   dropout  dropout.txt: keyed dropout, eager ops and the compiled kernel (compile_dropout: auto takes the kernel on a
#            GPU), against torch's on the GPU (bench.profile.dropout, GPT-2 124M's width, context 1024 and 2048; ~1 min)
#   llama    llama.txt: Llama-3.2-1B's shape (GPT-2's vocabulary, context 2048, batch 8), the template eager and
#            compiled against HF Trainer compiled (not in the default stages: a session of its own, ~6 min)
# Run on an H200 on 2026-11-27 (docs/results/gpu_*.jsonl, docs/performance.md; the first run's outputs: ../shared/gpu/).
set -uo pipefail
OUT=${OUT:-gpu_out}
PYTHON=${PYTHON:-python3}
W=.wheels
STAGES=${*:-bench profile lane dropout}
LANE_ARGS=${LANE_ARGS:-}
# the bench stage's train.py variants: the compiled regions, and the vocabulary padded to 64 rows (its default to choose)
BENCH_VARIANTS=${BENCH_VARIANTS:-blocks=model.compile=blocks compile=model.compile=true pad=model.pad_vocab_multiple=64 \
compile_pad=model.compile=true,model.pad_vocab_multiple=64}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The device README's way: the wheels into a target dir put on PYTHONPATH (ahead of the image's transformers), no
# registry, no deps. A dry run installs them for Python 3.12 elsewhere (checking the set) and runs on its own venv.
SITE=/tmp/site PY312=()
[ -n "${DRY_RUN:-}" ] && SITE=/tmp/site-dry PY312=(--python-version 3.12 --only-binary=:all:)
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE "${PY312[@]}" \
  "$W"/*.whl > "$OUT/install.txt" 2>&1 || { echo "wheel install failed"; cat "$OUT/install.txt"; exit 1; }
[ -z "${DRY_RUN:-}" ] && export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$PYTHON" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
  "$PYTHON" -m pip list 2>/dev/null | grep -iE '^(torch|lightning|transformers|hydra-core|omegaconf|deepspeed|peft|flash.attn|triton) '
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
GPT2_124M=(model/size=small "data.tokenizer=$W/shared-data/gpt2-tokenizer" data.seq_len=1024 data.global_batch_size=16
  model.dropout=0.0 trainer=gpu trainer.precision=bf16-mixed)
SHAPE=gpu COMPILE=true STEPS=(--steps 50 --warmup 20)
if [ -n "${DRY_RUN:-}" ]; then  # the plumbing on a CPU: tiny shapes, no compile, the lane rehearsed (GPU_LANE_ON_CPU)
  GPT2_124M=(model.n_layer=2 model.n_head=2 model.n_embd=32 "data.tokenizer=$W/shared-data/gpt2-tokenizer" data.seq_len=64
    data.global_batch_size=4 model.dropout=0.0 trainer=cpu trainer.precision=32-true)
  SHAPE=overhead COMPILE=false STEPS=(--steps 8 --warmup 2)
fi
for stage in $STAGES; do
  start=$(date +%s)
  case $stage in
    bench)
      timeout 480 "$PYTHON" -m bench.compare.throughput --shapes $SHAPE --tokenizer "$W/shared-data/gpt2-tokenizer" --ways template \
        --variants $BENCH_VARIANTS --nanogpt-repo "$W/nanoGPT" \
        --rounds 1 "${STEPS[@]}" \
        --cache-dir /tmp/bench > "$OUT/bench.txt" 2>&1
      echo "exit $?" >> "$OUT/bench.txt"
      cp /tmp/bench/nanogpt_repo_$SHAPE/stdout.txt "$OUT/nanogpt_stdout.txt" 2>/dev/null ;;
    profile)
      rm -rf /tmp/profile_run
      timeout 240 "$PYTHON" train.py "${GPT2_124M[@]}" model.compile=$COMPILE trainer.max_steps=60 \
        trainer.val_check_interval=1000 test=false logger=csv callbacks.generate_text=null \
        +callbacks.profile._target_=bench.profile.profile_step.StepProfiler "+callbacks.profile.out=$OUT/profile.txt" \
        +callbacks.profile.start=30 +callbacks.profile.steps=5 paths.log_dir=/tmp/profile_run > "$OUT/profile_run.txt" 2>&1
      echo "exit $?" >> "$OUT/profile_run.txt"
      cp /tmp/profile_run/train/runs/*/csv/metrics.csv "$OUT/metrics.csv" 2>/dev/null ;;
    llama)
      LSTEPS=(--steps 30 --warmup 10)
      [ -n "${DRY_RUN:-}" ] && LSTEPS=(--steps 4 --warmup 1)
      timeout 540 "$PYTHON" -m bench.compare.throughput --model llama --shapes "$([ -n "${DRY_RUN:-}" ] && echo overhead || echo llama3_1b)" \
        --tokenizer "$W/shared-data/gpt2-tokenizer" --ways template,hf_compile --variants compile=model.compile=true --rounds 1 \
        "${LSTEPS[@]}" --cache-dir /tmp/bench > "$OUT/llama.txt" 2>&1
      echo "exit $?" >> "$OUT/llama.txt" ;;
    lane)
      # make test-gpu's command, without make (the image may not have it)
      # -n 4: the tests are small; four share the GPU (1.7 min on an H200, 2026-11-27)
      SHARED_DATA=$PWD/$W/shared-data GPU_LANE_ON_CPU=${DRY_RUN:+1} timeout 480 "$PYTHON" -m pytest -m gpu \
        -p no:cacheprovider -n 4 -rs --durations=10 tests/test_gpu.py $LANE_ARGS > "$OUT/test_gpu.txt" 2>&1
      echo "the lane: exit $?" >> "$OUT/test_gpu.txt" ;;
    dropout)
      DEVICE=cuda WIDTH=768; [ -n "${DRY_RUN:-}" ] && DEVICE=cpu WIDTH=64
      for seq in 1024 2048; do
        [ -n "${DRY_RUN:-}" ] && seq=32
        timeout 120 "$PYTHON" -m bench.profile.dropout --device $DEVICE --width $WIDTH --seq $seq --rows 8 --layers 2 \
          --rounds 7 >> "$OUT/dropout.txt" 2>&1
        echo "exit $?" >> "$OUT/dropout.txt"
      done ;;
    *) echo "unknown stage $stage (bench, profile, lane, dropout, llama)"; exit 2 ;;
  esac
  echo "$stage: $(( $(date +%s) - start )) s" | tee -a "$OUT/stages.txt"
done
