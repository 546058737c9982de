#!/usr/bin/env bash
# GPU machine wrapper for bench/gpu_slo.py (issue #32's experiment), run from the repository root:
#   bash bench/gpu_slo.sh [gpu_slo.py options]
# with .whl carried (bench/gpu_env.sh). About 5 minutes on an H200; JSON and plot land in $OUT.
set -u
source bench/gpu_env.sh
exec python3 bench/gpu_slo.py "$@"
