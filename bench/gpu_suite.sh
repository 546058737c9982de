#!/usr/bin/env bash
# GPU machine wrapper for bench/gpu_suite.py, run from the repository root:
#   bash bench/gpu_suite.sh [gpu_suite.py options]
# The machine's image has no msgspec (the engine needs it for sluice.protocol): carry its wheel
# in .whl/ (see /work/.library/device/README.md) and this installs it to /tmp/site first.
# Then the kernel tests run on the GPU (their cuda parameters; --confcutdir keeps out the root
# conftest, whose broker fixtures need packages that image lacks), then the suite.
set -u
if ! python3 -c "import msgspec" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
out_dir=${OUT:-out}
mkdir -p "$out_dir"
timeout 180 python3 -m pytest tests/kernels --confcutdir=tests/kernels -q -p no:cacheprovider -k "cuda" \
    >"$out_dir/pytest_kernels_cuda.log" 2>&1
echo "pytest tests/kernels (cuda params): rc=$? (log: $out_dir/pytest_kernels_cuda.log)"
tail -n 3 "$out_dir/pytest_kernels_cuda.log"
exec python3 bench/gpu_suite.py "$@"
