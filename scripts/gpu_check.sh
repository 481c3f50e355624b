#!/usr/bin/env bash
# fededge's checks on a GPU machine, as one call: the CUDA tests, then benchmarks/bench_gpu.py.
#
# For the workplace's GPU machine (python3 with torch+CUDA, no flwr), from the project root:
#   here:   bash scripts/gpu_wheels.sh                   # flwr's wheels into .whl (ignored)
#   there:  bash scripts/gpu_check.sh [bench_gpu.py's arguments]   (carry .whl)
# Results go to $OUT (or ./gpu-out): tests.txt, direct.txt, encode.txt, bench.txt, gpu.json, prof.<row>.txt.
# GPU_CODECS="LABEL;LABEL" also runs issue 36's ResNet-18 rows (bench_codecs_cnn.py
# --task resnet18-synth --study table, GPU_CODECS_ROUNDS rounds, 30 by default, run
# config GPU_CODECS_SET) beside the tests, one process per label, all of them on the GPU
# at once (accuracy only: nothing is timed then), before the bench: codecs.log and
# codecs.<n>.json. GPU_TEST_TIMEOUT, GPU_CODECS_TIMEOUT, GPU_BENCH_TIMEOUT bound each part.
# On any machine with CUDA and fededge installed, the same steps are:
#   python -m pytest -k cuda tests/clients tests/server/test_cohort_inprocess.py tests/server/test_runtime_auto.py
#   python benchmarks/bench_gpu.py
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, flwr, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__, 'cuda', torch.cuda.is_available())"
pids=()
if [ -n "${GPU_CODECS:-}" ]; then
  IFS=';' read -ra labels <<< "$GPU_CODECS"
  n=0
  for l in "${labels[@]}"; do
    # shellcheck disable=SC2086  # GPU_CODECS_SET is a list of KEY=VALUE words
    timeout "${GPU_CODECS_TIMEOUT:-280}" python3 benchmarks/bench_codecs_cnn.py --task resnet18-synth --study table \
      --rounds "${GPU_CODECS_ROUNDS:-30}" --only "$l" --set ${GPU_CODECS_SET:-} --json "$out/codecs.$n.json" \
      >> "$out/codecs.log" 2>&1 &
    pids+=($!)
    n=$((n + 1))
  done
fi
timeout "${GPU_TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -k cuda \
  tests/clients/test_device.py tests/clients/test_cohort.py tests/server/test_cohort_inprocess.py \
  tests/server/test_runtime_auto.py tests/server/test_direct.py > "$out/tests.txt" 2>&1
tail -25 "$out/tests.txt"
for p in "${pids[@]}"; do wait "$p"; done
[ -n "${GPU_CODECS:-}" ] && grep -v "^WARNING" "$out/codecs.log" | tail -30
# A reply's model on the GPU (TensorArray) against host bytes, ResNet-18: GPU_DIRECT_TIMEOUT=0 skips it
if [ "${GPU_DIRECT_TIMEOUT:-100}" != 0 ]; then
  timeout "${GPU_DIRECT_TIMEOUT:-100}" python3 benchmarks/bench_direct.py --models resnet18 --device cuda \
    --modes direct,resident --repeats 1 --rounds 5 2>&1 | grep -v "INFO\|WARNING" | tee "$out/direct.txt"
fi
# A cohort's uplinks as one batch against client by client, the deltas on the GPU (GPU_ENCODE_TIMEOUT=0 skips it)
if [ "${GPU_ENCODE_TIMEOUT:-60}" != 0 ]; then
  timeout "${GPU_ENCODE_TIMEOUT:-60}" bash -c 'python3 benchmarks/bench_encode_batch.py --device cuda --models mlp \
    --codecs "signsgd+EF,psgd r4+EF" --clients 100 --rounds 3; python3 benchmarks/bench_encode_batch.py \
    --device cuda --models resnet18 --codecs "signsgd+EF,psgd r4+EF" --clients 10 --rounds 3' 2>&1 | tee "$out/encode.txt"
fi
timeout "${GPU_BENCH_TIMEOUT:-420}" python3 benchmarks/bench_gpu.py --json "$out/gpu.json" --profile "$out/prof" --phases "$@" \
  2>&1 | tee "$out/bench.txt"
