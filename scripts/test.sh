#!/usr/bin/env bash
# Install what the tests need and run them (pytest).
#
#   scripts/test.sh [-q ...]       the whole suite, in two pytest processes side by side:
#                                  the tests that mostly wait (end-to-end runs on a real
#                                  SuperLink or Ray, marked `slow`; wall-clock and rate
#                                  checks, `timing`; network namespaces, `root`) in one,
#                                  one at a time, and the CPU-bound rest in the other.
#                                  The waiting tests take half the suite's time but little
#                                  CPU, so the run takes about half as long on 2 cores.
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
# Each process its own temporary directory: pytest prunes old numbered ones, and two
# processes sharing the default base could prune each other's.
"$py" -m pytest -p no:cacheprovider --basetemp="$tmp/waiting" -m "$waiting" "${args[@]}" >"$tmp/waiting.log" 2>&1 &
pid=$!
set +e
"$py" -m pytest -p no:cacheprovider --basetemp="$tmp/cpu" -m "not ($waiting)" "${args[@]}"
rc_cpu=$?
wait "$pid"
rc_wait=$?
set -e
echo "=================== the tests that wait ($waiting), run beside the others ==================="
cat "$tmp/waiting.log"
echo "scripts/test.sh: CPU-bound tests exit $rc_cpu; waiting tests exit $rc_wait"
# pytest exits 5 when a selection is empty: not a failure of the suite.
for rc in $rc_cpu $rc_wait; do
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi
done
exit 0
