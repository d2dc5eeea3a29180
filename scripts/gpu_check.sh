#!/usr/bin/env bash
# The one prepared command for a GPU machine (issue 50; DEVELOPERS.md: 15 minutes of device time a session, 10 a
# command). Run from the repo root on the device machine, results under $OUT:
#   bash scripts/gpu_check.sh            # env.txt, test_gpu.txt, train_*.txt, metrics_*.csv in $OUT
# The device machine reaches no package registry: it uses the Python that has the CUDA build of torch (PYTHON,
# default python3) and installs the rest from wheels carried in .wheels/ when that dir exists (made here with
#   pip download -d .wheels --only-binary=:all: --python-version 3.X --platform manylinux2014_x86_64 \
#     -r <(grep -v '^torch==' requirements.lock)
# for the device's Python 3.X; .wheels/ is ignored by git and travels with `carry`), and GPT-2's tokenizer from
# TOKENIZER (default .wheels/gpt2-tokenizer: copy ../shared/data/gpt2-tokenizer there; ../shared does not travel).
# Not yet run on a GPU.
set -uo pipefail
OUT=${OUT:-gpu_out}
PYTHON=${PYTHON:-python3}
TOKENIZER=${TOKENIZER:-.wheels/gpt2-tokenizer}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PYTHON" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
} > "$OUT/env.txt" 2>&1
if [ -d .wheels ]; then
  "$PYTHON" -m pip install -q --no-index --find-links .wheels -e ".[dev]" >> "$OUT/env.txt" 2>&1
fi
"$PYTHON" -m pip list 2>/dev/null | grep -iE '^(torch|lightning|transformers|hydra-core|deepspeed|trl|peft|flash.attn) ' >> "$OUT/env.txt"
# The lane: under 8 minutes is the budget (install excluded)
timeout 480 make test-gpu GPU_PYTHON="$PYTHON" > "$OUT/test_gpu.txt" 2>&1
echo "make test-gpu: exit $?" >> "$OUT/test_gpu.txt"
# GPT-2 124M through train.py, eager and compiled (context 1024, batch 16, bf16-mixed, dropout 0): tokens/s and MFU
# as the throughput callback logs them (the last rows of metrics_compile_*.csv)
for compile in false true; do
  timeout 240 "$PYTHON" train.py model/size=small data.tokenizer="$TOKENIZER" data.seq_len=1024 \
    data.global_batch_size=16 model.dropout=0.0 model.compile=$compile trainer=gpu trainer.max_steps=120 \
    trainer.val_check_interval=1000 test=false logger=csv callbacks.generate_text=null \
    paths.log_dir="$OUT/logs_compile_$compile" > "$OUT/train_compile_$compile.txt" 2>&1
  echo "exit $?" >> "$OUT/train_compile_$compile.txt"
  cp "$OUT"/logs_compile_"$compile"/train/runs/*/csv/metrics.csv "$OUT/metrics_compile_$compile.csv" 2>/dev/null
done
