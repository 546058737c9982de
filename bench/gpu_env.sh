# Sourced by the GPU machine wrappers (bench/gpu_suite.sh, bench/gpu_slo.sh) from the repository root.
# The machine's image has no msgspec or llguidance (the engine imports both): carry their wheels in
# .whl/ (ignored by git), made here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
#     -d .whl msgspec==0.23.0 llguidance==1.9.1
# and name .whl in the call's carry; this installs them to /tmp/site.
if ! python3 -c "import msgspec, llguidance" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
