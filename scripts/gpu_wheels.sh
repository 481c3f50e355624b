#!/usr/bin/env bash
# flwr 1.41's wheels for the workplace's GPU machine (python3 3.12 with torch+CUDA, no flwr),
# into .whl (ignored by git), for scripts/gpu_check.sh. It runs the workplace's
# ../shared/tools/gpu_wheels.sh, then replaces the web packages it fetches unpinned by the
# versions flwr 1.41 pins (fastapi<0.139, starlette<1.4, uvicorn<0.50): the newest fastapi
# and starlette import opentelemetry, which that machine lacks, and then
# flwr.superlink.grid fails to import (seen 2026-11-27).
set -eu -o pipefail
dir=${1:-.whl}
rm -rf "$dir"  # afresh: a second run after an upstream release left two versions of a package
# (grep's own status ignored: it is 1 when there is nothing to filter; the download's counts)
bash ../shared/tools/gpu_wheels.sh "$dir" 2>&1 | { grep -v "^WARNING: Location" || true; }
rm -f "$dir"/fastapi-* "$dir"/starlette-* "$dir"/uvicorn-*
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$dir" \
  fastapi==0.138.2 starlette==1.3.1 uvicorn==0.49.0 annotated-doc 2>&1 | { grep -v "^WARNING: Location" || true; }
du -sh "$dir"
