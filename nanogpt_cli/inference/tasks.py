"""Scores on lm-evaluation-harness tasks: the task names resolved, lm-eval run on our model (lm_eval_model), the
scores as rows, and lm-eval's results JSON and per-sample logs written where asked.

    lm = NanoGPTLM("checkpoints/shk")
    results = evaluate_tasks(lm, ["hellaswag", "arc_easy"], limit=100)
    for s in results.scores: print(s.task, s.metric, s.value, s.stderr)

lm-eval indexes its ~15,000 built-in task files in seconds; names that a folder of the user's own YAMLs
(include_path) or YAML paths resolve alone are looked up without that index. lm-eval itself downloads the datasets
of built-in tasks (Hugging Face datasets, cached after the first run); a task over local files downloads nothing.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanogpt_cli.errors import NanoGPTError, first_line, require


@dataclass
class TaskScore:
    """One metric of one task, as lm-eval's own table shows it."""

    task: str  # the task (or group) name; a group's subtasks are indented by lm-eval (" - name")
    metric: str  # acc, acc_norm, exact_match, word_perplexity, ...
    filter: str  # lm-eval's post-processing of the answers the metric read; "none" for none
    value: float
    stderr: float | None  # None where lm-eval computes none
    num_fewshot: int | None  # examples shown before each question
    samples: int | None  # documents scored


@dataclass
class TaskResults:
    scores: list[TaskScore]
    results: dict[str, Any]  # lm-eval's results object (results, groups, configs, versions, n-shot, config, ...)
    samples: dict[str, list[dict]] | None  # per task, each document's prompt, answers and metrics
    elapsed_s: float
    output_path: Path | None  # where lm-eval wrote its results JSON and per-sample logs

    def to_json(self) -> str:
        """lm-eval's results object as JSON (what --json prints and --output-path holds)."""
        from lm_eval.utils import handle_non_serializable

        return json.dumps(self.results, indent=2, default=handle_non_serializable, ensure_ascii=False)


def check_options(
    tasks: list[str], limit: int | None, num_fewshot: int | None, include_path: str | Path | None
) -> list[str]:
    """The task names, split at commas, after the checks that need no lm-eval (one sentence each)."""
    names = [n.strip() for t in tasks for n in t.split(",") if n.strip()]
    if not names:
        raise NanoGPTError("--tasks needs at least one task name, e.g. --tasks hellaswag,arc_easy")
    if limit is not None and limit < 1:
        raise NanoGPTError(f"--limit must be at least 1 document per task, got {limit}")
    if num_fewshot is not None and num_fewshot < 0:
        raise NanoGPTError(f"--num-fewshot must be 0 or more, got {num_fewshot}")
    if include_path is not None and not Path(include_path).exists():
        raise NanoGPTError(f"--include-path {include_path} does not exist; give a folder of task YAML files")
    return names


def _model_args(lm) -> dict[str, Any]:
    """What the results record of the model: its source (which names lm-eval's output folder) and, for a quantized
    one, how (the scores are not the float model's)."""
    args: dict[str, Any] = {"pretrained": lm.source or "nanogpt"}
    kind = getattr(lm.model, "quantized", None)
    if kind is not None:
        args["quantize"] = kind
        if kind == "int4":
            args["group_size"] = lm.model.quant_group_size
    return args


def evaluate_tasks(
    lm,
    tasks: list[str],
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    include_path: str | Path | None = None,
    apply_chat_template: bool = False,
    output_path: str | Path | None = None,
) -> TaskResults:
    """Score `lm` (a NanoGPTLM) on lm-eval tasks: names, groups, tags, glob patterns or YAML paths. limit: the
    first N documents of each task; num_fewshot: examples before each question (default: the task's own);
    include_path: a folder of task YAMLs of your own; apply_chat_template: render each prompt with the model's
    chat template; output_path: where lm-eval writes its results JSON and per-sample logs."""
    names = check_options(tasks, limit, num_fewshot, include_path)
    lm_eval = require("lm_eval", "eval", "scoring lm-eval tasks", package="lm-eval")
    manager, resolved = _resolve(names, include_path)
    from lm_eval.loggers import EvaluationTracker

    tracker = EvaluationTracker(output_path=str(output_path)) if output_path is not None else None
    t0 = time.perf_counter()
    try:
        results = lm_eval.simple_evaluate(
            model=lm,
            model_args=_model_args(lm),
            tasks=resolved,
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            log_samples=True,
            evaluation_tracker=tracker,
            apply_chat_template=apply_chat_template,
        )
    except (ConnectionError, FileNotFoundError) as e:  # a dataset on the hub without a network; a missing file
        raise NanoGPTError(
            f"a task's dataset could not be loaded: {first_line(e)} (the datasets of lm-eval's own tasks download "
            "once, then load from the cache)"
        ) from None
    elapsed = time.perf_counter() - t0
    samples = results.pop("samples", None)
    if tracker is not None:
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results["configs"]:
            tracker.save_results_samples(task_name=task, samples=samples[task])
    path = Path(output_path) if output_path is not None else None
    return TaskResults(_scores(results), results, samples, elapsed, path)


def _resolve(names: list[str], include_path: str | Path | None):
    """lm-eval's TaskManager and the task list for it: each name a task, group or tag it knows, a YAML file, or a
    glob pattern over the names. Without the built-in index first when include_path or YAML paths may do alone."""
    from lm_eval.tasks import TaskManager

    include = str(include_path) if include_path is not None else None
    if include is not None or all(_is_yaml(n) for n in names):
        manager = TaskManager(include_path=include, include_defaults=False)
        resolved, unknown = _match(manager, names)
        if not unknown:
            return manager, resolved
    manager = TaskManager(include_path=include)
    resolved, unknown = _match(manager, names)
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], manager.all_tasks, n=3, cutoff=0.6)
        raise NanoGPTError(
            f"unknown task {unknown[0]!r}: no lm-eval task, group or tag has that name, and it is no YAML file"
            + (f" (close: {', '.join(close)})" if close else "")
            + ("" if include is not None else "; --include-path DIR adds task YAMLs of your own")
        )
    return manager, resolved


def _match(manager, names: list[str]) -> tuple[list[str], list[str]]:
    resolved, unknown = [], []
    for name in names:
        if name in manager.all_tasks or _is_yaml(name):
            resolved.append(name)
        elif any(c in name for c in "*?[") and manager.match_tasks([name]):
            resolved += [m for m in manager.match_tasks([name]) if m not in resolved]
        else:
            unknown.append(name)
    return resolved, unknown


def _is_yaml(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) and Path(name).is_file()


def _scores(results: dict[str, Any]) -> list[TaskScore]:
    """Every metric of every task and group in lm-eval's results, in its order, as rows."""
    rows = []
    n_shot, counts = results.get("n-shot", {}), results.get("n-samples", {})
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue  # alias, name, sample_len; stderrs go beside their metric
            stderr = metrics.get(f"{metric}_stderr,{filter_name}")
            shots = n_shot.get(task)
            rows.append(
                TaskScore(
                    task=metrics.get("alias", task),
                    metric=metric,
                    filter=filter_name,
                    value=float(value),
                    stderr=float(stderr) if isinstance(stderr, (int, float)) else None,
                    num_fewshot=int(shots) if isinstance(shots, int) else None,
                    samples=counts.get(task, {}).get("effective"),
                )
            )
    return rows
