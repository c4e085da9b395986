#!/usr/bin/env bash
# GPU verification in one call: the whole test suite (GPU tests included) and the benchmark.
# Usage (on a CUDA machine, from the repository root):  bash scripts/gpu_check.sh [OUTDIR]
# Expects tiered's GPU dependencies importable (pip install -e '.[cu13,test]', or PYTHONPATH).
set -uo pipefail
out=${1:-${OUT:-./gpu-check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, kvikio, kvikio.defaults; from nvidia import nvcomp; print('torch', torch.__version__, 'nvcomp', nvcomp.__version__, 'kvikio', kvikio.__version__, 'compat_mode_preferred', kvikio.defaults.is_compat_mode_preferred())"
} 2>&1 | tee "$out/env.txt"
# The lent GPU machines have no SeaweedFS or boto3: S3 tests run in CI, not there.
s3_demo=""
command -v weed >/dev/null && python3 -c "import boto3" 2>/dev/null || { export TIERED_SKIP_S3=1; s3_demo="--no-s3"; }
# The step CPU-only CI restores from S3 (tests/data/gpu-migrated): saved here, migrated on this GPU.
python3 scripts/make_gpu_fixture.py "$out" 2>&1 | tee "$out/fixture.txt"
fixture=${PIPESTATUS[0]}
tar -C "$out" -czf "$out/gpu-migrated.tgz" gpu-migrated && rm -rf "$out/gpu-migrated"
python3 -m pytest -q -ra -p no:cacheprovider tests/ 2>&1 | tee "$out/pytest.txt"
tests=${PIPESTATUS[0]}
python3 scripts/bench.py --profile --out "$out/bench.json" --dir /tmp/tiered-bench 2>&1 | tee "$out/bench.txt"
bench=${PIPESTATUS[0]}
repo=$(pwd)
(cd "$(mktemp -d)" && python3 "$repo/scripts/demo.py" --steps 60 $s3_demo && tiered_cli="python3 -m tiered.cli" \
  && $tiered_cli verify --config .tiered/demo.yaml --step all && $tiered_cli ls --config .tiered/demo.yaml) 2>&1 | tee "$out/demo.txt"
demo=${PIPESTATUS[0]}
echo "pytest exit $tests, bench exit $bench, demo exit $demo, fixture exit $fixture"
[ "$tests" = 0 ] && [ "$bench" = 0 ] && [ "$demo" = 0 ] && [ "$fixture" = 0 ]
