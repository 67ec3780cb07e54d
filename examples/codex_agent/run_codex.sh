#!/usr/bin/env bash
# One attempt: OpenAI's Codex CLI (`codex exec`, its own prompts and tools) solves one task in a scratch directory,
# talking to the proxy the command agent names ($OPENAI_BASE_URL, the attempt token in $OPENAI_API_KEY). Codex's
# features that add tools a shell task never needs (sub-agents, goals, images, skill search) are turned off with
# Codex's own --disable flags: with them its first prompt is 8,921 SmolLM2 tokens, past the model's 8,192; without,
# 5.7k. A long prefill on CPU sends no bytes for minutes: the provider's stream idle timeout is 30 minutes (Codex's
# default, 5 minutes, drops the call). Codex runs at most $LSDK_CODEX_TIMEOUT seconds (180): a policy that keeps
# calling tools is stopped there (exit code 124) and the file is still scored. After Codex exits, the task's file is printed base64-encoded on the last
# line for tasks.py:score.
#   run_codex.sh TASK_FILE        ($CODEX: the codex binary, default `codex` on PATH)
set -uo pipefail
task_file=$1
codex=${CODEX:-codex}
file=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["file"])' "${task_file}")
question=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["question"])' "${task_file}")
scratch=$(mktemp -d)
trap 'rm -rf "${scratch}"' EXIT
# Codex's home (its config, sessions and system skills, whose path its prompt names) is one directory for every
# attempt, so the prompts of all attempts share their first ~5.6k tokens up to the scratch directory's own name (the
# engine's prefix cache and the learner's shared prefix then compute that head once); each session is its own file.
home=${LSDK_CODEX_HOME:-${TMPDIR:-/tmp}/lightning_sdk_codex_home}
mkdir -p "${scratch}/work" "${home}"
provider="model_providers.lsdk={name=\"lsdk\",base_url=\"${OPENAI_BASE_URL}\",wire_api=\"responses\",env_key=\"OPENAI_API_KEY\",stream_idle_timeout_ms=1800000}"
(
    cd "${scratch}/work" &&
    HOME="${home}" NO_COLOR=1 timeout "${LSDK_CODEX_TIMEOUT:-180}" "${codex}" exec --skip-git-repo-check -c model_provider=lsdk -c "${provider}" \
        --disable multi_agent --disable goals --disable view_image --disable image_generation \
        --disable skill_search -s danger-full-access -m "${OPENAI_MODEL:-policy}" "${question}" </dev/null
)
rc=$?
echo "codex exit code ${rc}"
if [ -f "${scratch}/work/${file}" ]; then
    echo "LSDK_FILE $(base64 -w0 "${scratch}/work/${file}")"
else
    echo "LSDK_FILE -"
fi
