"""lm-eval tasks on our backend (`nanogpt eval tasks`) against lm-eval's own `hf` backend on our Hugging Face export
of the same model: the same task, limit, batch size and threads.

    python benchmarks/bench_eval.py
    python benchmarks/bench_eval.py --limit 200 --threads 1 --n-layer 6 --n-embd 384 --batch-size 32

Two local multiple-choice tasks written as YAMLs over a jsonl (nothing is downloaded): "hellaswag-like" (a context
of ~80 tokens, 4 endings of ~20 tokens) and "mmlu-like" (a question, 4 one-token choices " A" .. " D"). The model
has random weights (speed does not depend on them) and GPT-2's tokenizer. "model" is the time inside the backend's
loglikelihood (what differs); "simple_evaluate" is the whole call, lm-eval's own work included (building the
requests, metrics, its environment report). Both backends run in this process, one after the other, best of
--rounds; the accuracies must come out equal.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

from nanogpt_cli.config import GPTConfig  # noqa: E402
from nanogpt_cli.model import GPT  # noqa: E402
from nanogpt_cli.runs.checkpoint import save_model  # noqa: E402
from nanogpt_cli.tokenizer import build_tokenizer  # noqa: E402

WORDS = (
    "the king queen lord love death night day sword crown blood heart fair sweet good noble gentle speak come go "
    "house river mountain city market winter summer letter answer question reason music water fire garden"
).split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def write_tasks(folder: Path, docs: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    rows = [
        {
            "ctx": " ".join(sentence(rng, rng.randint(8, 14)) for _ in range(7)),
            "endings": [sentence(rng, rng.randint(12, 22)) for _ in range(4)],
            "question": " ".join(sentence(rng, rng.randint(6, 12)) for _ in range(4)),
            "options": [sentence(rng, 4) for _ in range(4)],
            "label": rng.randrange(4),
        }
        for _ in range(docs)
    ]
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    head = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    metrics = (
        "metric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
        "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n"
    )
    (folder / "hellaswag_like.yaml").write_text(
        "task: hellaswag_like\n" + head + "output_type: multiple_choice\n"
        'doc_to_text: "{{ctx}}"\ndoc_to_choice: "{{endings}}"\ndoc_to_target: label\n' + metrics
    )
    (folder / "mmlu_like.yaml").write_text(
        "task: mmlu_like\n" + head + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}\\nA. {{options[0]}}\\nB. {{options[1]}}\\nC. {{options[2]}}\\n'
        'D. {{options[3]}}\\nAnswer:"\ndoc_to_choice: ["A", "B", "C", "D"]\ndoc_to_target: label\n' + metrics
    )
    return ["hellaswag_like", "mmlu_like"]


def timed(lm) -> list[float]:
    """Wrap lm.loglikelihood to add its seconds to the returned one-item list."""
    spent = [0.0]
    inner = lm.loglikelihood

    def loglikelihood(requests, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(requests, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    lm.loglikelihood = loglikelihood
    return spent


def run(lm, task: str, tasks_dir: Path, limit: int) -> tuple[float, float, dict]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    spent = timed(lm)
    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], limit=limit, task_manager=manager, bootstrap_iters=0)
    del lm.loglikelihood  # the class's own again
    return spent[0], time.perf_counter() - t0, out["results"][task]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=100, help="documents per task")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--block-size", type=int, default=256)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from lm_eval.models.huggingface import HFLM

    from nanogpt_cli.inference.lm_eval_model import NanoGPTLM
    from nanogpt_cli.interop.export import export

    tok = build_tokenizer("gpt2")
    cfg = GPTConfig(
        vocab_size=tok.vocab_size, block_size=args.block_size, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd
    )
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        save_model(tmp / "m.safetensors", GPT(cfg).eval(), {"tokenizer": tok.describe()})
        export(tmp / "m.safetensors", "hf", tmp / "hf")
        (tmp / "tasks").mkdir()
        tasks = write_tasks(tmp / "tasks", args.limit)
        ours = NanoGPTLM(str(tmp / "m.safetensors"), device="cpu", batch_size=args.batch_size)
        hf = HFLM(pretrained=str(tmp / "hf"), device="cpu", dtype="float32", batch_size=args.batch_size)
        rows = []
        for task in tasks:
            best = {"ours": (float("inf"),) * 2, "hf": (float("inf"),) * 2}
            scores = {}
            for _ in range(args.rounds):
                for name, lm in (("ours", ours), ("hf", hf)):
                    model_s, total_s, result = run(lm, task, tmp / "tasks", args.limit)
                    best[name] = min(best[name], (model_s, total_s))
                    scores[name] = (result["acc,none"], result["acc_norm,none"])
            assert scores["ours"] == scores["hf"], scores
            (om, ot), (hm, ht) = best["ours"], best["hf"]
            rows.append([task, f"{hm:.2f}", f"{om:.2f}", f"{hm / om:.1f}x"])
            rows[-1] += [f"{ht:.2f}", f"{ot:.2f}", f"{ht / ot:.1f}x"]
    header = ["task", "hf model s", "ours model s", "ratio", "hf simple_evaluate s", "ours", "ratio"]
    title = (
        f"{args.limit} docs, {args.n_layer} x {args.n_embd}, context {args.block_size}, GPT-2 vocabulary, "
        f"batch {args.batch_size}, {args.threads} thread(s), float32, CPU"
    )
    table(title, header, rows)


if __name__ == "__main__":
    main()
