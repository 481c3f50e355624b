#!/usr/bin/env bash
# Install what the tests need and run them (pytest).
#
#   scripts/test.sh [-q ...]       the whole suite, in four pytest processes side by side
#                                  ("lanes"): the tests that mostly wait (end-to-end runs on
#                                  a real SuperLink or Ray, marked `slow`; network
#                                  namespaces, `root`) in two, tests/deploy and the rest,
#                                  and the CPU-bound rest in two, tests/server and the rest;
#                                  then the wall-clock and rate checks (`timing`) alone.
#                                  Each lane runs its tests one at a time. The waiting tests take half the suite's time
#                                  but little CPU; on a 2-core machine whose cores are slow
#                                  (an AMD EPYC of this kind: 26 min in two lanes) the
#                                  CPU-bound half is split too.
#   scripts/test.sh --serial [...] the whole suite in one process
#   scripts/test.sh -m "not slow"  any selection (-m, -k, paths) runs in one process, e.g.
#                                  this one skips the end-to-end `flwr run` tests
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
py="${FEDEDGE_VENV:-.venv}/bin/python"

split=1
args=()
for a in "$@"; do
  case "$a" in
    --serial) split=0 ;;
    -m|-k|--lf|--last-failed) split=0; args+=("$a") ;;
    -*) args+=("$a") ;;
    *) split=0; args+=("$a") ;;  # a path or a marker/keyword expression: a selection
  esac
done
if [ $split = 0 ]; then
  exec "$py" -m pytest "${args[@]}"
fi

waiting="slow or timing or root"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# name|marker expression|paths and options. Each lane its own temporary directory: pytest
# prunes old numbered ones, and two processes sharing the default base could prune each
# other's. The last lane runs in the foreground, its output live. The `timing` tests
# (wall-clock bounds, measured rates) run after the lanes, alone: four lanes on two cores
# delay a thread by tens of milliseconds (a proxy's jitter bound failed so).
lanes=(
  "waiting-deploy|(slow or root) and not timing|tests/deploy"
  "waiting-other|(slow or root) and not timing|tests --ignore=tests/deploy"
  "cpu-server|not ($waiting)|tests/server"
  "cpu-other|not ($waiting)|tests --ignore=tests/server"
)
pids=()
last=$((${#lanes[@]} - 1))
for i in "${!lanes[@]}"; do
  IFS='|' read -r name marker paths <<<"${lanes[$i]}"
  # shellcheck disable=SC2086  # $paths is a list of words
  cmd=("$py" -m pytest -p no:cacheprovider --basetemp="$tmp/$name" -m "$marker" "${args[@]}" $paths)
  if [ "$i" = "$last" ]; then
    echo "=================== lane $name ==================="
    set +e
    "${cmd[@]}"
    rcs[$i]=$?
    set -e
  else
    "${cmd[@]}" >"$tmp/$name.log" 2>&1 &
    pids[$i]=$!
  fi
done
set +e
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  rcs[$i]=$?
done
set -e
failed=0
for i in "${!lanes[@]}"; do
  IFS='|' read -r name marker paths <<<"${lanes[$i]}"
  if [ "$i" != "$last" ]; then
    echo "=================== lane $name ($marker; $paths), run beside the others ==================="
    cat "$tmp/$name.log"
  fi
  echo "scripts/test.sh: lane $name exit ${rcs[$i]}"
  # pytest exits 5 when a selection is empty: not a failure of the suite.
  if [ "${rcs[$i]}" != 0 ] && [ "${rcs[$i]}" != 5 ]; then failed=${rcs[$i]}; fi
done
echo "=================== the timing tests, alone ==================="
set +e
"$py" -m pytest -p no:cacheprovider --basetemp="$tmp/timing" -m timing "${args[@]}"
rc=$?
set -e
echo "scripts/test.sh: timing tests exit $rc"
if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then failed=$rc; fi
exit "$failed"
