"""Training: one loop for every world size and every loss, and what plans, drives and reports it.

    plan = plan_run(RunRequest({"data": "shk", "preset": "tiny"}, out=Path("checkpoints/tiny")))
    with open_world(plan.train) as world: result = Trainer(plan, display, world).fit()

- request.py: what a run asks for (RunRequest), declared once, which the CLI's options are generated from
- plan.py: flags, presets and a config file -> a checked RunPlan (fresh, resumed, or from other weights)
- trainer.py: the loop (micro-batches, evaluation, checkpoints, signals); events.py: what it reports
- optim.py: AdamW and Muon parameter groups and the LR schedule
- distributed.py: the process group and the DDP/FSDP wrappers; launch.py: `--nproc` through torch's launcher
- finetune.py: full and LoRA fine-tuning plans; trackers.py: tensorboard and wandb sinks

May import: the top-level modules, data/, runs/, interop/. Never inference/, serve/, inspect/ or cli/.
"""
