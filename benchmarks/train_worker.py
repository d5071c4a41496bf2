"""One training run for the benchmarks, in this process or as one rank of a torchrun launch: rank 0 writes the
TrainResult's figures (and the GPU's peak memory) as JSON. Started by common.train_in_processes.

    python benchmarks/train_worker.py '{"preset": "tiny", "data": "shk", "max_iters": 50}' RUN_DIR RESULT.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from nanogpt_cli.train import plan_run, train


def main() -> None:
    flags, run_dir, result_path = json.loads(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    result = train(plan_run(flags, out=run_dir))
    if os.environ.get("RANK", "0") == "0":
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        result_path.write_text(json.dumps(dict(
            ms_per_iter=result.ms_per_iter, tokens_per_s=result.tokens_per_s, mfu=result.mfu, peak_bytes=peak,
            train_loss=result.train_loss, val_loss=result.val_loss, elapsed_s=result.elapsed_s)))


if __name__ == "__main__":
    main()
