"""One training run for the benchmarks, in this process or as one rank of a torchrun launch: rank 0 writes the
TrainResult's figures (and the GPU's peak memory) as JSON. Started by common.train_in_processes.

    python benchmarks/train_worker.py '{"preset": "tiny", "data": "shk", "max_iters": 50}' RUN_DIR RESULT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from nanogpt_cli.training.distributed import open_world
from nanogpt_cli.training.plan import plan_run
from nanogpt_cli.training.request import RunRequest
from nanogpt_cli.training.trainer import train


def main() -> None:
    flags, run_dir, result_path = json.loads(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    plan = plan_run(RunRequest(flags, out=run_dir))
    with open_world(plan.train) as world:  # under torchrun: this process's place in the group
        result = train(plan, world=world)
    if world.main:
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        result_path.write_text(
            json.dumps(
                dict(
                    ms_per_iter=result.ms_per_iter,
                    tokens_per_s=result.tokens_per_s,
                    mfu=result.mfu,
                    peak_bytes=peak,
                    train_loss=result.train_loss,
                    val_loss=result.val_loss,
                    elapsed_s=result.elapsed_s,
                )
            )
        )


if __name__ == "__main__":
    main()
