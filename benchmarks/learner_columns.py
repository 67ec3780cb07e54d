"""What ``keep_from`` saves the embedded learner on long prompts with a large vocabulary: SmolLM2-135M-Instruct
(vocabulary 49,152) with a LoRA adapter, rows of a long shared prompt and a short trained completion (a coding CLI's
call: 4-9k prompt tokens, ~100 trained), one forward + backward of ``token_logprobs`` per mode, in one run:

    python benchmarks/learner_columns.py [--prompt 4000] [--completion 128] [--rows 2] [--repeats 2]

Modes (alternated per repeat, each in a fresh process so that peak RSS is its own):

- ``all``: the output head and the softmax over every column (the code before ``keep_from``);
- ``kept``: only from the first trained column (``keep_from = first_trained(loss_mask)``: what the learner does).

Prints seconds and peak RSS per mode, the ratio ``all / kept``, and the largest difference of the trained columns'
log-probs and of the adapter's gradients between the two (they should agree to ~1e-5). Needs the SmolLM2 model
(``lightning-sdk setup smollm2``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(mode: str, prompt: int, completion: int, rows: int, out: Path) -> None:
    import torch

    from lightning_sdk.policy.model import load_policy
    from lightning_sdk.policy.smollm2 import prepare_smollm2
    from lightning_sdk.trainer.learner import LoraSettings, first_trained, token_logprobs, wrap_lora

    torch.manual_seed(0)
    model, _ = load_policy(prepare_smollm2())
    model = wrap_lora(model, LoraSettings())
    model.train()
    width = prompt + completion
    g = torch.Generator().manual_seed(1)
    head = torch.randint(100, 40_000, (prompt,), generator=g)
    ids = torch.stack([torch.cat([head, torch.randint(100, 40_000, (completion,), generator=g)]) for _ in range(rows)])
    attn = torch.ones(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width)
    mask[:, prompt:] = 1
    keep = first_trained(mask) if mode == "kept" else 0
    t0 = time.perf_counter()
    logp, _ = token_logprobs(model, ids, attn, 0.6, prefix=prompt, keep_from=keep)
    (logp * mask[:, 1:]).sum().backward()
    seconds = time.perf_counter() - t0
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    torch.save({"logp": logp.detach()[:, prompt - 1 :], "grads": grads}, out.with_suffix(".pt"))
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.write_text(json.dumps({"seconds": seconds, "rss_mb": rss_mb}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=4000)
    parser.add_argument("--completion", type=int, default=128)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args.one, args.prompt, args.completion, args.rows, args.out)
        return
    import tempfile

    import torch

    results: dict[str, list[dict[str, float]]] = {"all": [], "kept": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for mode in ("all", "kept") if r % 2 == 0 else ("kept", "all"):
                out = Path(tmp) / f"{mode}-{r}.json"
                cmd = [sys.executable, __file__, "--one", mode, "--out", str(out), "--prompt", str(args.prompt),
                       "--completion", str(args.completion), "--rows", str(args.rows)]  # fmt: skip
                subprocess.run(cmd, check=True, cwd=ROOT)
                results[mode].append(json.loads(out.read_text()))
                print(f"repeat {r} {mode}: {results[mode][-1]['seconds']:.2f} s, peak RSS "
                      f"{results[mode][-1]['rss_mb']:.0f} MB", flush=True)  # fmt: skip
        a, k = torch.load(Path(tmp) / "all-0.pt"), torch.load(Path(tmp) / "kept-0.pt")
        dlogp = float((a["logp"] - k["logp"]).abs().max())
        dgrad = float((a["grads"] - k["grads"]).abs().max() / a["grads"].abs().max())
    s = {m: statistics.median(x["seconds"] for x in v) for m, v in results.items()}
    rss = {m: max(x["rss_mb"] for x in v) for m, v in results.items()}
    print(f"SmolLM2 + LoRA, {args.rows} rows of {args.prompt} shared prompt + {args.completion} trained tokens, "
          f"forward + backward (median of {args.repeats}):")  # fmt: skip
    print(f"  all columns:  {s['all']:.2f} s, peak RSS {rss['all']:.0f} MB")
    print(f"  kept columns: {s['kept']:.2f} s, peak RSS {rss['kept']:.0f} MB")
    print(f"  ratio all / kept: {s['all'] / s['kept']:.2f}x time, {rss['all'] / rss['kept']:.2f}x peak RSS")
    print(f"  trained columns' log-probs differ by {dlogp:.1e}; adapter gradients by {dgrad:.1e} (relative)")


if __name__ == "__main__":
    main()
