"""Typed configs for the model and the trainer, named presets, and their JSON/TOML round trip.

    model_cfg, train_cfg = build_configs({**preset_values("shakespeare-char"), "vocab_size": 65})
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from nanogpt_cli.errors import NanoGPTError

POS_ENCODINGS = ("rope", "sinusoidal", "learned")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "gelu_tanh", "swiglu", "relu2")
OPTIMIZERS = ("adamw", "muon")
LR_SCHEDULES = ("cosine", "constant", "wsd")
DTYPES = ("float32", "bfloat16", "float16")  # --dtype's names besides auto; torch.<name> is the dtype
PARALLEL = ("ddp", "fsdp")


@dataclass
class GPTConfig:
    """The architecture. A checkpoint stores this as JSON and is rebuilt from it."""

    vocab_size: int = 50304  # tokens in the vocabulary (the dataset's meta.json sets it for training)
    block_size: int = 256  # context length in tokens
    n_layer: int = 6  # transformer blocks
    n_head: int = 6  # attention heads per block
    n_embd: int = 384  # residual stream width
    dropout: float = 0.0  # dropout on attention weights, residual branches and embeddings
    bias: bool = False  # biases in Linear and LayerNorm layers (GPT-2 has them)
    pos_encoding: str = "rope"  # rope | sinusoidal | learned
    rope_theta: float = 10000.0  # RoPE base frequency
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5  # epsilon of the norm layers
    # gelu_tanh (GPT-2's approximation of GELU, the one llama.cpp computes, so the default exports to GGUF) |
    # gelu (exact, erf) | swiglu | relu2 (squared ReLU). Checkpoints store the value, so older ones keep theirs
    mlp: str = "gelu_tanh"
    mlp_hidden: int | None = None  # MLP hidden width; None: 4*n_embd (gelu) or ~8/3*n_embd rounded to 64 (swiglu)
    tie_embeddings: bool = True  # the LM head shares the token embedding matrix
    # modded-nanogpt / nanochat block options; off by default, so older checkpoints load unchanged
    qk_norm: bool = False  # RMSNorm (with a gain per head dimension) on queries and keys, before RoPE
    logit_softcap: float | None = None  # logits -> C * tanh(logits / C), in fp32 (Gemma 2); None: off
    zero_init_proj: bool = False  # start each residual branch's output projection at zero (init only)

    def __post_init__(self):
        check_finite(self)
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{flag(name)} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"--n-embd ({self.n_embd}) must be divisible by --n-head ({self.n_head})")
        if self.pos_encoding not in POS_ENCODINGS:
            raise ValueError(f"--pos-encoding must be one of {', '.join(POS_ENCODINGS)}, got {self.pos_encoding!r}")
        if self.pos_encoding == "rope" and self.head_size % 2 != 0:
            raise ValueError(
                f"RoPE needs an even head size, but --n-embd {self.n_embd} / --n-head {self.n_head} = {self.head_size}"
            )
        if self.pos_encoding == "sinusoidal" and self.n_embd % 2 != 0:
            raise ValueError(f"sinusoidal positions need an even --n-embd, got {self.n_embd}")
        if self.norm not in NORMS:
            raise ValueError(f"--norm must be one of {', '.join(NORMS)}, got {self.norm!r}")
        if self.mlp not in MLPS:
            raise ValueError(f"--mlp must be one of {', '.join(MLPS)}, got {self.mlp!r}")
        if self.mlp_hidden is not None and self.mlp_hidden <= 0:
            raise ValueError(f"--mlp-hidden must be a positive integer, got {self.mlp_hidden}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise ValueError(f"--logit-softcap must be positive, got {self.logit_softcap}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError("--rope-theta and --norm-eps must be positive")

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def hidden_size(self) -> int:
        """The MLP's hidden width."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        if self.mlp != "swiglu":
            return 4 * self.n_embd
        # SwiGLU has three matrices instead of two: 2/3 of 4*n_embd keeps the parameter count (Llama)
        return -(-(8 * self.n_embd // 3) // 64) * 64

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown model config keys: {', '.join(sorted(unknown))}")
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> GPTConfig:
        return cls.from_dict(json.loads(s))


@dataclass
class TrainConfig:
    """How to train. Field names follow nanoGPT's train.py; one iteration is one optimizer update."""

    data: str = ""  # dataset name under data_dir (written by `nanogpt prepare`)
    data_dir: str = "data"  # folder holding prepared datasets
    batch_size: int = 12  # sequences per micro-batch
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer update
    max_iters: int = 2000  # optimizer updates in the whole run
    learning_rate: float = 1e-3  # peak learning rate
    min_lr: float = 1e-4  # learning rate at the end of the decay
    lr_schedule: str = "cosine"  # cosine | constant | wsd (warmup-stable-decay)
    warmup_iters: int = 100  # linear warmup updates
    lr_decay_iters: int | None = None  # updates until min_lr; None: max_iters
    wsd_decay_frac: float = 0.2  # wsd: fraction of lr_decay_iters spent decaying
    weight_decay: float = 0.1  # AdamW decay on matrices (not on biases, norms)
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.99  # AdamW's second-moment decay (0.95 for large models)
    grad_clip: float = 1.0  # clip the global grad norm to this; 0 disables
    optimizer: str = "adamw"  # adamw | muon (Muon for the matrices inside the blocks, AdamW for the rest)
    muon_lr: float = 0.02  # Muon's peak learning rate; the schedule scales it like --learning-rate
    muon_momentum: float = 0.95  # Muon's momentum (Nesterov)
    muon_momentum_warmup: int = 0  # updates over which Muon's momentum rises from 0.85 to --muon-momentum
    eval_interval: int = 250  # evaluate every this many updates (and at the end)
    eval_iters: int = 20  # batches per split in each evaluation
    log_interval: int = 10  # progress line every this many updates
    seed: int = 1337  # seeds the init, the batches, dropout and the evaluation batches
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    compile: bool = False  # torch.compile the model
    stop_at: int | None = None  # end after this update as if interrupted (the schedule still follows max_iters)
    max_time: float | None = None  # seconds: end the run by then, evaluations included (the last one's length is
    # kept free for the final one); the schedule runs on the share of the time spent or of lr_decay_iters done,
    # whichever is further
    parallel: str = "ddp"  # under torchrun: ddp (weights replicated) | fsdp (weights sharded, FSDP2)

    def __post_init__(self):
        check_finite(self)
        for name in ("batch_size", "gradient_accumulation_steps", "max_iters", "eval_interval", "eval_iters",
                     "log_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{flag(name)} must be a positive integer, got {value!r}")
        if self.warmup_iters < 0:
            raise ValueError(f"--warmup-iters must be >= 0, got {self.warmup_iters}")
        if self.learning_rate <= 0 or self.min_lr < 0:
            raise ValueError("--learning-rate must be positive and --min-lr non-negative")
        if self.min_lr > self.learning_rate:
            raise ValueError(f"--min-lr ({self.min_lr:g}) is above --learning-rate ({self.learning_rate:g}): the "
                             "schedule decays from the peak down to --min-lr")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.parallel not in PARALLEL:
            raise ValueError(f"--parallel must be one of {', '.join(PARALLEL)}, got {self.parallel!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of auto, {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 0.0 < self.wsd_decay_frac <= 1.0:
            raise ValueError(f"--wsd-decay-frac must be in (0, 1], got {self.wsd_decay_frac}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("--grad-clip and --weight-decay must be >= 0")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.muon_lr <= 0 or not 0.0 <= self.muon_momentum < 1.0 or self.muon_momentum_warmup < 0:
            raise ValueError("--muon-lr must be positive, --muon-momentum in [0, 1) and --muon-momentum-warmup >= 0")
        if self.optimizer == "muon" and self.parallel == "fsdp":
            raise ValueError("--optimizer muon needs whole matrices, which --parallel fsdp shards across processes; "
                             "use --parallel ddp with muon")
        if self.max_time is not None and self.max_time <= 0:
            raise ValueError(f"--max-time must be a positive number of seconds, got {self.max_time}")
        if self.stop_at is not None and self.stop_at <= 0:
            raise ValueError(f"--stop-at must be a positive integer, got {self.stop_at}")

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters if self.lr_decay_iters is not None else self.max_iters

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# A preset names values for fields of GPTConfig and TrainConfig; flags and config files override it.
PRESETS: dict[str, dict[str, Any]] = {
    # tests, CI and smoke runs: a few seconds on a CPU
    "tiny": dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=8, max_iters=50, eval_interval=25,
                 eval_iters=4, warmup_iters=5, learning_rate=3e-3),
    # nanoGPT's CPU recipe for Tiny Shakespeare (char): a couple of minutes on a laptop
    "cpu-char": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12, max_iters=2000,
                     dropout=0.0, eval_iters=20, learning_rate=1e-3, min_lr=1e-4,
                     warmup_iters=100, beta2=0.99),
    # the cpu-char budget spent better (issue 11): Muon on the block matrices, QK-norm, squared ReLU, soft-capped
    # logits, zero-initialised projections, a warmup-stable-decay schedule, twice the context and a third more
    # batch. A step costs ~3x cpu-char's on a CPU (twice the context, 4/3 the rows, Muon's Newton-Schulz), so
    # 600 iterations take about the wall time of its 2000. Tuned at equal steps (val after 800 x 12 rows, or
    # 600 x 16): WSD decay share 0.3 / 0.5 / 0.7 gave 1.621 / 1.615 / 1.607, 16 rows x 600 1.601, 24 x 400 1.645,
    # --muon-lr 0.03 1.634, AdamW lr 4e-3 1.628; context 128 beat 64 at equal tokens. See bench_quality.py
    "cpu-fast": dict(n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=16, max_iters=600, dropout=0.0,
                     qk_norm=True, mlp="relu2", logit_softcap=30.0, zero_init_proj=True, optimizer="muon",
                     muon_lr=0.02, muon_momentum=0.95, muon_momentum_warmup=100, learning_rate=2e-3, min_lr=1e-4,
                     lr_schedule="wsd", wsd_decay_frac=0.7, warmup_iters=50, eval_iters=20, eval_interval=250,
                     beta2=0.99),
    # nanoGPT's config/train_shakespeare_char.py: a few minutes on a GPU
    "shakespeare-char": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.2, batch_size=64,
                             max_iters=5000, learning_rate=1e-3, min_lr=1e-4,
                             warmup_iters=100, beta2=0.99, eval_interval=250, eval_iters=200),
    # GPT-2 small and medium shapes: learned positions, tanh GELU and biases, as OpenAI trained them
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, pos_encoding="learned",
                      mlp="gelu_tanh", bias=True, batch_size=12, gradient_accumulation_steps=40, max_iters=600000,
                      learning_rate=6e-4, min_lr=6e-5, warmup_iters=2000, beta2=0.95, eval_interval=1000,
                      eval_iters=200),
    "gpt2-350m": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024,
                      pos_encoding="learned", mlp="gelu_tanh", bias=True, batch_size=8, gradient_accumulation_steps=60,
                      max_iters=600000, learning_rate=3e-4, min_lr=3e-5, warmup_iters=2000, beta2=0.95,
                      eval_interval=1000, eval_iters=200),
}

def check_finite(config) -> None:
    """NaN and infinity pass every comparison-based check below, so they are refused first, by flag."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"--{flag(f.name)} must be a finite number, got {value}")


MODEL_FIELDS = frozenset(f.name for f in dataclasses.fields(GPTConfig))
TRAIN_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainConfig))


def flag(name: str) -> str:
    """The CLI flag for a config field: n_embd -> n-embd."""
    return name.replace("_", "-")


def preset_values(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise NanoGPTError(f"unknown preset {name!r}; these exist: {', '.join(PRESETS)}")
    return dict(PRESETS[name])


def load_toml(path: Path) -> dict[str, Any]:
    """A run config file: flat keys, or [model] and [train] tables, named like the config fields."""
    from nanogpt_cli.files import read_text_file

    try:
        raw = tomllib.loads(read_text_file(path, "--config"))
    except tomllib.TOMLDecodeError as e:
        raise NanoGPTError(f"config file {path} is not valid TOML: {e}") from None
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key in ("model", "train") and isinstance(value, dict):
            values.update(value)
        else:
            values[key] = value
    values = {k.replace("-", "_"): v for k, v in values.items()}
    known = MODEL_FIELDS | TRAIN_FIELDS | {"preset", "out"}
    unknown = sorted(set(values) - known)
    if unknown:
        named = []
        for key in unknown:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            named.append(f"{key} (did you mean {close[0]}?)" if close else key)
        raise NanoGPTError(f"unknown key(s) in {path}: {', '.join(named)}")
    return values


def split_values(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split merged key/values into (model kwargs, train kwargs); unknown keys are an error."""
    unknown = set(values) - MODEL_FIELDS - TRAIN_FIELDS
    if unknown:
        raise NanoGPTError(f"unknown config key(s): {', '.join(sorted(unknown))}")
    model = {k: v for k, v in values.items() if k in MODEL_FIELDS}
    train = {k: v for k, v in values.items() if k in TRAIN_FIELDS}
    return model, train


_KINDS = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}
_NAMES = {"int": "a whole number", "float": "a number", "bool": "true or false", "str": "text"}


def check_types(values: dict[str, Any]) -> None:
    """Config-file values of the wrong type, named by their flag (the CLI's flags are typed already)."""
    annotations = {f.name: f.type for cls in (GPTConfig, TrainConfig) for f in dataclasses.fields(cls)}
    for key, value in values.items():
        kind = str(annotations[key]).replace(" | None", "")
        if value is None and str(annotations[key]).endswith("| None"):
            continue
        is_bool = isinstance(value, bool)
        if not isinstance(value, _KINDS[kind]) or (is_bool and kind != "bool"):
            raise NanoGPTError(f"--{flag(key)} must be {_NAMES[kind]}, got {value!r}")


def build_configs(values: dict[str, Any]) -> tuple[GPTConfig, TrainConfig]:
    """Both configs from merged values; a validation error becomes one NanoGPTError sentence."""
    model_kw, train_kw = split_values(values)
    check_types(values)
    try:
        return GPTConfig(**model_kw), TrainConfig(**train_kw)
    except (ValueError, TypeError) as e:
        raise NanoGPTError(str(e)) from None
