#!/usr/bin/env bash
# GPU check for one H200 with no network and only its image's packages (torch, transformers, triton).
#
# What runs (each phase prints its numbers; a phase that cannot run says why and the next one still runs):
#   A. the embedded engine + embedded learner on the GPU with the project's tiny policy (~3M parameters):
#      generated tokens/s (64 concurrent prompts), learner step time, weight-swap time (learner -> engine);
#   B. the same with a ~110M-parameter Qwen2 built from a config (hidden 768, 12 layers, MLP 3072);
#   C. verl's FSDP actor update without Ray (verl's own ActorRolloutRefWorker in this process, one rank, NCCL)
#      on both models: step time and publish time (verl -> HF checkpoint -> embedded engine).
# It finishes inside 10 minutes (the Python part runs under `timeout 560`) and ends with one JSON line.
#
# Ray, SGLang and vLLM are not on the machine and too big to carry; verl and its small deps are carried as wheels
# (about 15 MiB, well under the 64 MiB limit). On a machine with PyPI access, fetch them for the device's Python:
#     scripts/gpu_check.sh --fetch-wheels 3.11        # -> shared/wheels/*.whl (override with LIGHTNING_GPU_WHEELS)
# then on the device (from the repository root):
#     bash scripts/gpu_check.sh
# Carried wheels are unpacked into a private folder that is appended to sys.path, so the image's own packages win
# and the wheels only fill gaps. verl imports `ray` at module level (verl/protocol.py) but the path used here never
# calls it; when Ray is absent a stub module stands in (printed in the log).
# Local smoke test on a CPU machine (tiny sizes, no timing value): `bash scripts/gpu_check.sh --cpu-smoke`.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
WHEELS="${LIGHTNING_GPU_WHEELS:-shared/wheels}"
WHEEL_LIST=(
  "verl==0.9.1" "omegaconf==2.3.1" "antlr4-python3-runtime==4.9.3" "hydra-core==1.3.8" "tensordict==0.10.0"
  "codetiming" "cloudpickle" "pyvers" "psutil" "fastapi" "starlette" "pydantic" "pydantic-core" "annotated-types"
  "typing-inspection" "httpx" "httpcore" "h11" "anyio" "sniffio" "idna" "certifi" "orjson" "uvicorn" "click"
  "safetensors" "tokenizers"
)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  pyver="${2:-3.11}"
  mkdir -p "$WHEELS"
  for spec in "${WHEEL_LIST[@]}"; do
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version "$pyver" \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      --implementation cp -d "$WHEELS" "$spec" -q 2>/dev/null || "$PY" -m pip download --no-deps -d "$WHEELS" "$spec" -q
  done
  for sdist in "$WHEELS"/*.tar.gz; do  # pure-Python sdists (antlr4 runtime): build a wheel once, here
    [[ -e "$sdist" ]] || continue
    "$PY" -m pip wheel --no-deps -q -w "$WHEELS" "$sdist" && rm "$sdist"
  done
  du -sh "$WHEELS"
  exit 0
fi

MODE="gpu"
[[ "${1:-}" == "--cpu-smoke" ]] && MODE="cpu"

EXTRA_SITE=""
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  EXTRA_SITE="$(mktemp -d)/site"
  mkdir -p "$EXTRA_SITE"
  for whl in "$WHEELS"/*.whl; do "$PY" -m zipfile -e "$whl" "$EXTRA_SITE"; done
  echo "carried wheels unpacked into $EXTRA_SITE ($(ls "$WHEELS"/*.whl | wc -l) wheels)"
fi

export LIGHTNING_GPU_CHECK_MODE="$MODE" LIGHTNING_GPU_EXTRA_SITE="$EXTRA_SITE" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
timeout 560 "$PY" - <<'PY'
import asyncio, json, os, sys, tempfile, time, traceback, types
from pathlib import Path

extra = os.environ.get("LIGHTNING_GPU_EXTRA_SITE")
if extra:
    sys.path.append(extra)  # after site-packages: the image's packages win, the wheels fill the gaps
CPU = os.environ["LIGHTNING_GPU_CHECK_MODE"] == "cpu"
T0 = time.perf_counter()
results: dict = {}

import torch

device = "cpu" if CPU else "cuda"
if not CPU and not torch.cuda.is_available():
    sys.exit("no CUDA device visible")
print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0) if not CPU else 'cpu (smoke test)'}")


def sync() -> None:
    if not CPU:
        torch.cuda.synchronize()


def phase(name: str, budget_s: float):
    """Run a phase unless the 10-minute budget is nearly spent; report failures and go on."""
    def wrap(fn):
        left = 540 - (time.perf_counter() - T0)
        if left < budget_s:
            print(f"[{name}] skipped: {left:.0f}s left, needs ~{budget_s:.0f}s")
            results[name] = {"skipped": "time budget"}
            return fn
        print(f"\n=== {name} ===", flush=True)
        try:
            results[name] = fn()
        except Exception as exc:  # report and continue with the next phase
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        return fn
    return wrap


# ---------------------------------------------------------------------------------------------- models on disk
from transformers import Qwen2Config, Qwen2ForCausalLM
from lightning_sdk.policy.model import TinyPolicyConfig, build_policy, load_policy

work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
corpus = [
    f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n{a + b}<|im_end|>\n"
    for a in range(30) for b in range(30)
]
tiny_cfg = TinyPolicyConfig(hidden_size=64, num_layers=2, intermediate_size=128) if CPU else TinyPolicyConfig()
tiny_dir = build_policy(work / "tiny", corpus, tiny_cfg)
_, tok = load_policy(tiny_dir)
big_dir = work / "big"
big_cfg = Qwen2Config(
    vocab_size=len(tok), hidden_size=128 if CPU else 768, intermediate_size=256 if CPU else 3072,
    num_hidden_layers=2 if CPU else 12, num_attention_heads=4 if CPU else 12, num_key_value_heads=4 if CPU else 12,
    max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
    pad_token_id=tok.pad_token_id,
)
torch.manual_seed(0)
big = Qwen2ForCausalLM(big_cfg)
big.save_pretrained(str(big_dir))
tok.save_pretrained(str(big_dir))
del big
n_params = {}
for name, d in (("tiny", tiny_dir), ("big", big_dir)):
    m, _ = load_policy(d)
    n_params[name] = sum(p.numel() for p in m.parameters())
    print(f"{name} model: {n_params[name] / 1e6:.1f}M parameters, vocab {len(tok)}")
results["params"] = n_params

N_PROMPTS = 8 if CPU else 64
MAX_NEW = 16 if CPU else 128


def prompts() -> list[list[int]]:
    out = []
    for i in range(N_PROMPTS):
        text = tok.apply_chat_template(
            [{"role": "user", "content": f"What is {i} + {i * 7 % 13}?"}], add_generation_prompt=True, tokenize=False
        )
        out.append(list(tok.encode(text, add_special_tokens=False)))
    return out


def rollout(engine) -> tuple[list, float]:
    from lightning_sdk.engines.base import Sampling

    async def go():
        t = time.perf_counter()
        gens = await asyncio.gather(*(
            engine.generate(p, Sampling(max_tokens=MAX_NEW, temperature=1.0, seed=i)) for i, p in enumerate(prompts())
        ))
        return gens, time.perf_counter() - t
    return asyncio.run(go())


def rows_of(gens) -> list:
    from lightning_sdk.trainer.verl.batch import TrainRow

    rows = []
    for i, (p, g) in enumerate(zip(prompts(), gens)):
        adv = 1.0 if i % 2 else -1.0
        n = len(g.completion_ids)
        rows.append(TrainRow(input_ids=p + g.completion_ids, loss_mask=[0] * len(p) + [1] * n,
                             logprobs=[0.0] * len(p) + g.logprobs, advantages=[0.0] * len(p) + [adv] * n,
                             reward=float(i % 2), group=f"g{i // 4}"))
    return rows


def embedded(model_dir: Path) -> dict:
    from lightning_sdk.engines.embedded import EmbeddedEngine
    from lightning_sdk.trainer.learner import Learner, LearnerConfig, TrainBatch

    model, _ = load_policy(model_dir)
    engine = EmbeddedEngine(model, tok, device=device)
    rollout(engine)  # warm-up
    gens, secs = rollout(engine)
    n_tok = sum(len(g.completion_ids) for g in gens)
    trainee, _ = load_policy(model_dir)
    learner = Learner(trainee.to(device), LearnerConfig(lr=1e-5, warmup_steps=1))
    rows = rows_of(gens)
    width = max(len(r.input_ids) for r in rows)

    def col(key: str, dtype) -> torch.Tensor:
        t = torch.zeros(len(rows), width, dtype=dtype)
        for i, r in enumerate(rows):
            t[i, : len(r.input_ids)] = torch.tensor(getattr(r, key), dtype=dtype)
        return t.to(device)

    attn = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        attn[i, : len(r.input_ids)] = 1
    batch = TrainBatch(input_ids=col("input_ids", torch.long), attention_mask=attn.to(device),
                       loss_mask=col("loss_mask", torch.long), logprobs=col("logprobs", torch.float32),
                       advantages=col("advantages", torch.float32))
    step_s = []
    for _ in range(3):
        sync(); t = time.perf_counter()
        metrics = learner.step(batch)
        sync(); step_s.append(time.perf_counter() - t)
    t = time.perf_counter()
    asyncio.run(engine.update_weights(learner.weights(), 1))
    sync(); swap_s = time.perf_counter() - t
    asyncio.run(engine.close())
    out = {"gen_tokens": n_tok, "gen_s": round(secs, 3), "gen_tok_per_s": round(n_tok / secs, 1),
           "learner_step_s": [round(s, 3) for s in step_s], "weight_swap_s": round(swap_s, 4),
           "train_tokens": int(batch.loss_mask.sum()), "loss": round(float(metrics.get("loss", float("nan"))), 4)}
    print(json.dumps(out))
    return out


phase("A_embedded_tiny", 30)(lambda: embedded(tiny_dir))
phase("B_embedded_110M", 90)(lambda: embedded(big_dir))


# --------------------------------------------------------------------------------------------- verl without Ray
class _RayStub:
    """Stands for any ``ray`` attribute verl touches at import time: callable (a decorator returns its argument),
    subclassable, subscriptable. Never called on the no-Ray path."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and not kwargs and callable(args[0]) else _RayStub(self._name + "()")

    def __getattr__(self, name: str):
        return _RayStub(f"{self._name}.{name}")

    def __getitem__(self, key):
        return self

    def __mro_entries__(self, bases):
        return (object,)


class _RayFinder:
    """Serves ``ray`` and every ``ray.*`` submodule as a stub package (only when Ray is not installed)."""

    def find_spec(self, name, path=None, target=None):
        import importlib.machinery

        if name == "ray" or name.startswith("ray."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.ObjectRef = type("ObjectRef", (), {})
        mod.__getattr__ = lambda attr: _RayStub(f"{spec.name}.{attr}")
        return mod

    def exec_module(self, module):
        return None


def verl_phase(model_dir: Path) -> dict:
    try:
        import ray  # noqa: F401
    except ImportError:
        sys.modules.pop("ray", None)
        sys.meta_path.insert(0, _RayFinder())
        print("ray is not installed: stub modules stand in (verl imports ray; this path never calls it)")
    from lightning_sdk.engines.embedded import EmbeddedEngine
    from lightning_sdk.trainer.verl.backend import VerlBackend
    from lightning_sdk.trainer.verl.config import VerlConfig

    model, _ = load_policy(model_dir)
    engine = EmbeddedEngine(model, tok, device=device)
    gens, _ = rollout(engine)
    rows = rows_of(gens)
    t = time.perf_counter()
    backend = VerlBackend(VerlConfig(model_dir=str(model_dir), device=device, lr=1e-5, micro_batch_tokens=16384),
                          use_ray=False)
    init_s = time.perf_counter() - t
    step_s, metrics = [], {}
    for _ in range(3):
        sync(); t = time.perf_counter()
        metrics = backend.step(rows)
        sync(); step_s.append(time.perf_counter() - t)
    publish_s = asyncio.run(backend.publish(engine))
    after, _ = rollout(engine)
    asyncio.run(engine.close())
    backend.shutdown()
    out = {"init_s": round(init_s, 2), "step_s": [round(s, 3) for s in step_s], "publish_s": round(publish_s, 3),
           "pg_loss": round(metrics.get("actor/pg_loss", float("nan")), 4),
           "grad_norm": round(metrics.get("grad_norm", float("nan")), 4),
           "is_mean": round(metrics.get("rollout_corr/rollout_is_mean", float("nan")), 4),
           "engine_version_after_publish": after[0].policy_version}
    print(json.dumps(out))
    return out


phase("C_verl_fsdp_tiny", 60)(lambda: verl_phase(tiny_dir))
phase("C_verl_fsdp_110M", 120)(lambda: verl_phase(big_dir))

results["wall_s"] = round(time.perf_counter() - T0, 1)
print("\nGPU_CHECK_RESULT " + json.dumps(results))
PY
