"""Peak memory (RSS) of full fine-tuning against LoRA on a gpt2-124m-shaped model on the CPU, each run a fresh
process, with transformers + peft doing the same as the reference a user would otherwise pick.

    python benchmarks/bench_lora_memory.py                 # 3 updates of 2 x 256 tokens each
    python benchmarks/bench_lora_memory.py --block-size 1024 --iters 2

The base is gpt2-124m's shape (12 layers, 768 wide, 12 heads, GPT-2's vocabulary) with random weights: nothing is
downloaded. `nanogpt finetune` runs as a user runs it (load the base file, the step-0 evaluation, the updates,
the final evaluation and save); the transformers rows build the same shape and run the updates on random ids
with torch's AdamW (no data loading, evaluation or save), so they are the floor of what the same training needs.
Peak RSS is the child's ru_maxrss (os.wait4).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, table  # noqa: E402

HF_CHILD = r"""
import sys, torch, transformers
lora, block, batch, iters = sys.argv[1] == "lora", int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
config = transformers.GPT2Config(n_positions=block, n_embd=768, n_layer=12, n_head=12)
model = transformers.GPT2LMHeadModel(config)
if lora:
    import peft
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"],
                                                      fan_in_fan_out=True, task_type="CAUSAL_LM"))
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
for _ in range(iters):
    ids = torch.randint(0, 50257, (batch, block))
    model(ids, labels=ids).loss.backward()
    opt.step(); opt.zero_grad(set_to_none=True)
"""


def run(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(peak RSS in GB, wall seconds) of one child process."""
    started = time.perf_counter()
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed: {child.stderr.read().decode()[-2000:]}")
    return usage.ru_maxrss / 1e6, wall  # ru_maxrss is in kB on Linux


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-size", type=int, default=256, help="Context of the base (and of every update).")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--iters", type=int, default=3, help="Optimizer updates per run.")
    p.add_argument("--skip-hf", action="store_true", help="Leave out the transformers + peft rows.")
    args = p.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    sys.path.insert(0, str(ROOT))
    from nanogpt_cli.config import GPTConfig, preset_values, split_values
    from nanogpt_cli.data.chat import prepare_chat
    from nanogpt_cli.model import GPT
    from nanogpt_cli.runs.checkpoint import save_model
    from nanogpt_cli.tokenizer import build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rng = random.Random(0)
        rows = []
        for _ in range(2000):
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": f"What is {a} + {b}?"},
                        {"role": "assistant", "content": f"{a} + {b} = {a + b}."},
                    ]
                }
            )
        (tmp / "chats.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        prepare_chat(str(tmp / "chats.jsonl"), "chats", data_dir=str(tmp / "data"), tokenizer="gpt2")
        model_values, _ = split_values(preset_values("gpt2-124m"))
        config = GPTConfig(**{**model_values, "vocab_size": 50304, "block_size": args.block_size})
        save_model(tmp / "base.safetensors", GPT(config), {"tokenizer": build_tokenizer("gpt2").describe()})
        del config

        common = ["--init-from", str(tmp / "base.safetensors"), "--data", "chats", "--data-dir", str(tmp / "data")]
        common += ["--max-iters", str(args.iters), "--eval-interval", str(args.iters), "--eval-iters", "1"]
        common += ["--batch-size", str(args.batch_size), "--warmup-iters", "0", "--dtype", "float32"]
        common += ["--device", "cpu", "-q"]
        nanogpt = [sys.executable, "-m", "nanogpt_cli", "finetune", *common]
        runs = [
            ("nanogpt finetune (full)", [*nanogpt, "--out", str(tmp / "full")]),
            ("nanogpt finetune --lora (r 8, attn.c_attn)", [*nanogpt, "--lora", "--out", str(tmp / "lora")]),
        ]
        if not args.skip_hf:
            shape = [str(args.block_size), str(args.batch_size), str(args.iters)]
            runs += [
                ("transformers + AdamW (full)", [sys.executable, "-c", HF_CHILD, "full", *shape]),
                ("transformers + peft LoRA (r 8, c_attn)", [sys.executable, "-c", HF_CHILD, "lora", *shape]),
            ]
        results = [(name, *run(cmd, env)) for name, cmd in runs]
    full = results[0][1]
    load = os.getloadavg()[0]
    table(
        f"peak RSS, gpt2-124m shape, {args.iters} updates of {args.batch_size} x {args.block_size} tokens, CPU "
        f"(load {load:.1f})",
        ["run", "peak RSS (GB)", "vs nanogpt full", "wall (s)"],
        [[name, f"{rss:.2f}", f"{rss / full:.2f}x", f"{wall:.0f}"] for name, rss, wall in results],
    )


if __name__ == "__main__":
    main()
