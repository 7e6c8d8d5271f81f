#!/usr/bin/env bash
# The GPU check in one command, for a lent CUDA machine (see loadtests/README.md):
#   loadtests/gpu_check.sh [OUT_DIR] [extra flags of python -m loadtests.gpu_check]
# OUT_DIR defaults to $OUT, else ./gpu-check-out. The machine needs Python with
# torch and triton; packages it lacks are installed offline from .gpu-wheels/
# (`make gpu-wheels` fills it here; send it along). Without a CUDA device it
# runs a short dry run on CPU. Bounded to 8 minutes.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-${OUT:-$root/gpu-check-out}}
shift || true
py=${PYTHON:-python3}
cd "$root"
missing=$("$py" - <<'PY'
import importlib.util
wanted = ["numpy", "tokenizers", "jinja2", "safetensors", "gguf", "msgspec", "transformers"]
print(" ".join(m for m in wanted if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  if [ -d .gpu-wheels ]; then
    echo "gpu_check: installing $missing from .gpu-wheels/ (offline)"
    "$py" -m pip install --quiet --no-index --find-links .gpu-wheels $missing \
      || echo "gpu_check: could not install all of: $missing (parts that need them are skipped or fail)"
  else
    echo "gpu_check: missing $missing and no .gpu-wheels/ here (run make gpu-wheels before sending)"
  fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 480 "$py" -m loadtests.gpu_check --out "$out" "$@"
