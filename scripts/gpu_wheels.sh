#!/usr/bin/env bash
# Makes .wheels/ here, for scripts/gpu_check.sh on a GPU machine that reaches no registry (the device tool carries it:
# carry=[".wheels"]; .wheels/ is ignored by git, and a call carries at most 64 MiB in all). It holds what the lane and
# the benchmark need that the machine's image lacks, or may hold in older versions (peft, regex), at the lock's
# versions: the image has Python 3.12 with torch 2.11 (CUDA), lightning 2.6.6, transformers 5.17, peft, tensorboard,
# scikit-learn, pytest-xdist (the workplace's device library lists it), but no hydra, omegaconf or DeepSpeed. Also
# GPT-2's tokenizer files (../shared does not travel) and nanoGPT's model.py, train.py and configurator.py from a
# checkout of karpathy/nanoGPT outside .wheels/ (which this empties first), if given.
#   bash scripts/gpu_wheels.sh [NANOGPT_CHECKOUT]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=.wheels
pin() { grep -i "^$1==" requirements.lock; }
rm -rf "$DEST" && mkdir -p "$DEST"
# binary wheels for the device's CPython 3.12
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST" \
  $(for p in hydra-core omegaconf transformers peft regex hjson pydantic pydantic_core annotated-types typing-inspection; do pin "$p"; done)
# pure-Python projects published as source only: built here into wheels
"$PY" -m pip wheel -q --no-deps -w "$DEST" "$(pin antlr4-python3-runtime)" "$(pin deepspeed)"
# the shared data the lane's tests and the benchmarks read (tests/conftest.py's SHARED_DATA points there; GPT-2's
# tokenizer for the packed-rows tests and the benches): ../shared does not travel
mkdir -p "$DEST/shared-data/preference" "$DEST/shared-data/chat"
cp -r ../shared/data/gpt2-tokenizer "$DEST/shared-data/"
cp -r ../shared/data/tiny-gpt2 "$DEST/shared-data/"
cp ../shared/data/preference/dpo_en_demo.json "$DEST/shared-data/preference/"
cp ../shared/data/chat/glaive_toolcall_en_demo.json "$DEST/shared-data/chat/"
if [ $# -ge 1 ]; then
  mkdir -p "$DEST/nanoGPT"
  cp "$1"/model.py "$1"/train.py "$1"/configurator.py "$DEST/nanoGPT/"
fi
du -sh "$DEST"
