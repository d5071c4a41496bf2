"""A run on disk: the run folder's layout and the weights/optimizer file format.

    run = RunDir(Path("checkpoints/shk")); weights = resolve_weights(Path("checkpoints/shk"), last=False)

- checkpoint.py: the safetensors format of weights and optimizer state, and its metadata JSON
- rundir.py: the run folder (the only code that knows its file names), its staged save and recovery

May import: the top-level modules (model, lora, config, files, errors). Nothing above them.
"""
