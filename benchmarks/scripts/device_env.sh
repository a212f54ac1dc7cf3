# Sourced by the device scripts (h200_*.sh): strict mode, $OUT, PYTHONPATH (src, plus the transformers wheel carried
# in .wheels when present: the device has no registry), and "$OUT/env_$PART.txt" (GPU, versions, commit).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; PART=${PART:-check}
if ls .wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .wheels/*.whl
  export PYTHONPATH=src:/tmp/site
else
  export PYTHONPATH=src
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import transformers; print('transformers', transformers.__version__)" 2>/dev/null
  git rev-parse --short HEAD 2>/dev/null; } | tee "$OUT/env_$PART.txt"
