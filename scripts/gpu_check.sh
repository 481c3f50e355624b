#!/usr/bin/env bash
# fededge's checks on a GPU machine, as one call: the CUDA tests, then benchmarks/bench_gpu.py.
#
# For the workplace's GPU machine (python3 with torch+CUDA, no flwr), from the project root:
#   here:   bash scripts/gpu_wheels.sh                   # flwr's wheels into .whl (ignored)
#   there:  bash scripts/gpu_check.sh [bench_gpu.py's arguments]   (carry .whl)
# Results go to $OUT (or ./gpu-out): tests.txt, direct.txt, encode.txt, bench.txt, gpu.json (written
# after each row), and extra.tar.gz (the profiles prof.<row>.txt and codecs.<n>.json: the device
# tool brings back 8 files at most). Each step's exit status is printed ("rc=..."; 124: its
# timeout); the script exits with the first non-zero one.
# GPU_CODECS="LABEL;LABEL" also runs issue 36's ResNet-18 rows (bench_codecs_cnn.py
# --task resnet18-synth --study table, GPU_CODECS_ROUNDS rounds, 30 by default, run
# config GPU_CODECS_SET) beside the tests, one process per label, all of them on the GPU
# at once (accuracy only: nothing is timed then), before the bench: codecs.log and
# codecs.<n>.json. GPU_TEST_TIMEOUT, GPU_CODECS_TIMEOUT, GPU_BENCH_TIMEOUT bound each part.
# On any machine with CUDA and fededge installed, the same steps are:
#   python -m pytest -k cuda tests/clients tests/server/test_cohort_inprocess.py tests/server/test_runtime_auto.py
#   python benchmarks/bench_gpu.py
set -u -o pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
status=0
step() {  # step NAME RC: print a step's exit status, keep the first failure
  echo "== $1: rc=$2$([ "$2" = 124 ] && echo ' (its timeout)')"
  [ "$status" = 0 ] && status=$2
  return 0
}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, flwr, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__, 'cuda', torch.cuda.is_available())" || exit 1
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
# SIGINT at the timeout: pytest still prints which tests failed and where one hung
timeout -s INT -k 20 "${GPU_TEST_TIMEOUT:-150}" python3 -m pytest -q -rfE -p no:cacheprovider -k cuda \
  tests/clients/test_device.py tests/clients/test_cohort.py tests/server/test_cohort_inprocess.py \
  tests/server/test_runtime_auto.py tests/server/test_direct.py > "$out/tests.txt" 2>&1
step tests $?
tail -25 "$out/tests.txt"
for p in "${pids[@]}"; do wait "$p"; step "codecs (pid $p)" $?; done
# (Flower's log lines start with a colour code before WARNING)
[ -n "${GPU_CODECS:-}" ] && grep -v "WARNING" "$out/codecs.log" | tail -30
# A reply's model on the GPU (TensorArray) against host bytes, ResNet-18: GPU_DIRECT_TIMEOUT=0 skips it
if [ "${GPU_DIRECT_TIMEOUT:-100}" != 0 ]; then
  timeout "${GPU_DIRECT_TIMEOUT:-100}" python3 benchmarks/bench_direct.py --models resnet18 --device cuda \
    --modes direct,resident --repeats 1 --rounds 5 2>&1 | grep -v "INFO\|WARNING" | tee "$out/direct.txt"
  step direct "${PIPESTATUS[0]}"
fi
# A cohort's uplinks as one batch against client by client, the deltas on the GPU (GPU_ENCODE_TIMEOUT=0 skips it)
if [ "${GPU_ENCODE_TIMEOUT:-60}" != 0 ]; then
  timeout "${GPU_ENCODE_TIMEOUT:-60}" bash -c 'python3 benchmarks/bench_encode_batch.py --device cuda --models mlp \
    --codecs "signsgd+EF,psgd r4+EF" --clients 100 --rounds 3; python3 benchmarks/bench_encode_batch.py \
    --device cuda --models resnet18 --codecs "signsgd+EF,psgd r4+EF" --clients 10 --rounds 3' 2>&1 | tee "$out/encode.txt"
  step encode "${PIPESTATUS[0]}"
fi
profile=()
[ "${GPU_PROFILE:-1}" != 0 ] && profile=(--profile "$out/prof")  # GPU_PROFILE=0: no per-row profiles
timeout "${GPU_BENCH_TIMEOUT:-420}" python3 benchmarks/bench_gpu.py --json "$out/gpu.json" "${profile[@]}" --phases "$@" \
  2>&1 | tee "$out/bench.txt"
step bench "${PIPESTATUS[0]}"
# The device tool brings back 8 files at most: the profiles and the codecs' JSON in one archive
extra=$(cd "$out" && ls prof.* codecs.*.json 2>/dev/null)
if [ -n "$extra" ]; then
  # shellcheck disable=SC2086  # the file names have no spaces (prof.<row>.txt, codecs.<n>.json)
  (cd "$out" && tar czf extra.tar.gz $extra && rm -f $extra)
fi
exit "$status"
