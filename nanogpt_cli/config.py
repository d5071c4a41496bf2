"""Typed configs for the model and the trainer, named presets, and their JSON/TOML round trip.

model_cfg, train_cfg = build_configs({**preset_values("shakespeare-char"), "vocab_size": 65})
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import json
import math
import re
import sys
import types as types_module
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from nanogpt_cli.errors import NanoGPTError


class Choice(str, enum.Enum):
    """A config value from a fixed list: a str (it compares, hashes and serialises as its value) whose CLI
    option offers exactly these choices."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:  # error messages quote the value as the user wrote it
        return repr(self.value)


class PosEncoding(Choice):
    rope = "rope"
    sinusoidal = "sinusoidal"
    learned = "learned"


class Norm(Choice):
    layernorm = "layernorm"
    rmsnorm = "rmsnorm"


class MLP(Choice):
    gelu = "gelu"
    gelu_tanh = "gelu_tanh"
    swiglu = "swiglu"
    relu2 = "relu2"
    geglu = "geglu"


class RopeScaling(Choice):
    """--rope-scaling: how RoPE's frequencies stretch to a longer context than they were trained at."""

    none = "none"
    linear = "linear"  # position interpolation (Chen et al. 2023): every frequency divided by --rope-factor
    llama3 = "llama3"  # Llama 3.1: low frequencies divided, high ones kept, a smooth ramp between
    yarn = "yarn"  # YaRN (Peng et al. 2023): a ramp over the dimensions, and an attention temperature


# the fields of each RoPE scaling, for the check that a value given is one the scaling reads
ROPE_SCALING_FIELDS = {
    "none": (),
    "linear": ("rope_factor",),
    "llama3": ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_context"),
    "yarn": ("rope_factor", "rope_original_context", "rope_beta_fast", "rope_beta_slow"),
}


class OptimizerName(Choice):
    adamw = "adamw"
    muon = "muon"


class LRSchedule(Choice):
    cosine = "cosine"
    constant = "constant"
    wsd = "wsd"


class Dtype(Choice):
    """--dtype: auto picks one from the device (device.py); each other name is torch.<name>."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Parallel(Choice):
    ddp = "ddp"
    fsdp = "fsdp"


MAIN = ""  # the panel of the command's own options, for config fields shown among them


class Resume(enum.Enum):
    """How `--resume` treats a config field that the resumed command gives (again): training/plan.py applies
    each field's rule. The command that started a run may be given again, preset included."""

    # the run's own (its architecture, dataset, optimizer): a value equal to the saved one is accepted, another
    # refused, naming both: every GPTConfig field is one, refused together in one sentence; a TrainConfig field
    # declares its own `refusal`
    FIXED = "fixed"
    # applies from the resumed step on, announced ("--learning-rate 0.001 -> 0.0003 from step 723") and kept
    # in the run's history
    CHANGES = "changes"
    # as CHANGES where the run was trained with a value; where it was not (the default, None), the run has no
    # place for one: a preset's value is set aside with the field's `aside` note, a given one refused (`refusal`)
    CHANGES_IF_SET = "changes if set"
    # where this machine keeps the run's inputs: the value given now, else the saved one; not announced
    LOCAL = "local"
    # this invocation's only (when it stops): the value given now, else the default; not announced
    INVOCATION = "invocation"


@dataclass(frozen=True)
class Needs:
    """What a training value needs of the model to take effect, declared on its field (--embedding-lr: an
    untied embedding). Where `holds(model)` is false, the plan sets a preset's value aside (back to the default)
    with the `aside` note and refuses a given one; the optimizer gives it no effect (in_use). The sentences are
    formats of {given}, {preset} and {source}, the run or weights whose model it is."""

    holds: Callable[[GPTConfig], bool]
    refused: str  # a given value, for the model of {source}
    refused_new: str  # a given value, for a new model (its own flags can change it)
    aside: str  # a preset's value, set aside

    def refuse(self, given: Any, source: str | None) -> NanoGPTError:
        """The refusal of a given value; source None: a new model."""
        if source is None:
            return NanoGPTError(self.refused_new.format(given=show_value(given)))
        return NanoGPTError(self.refused.format(given=show_value(given), source=source))


def setting(
    default: Any,
    help: str,
    resume: Resume,
    panel: str | None = None,
    default_shown: bool = True,
    needs: Needs | None = None,
    refusal: str | None = None,
    aside: str | None = None,
) -> Any:
    """A config field with its CLI option's help text (and panel: the class's PANEL unless given) and its rule
    on resume (refusal and aside: that rule's sentences, see Resume; formats of {given}, {saved}, {preset} and
    {run_dir}) declared beside it; `nanogpt train` generates its options from these (cli.config_options).
    default_shown=False: the help does not show the default (it says what applies instead). needs: what the
    model must have for the value to take effect."""
    metadata: dict[str, Any] = {"help": help, "default_shown": default_shown, "resume": resume}
    for key, value in (("panel", panel), ("needs", needs), ("refusal", refusal), ("aside", aside)):
        if value is not None:
            metadata[key] = value
    return dataclasses.field(default=default, metadata=metadata)


def field_help(cls: type, name: str) -> str:
    """A config field's help text, for a command that offers the same option outside the config."""
    return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)


def in_use(train: TrainConfig, name: str, model: GPTConfig) -> bool:
    """Whether a training value takes effect on this model: it is set (not its default), and what its field
    needs of the model (Needs) holds."""
    f = next(f for f in dataclasses.fields(TrainConfig) if f.name == name)
    needs = f.metadata.get("needs")
    return getattr(train, name) != f.default and (needs is None or needs.holds(model))


@dataclass
class GPTConfig:
    """The architecture. A checkpoint stores this as JSON and is rebuilt from it."""

    PANEL: ClassVar[str] = "Model"

    # the dataset's meta.json sets it for training
    vocab_size: int = setting(
        50304, "Vocabulary (default: the dataset's; larger pads it).", Resume.FIXED, default_shown=False
    )
    block_size: int = setting(256, "Context length.", Resume.FIXED)
    n_layer: int = setting(6, "Transformer blocks.", Resume.FIXED)
    n_head: int = setting(6, "Attention heads.", Resume.FIXED)
    n_embd: int = setting(384, "Residual width.", Resume.FIXED)
    # grouped-query attention (Ainslie et al. 2023): each key/value head serves n_head / n_kv_head query heads,
    # which shrinks the KV cache by that ratio; 1 is multi-query attention
    n_kv_head: int | None = setting(None, "Key/value heads (default: --n-head).", Resume.FIXED, default_shown=False)
    head_dim: int | None = setting(
        None, "Size of each head (default: --n-embd / --n-head).", Resume.FIXED, default_shown=False
    )
    # Qwen2 has biases on q, k and v only
    qkv_bias: bool | None = setting(
        None, "Biases on the query, key and value projections (default: --bias).", Resume.FIXED, default_shown=False
    )
    rope_scaling: RopeScaling = setting(RopeScaling.none, "RoPE frequency scaling for longer contexts.", Resume.FIXED)
    rope_factor: float = setting(1.0, "RoPE scaling: context extension factor.", Resume.FIXED)
    rope_low_freq_factor: float = setting(1.0, "llama3 RoPE scaling: low-frequency factor.", Resume.FIXED)
    rope_high_freq_factor: float = setting(4.0, "llama3 RoPE scaling: high-frequency factor.", Resume.FIXED)
    rope_original_context: int | None = setting(
        None, "RoPE scaling: the context it was trained at (default: --block-size).", Resume.FIXED, default_shown=False
    )
    rope_beta_fast: float = setting(32.0, "YaRN: rotations above which a dimension is kept.", Resume.FIXED)
    rope_beta_slow: float = setting(1.0, "YaRN: rotations below which a dimension is interpolated.", Resume.FIXED)
    # on attention weights, residual branches and embeddings
    dropout: float = setting(0.0, "Dropout rate.", Resume.FIXED)
    bias: bool = setting(False, "Biases in linear and norm layers.", Resume.FIXED)  # GPT-2 has them
    pos_encoding: PosEncoding = setting(PosEncoding.rope, "Position encoding.", Resume.FIXED)
    rope_theta: float = setting(10000.0, "RoPE base.", Resume.FIXED)
    norm: Norm = setting(Norm.layernorm, "Norm layers.", Resume.FIXED)
    norm_eps: float = setting(1e-5, "Norm epsilon.", Resume.FIXED)
    # gelu_tanh is GPT-2's approximation of GELU and the one llama.cpp computes, so the default exports to GGUF;
    # gelu is exact (erf). Checkpoints store the value, so older ones keep theirs
    mlp: MLP = setting(MLP.gelu_tanh, "MLP activation; relu2 is squared ReLU, geglu tanh-GELU gated.", Resume.FIXED)
    # None: 4*n_embd (gelu) or ~8/3*n_embd rounded to 64 (swiglu, geglu)
    mlp_hidden: int | None = setting(None, "MLP hidden width.", Resume.FIXED)
    tie_embeddings: bool = setting(True, "Share the embedding with the LM head.", Resume.FIXED)
    # modded-nanogpt / nanochat block options; off by default, so older checkpoints load unchanged
    # with a gain per head dimension, before RoPE
    qk_norm: bool = setting(False, "RMSNorm on queries and keys.", Resume.FIXED)
    # GPT-NeoX/Pythia rotate a share of each head (rotary_pct); the rest carries no position
    rotary_dim: int | None = setting(
        None, "Dimensions of each head that RoPE rotates (default: all).", Resume.FIXED, default_shown=False
    )
    # GPT-NeoX/GPT-J: x + attn(ln_1(x)) + mlp(ln_2(x)), one residual add per block
    parallel_residual: bool = setting(False, "Attention and MLP read the same block input.", Resume.FIXED)
    # Mistral, Gemma: a local layer's token sees the keys j with p - window < j <= p
    sliding_window: int | None = setting(None, "Attention window of local layers (tokens).", Resume.FIXED)
    # a cycle over the layers: Gemma 3's LLLLLG makes every sixth layer global
    window_pattern: str | None = setting(
        None, "Local (L) and global (G) layers, as a cycle (default: all local).", Resume.FIXED, default_shown=False
    )
    rope_local_theta: float | None = setting(
        None, "RoPE base of local layers (default: --rope-theta).", Resume.FIXED, default_shown=False
    )
    # the Gemma set; the embedding is scaled on its way in only, not as the tied LM head
    embed_scale: bool = setting(False, "Multiply token embeddings by sqrt(--n-embd).", Resume.FIXED)
    # every RMSNorm, QK-norm's included; w starts at 0
    norm_offset: bool = setting(False, "RMSNorm gains are 1 + w (Gemma).", Resume.FIXED)
    post_norms: bool = setting(False, "A norm on each sub-block's output too, before its add.", Resume.FIXED)
    # in fp32 (Gemma 2)
    logit_softcap: float | None = setting(None, "Soft-cap the logits at C with tanh.", Resume.FIXED)
    # each residual branch's; init only
    zero_init_proj: bool = setting(False, "Start output projections at zero.", Resume.FIXED)

    def __post_init__(self):
        check_values(self)
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{flag(name)} must be a positive integer, got {value!r}")
        for name in ("n_kv_head", "head_dim", "rope_original_context"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"--{flag(name)} must be a positive integer, got {value!r}")
        if self.head_dim is None and self.n_embd % self.n_head != 0:
            raise ValueError(
                f"--n-embd ({self.n_embd}) must be divisible by --n-head ({self.n_head}), or --head-dim given"
            )
        if self.n_head % self.kv_heads != 0:
            raise ValueError(f"--n-head ({self.n_head}) must be a multiple of --n-kv-head ({self.kv_heads})")
        if self.pos_encoding == "rope" and self.head_size % 2 != 0:
            raise ValueError(
                f"RoPE needs an even head size, got {self.head_size} (--head-dim, or --n-embd / --n-head)"
                if self.head_dim is not None
                else f"RoPE needs an even head size, but --n-embd {self.n_embd} / --n-head {self.n_head} = "
                f"{self.head_size}"
            )
        self.check_rope_scaling()
        if self.pos_encoding == "sinusoidal" and self.n_embd % 2 != 0:
            raise ValueError(f"sinusoidal positions need an even --n-embd, got {self.n_embd}")
        if self.mlp_hidden is not None and self.mlp_hidden <= 0:
            raise ValueError(f"--mlp-hidden must be a positive integer, got {self.mlp_hidden}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise ValueError(f"--logit-softcap must be positive, got {self.logit_softcap}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError("--rope-theta and --norm-eps must be positive")
        check_arch(self)

    def check_rope_scaling(self) -> None:
        """A scaling's values: each given one is read by the chosen scaling, and each is in its range."""
        used = ROPE_SCALING_FIELDS[str(self.rope_scaling)]
        for f in dataclasses.fields(self):
            if (
                f.name.startswith("rope_")
                and f.name not in ("rope_theta", "rope_scaling", "rope_local_theta")
                and f.name not in used
            ):
                if getattr(self, f.name) != f.default:
                    kinds = [k for k, names in ROPE_SCALING_FIELDS.items() if f.name in names]
                    raise ValueError(
                        f"--{flag(f.name)} applies to --rope-scaling {' or '.join(kinds)}, not "
                        f"{self.rope_scaling}; add --rope-scaling {kinds[-1]} or drop --{flag(f.name)}"
                    )
        if self.rope_scaling != "none" and self.pos_encoding != "rope":
            raise ValueError(f"--rope-scaling {self.rope_scaling} needs --pos-encoding rope")
        if self.rope_factor <= 0:
            raise ValueError(f"--rope-factor must be positive, got {self.rope_factor:g}")
        if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError(
                f"--rope-low-freq-factor ({self.rope_low_freq_factor:g}) must be positive and below "
                f"--rope-high-freq-factor ({self.rope_high_freq_factor:g})"
            )
        if self.rope_beta_slow <= 0 or self.rope_beta_fast <= self.rope_beta_slow:
            raise ValueError(
                f"--rope-beta-fast ({self.rope_beta_fast:g}) must be above --rope-beta-slow "
                f"({self.rope_beta_slow:g}), which must be positive"
            )

    @property
    def head_size(self) -> int:
        """Each head's size: --head-dim, else n_embd / n_head."""
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: --n-kv-head, else one per query head."""
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def attn_bias(self) -> bool:
        """Whether q, k and v have biases: --qkv-bias, else --bias."""
        return self.qkv_bias if self.qkv_bias is not None else self.bias

    @property
    def rope_context(self) -> int:
        """The context RoPE's scaling counts from: --rope-original-context, else --block-size."""
        return self.rope_original_context or self.block_size

    @property
    def kv_values_per_token(self) -> float:
        """Numbers the KV cache holds per token of a row at the full context: a key and a value of each key/value
        head in every layer, a sliding-window layer's window spread over the context."""
        held = sum(self.keys_seen(layer, self.block_size) for layer in range(self.n_layer))
        values = 2 * self.kv_heads * self.head_size * held
        return values // self.block_size if values % self.block_size == 0 else values / self.block_size

    @property
    def hidden_size(self) -> int:
        """The MLP's hidden width."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        if not self.gated:
            return 4 * self.n_embd
        # SwiGLU has three matrices instead of two: 2/3 of 4*n_embd keeps the parameter count (Llama)
        return -(-(8 * self.n_embd // 3) // 64) * 64

    @property
    def gated(self) -> bool:
        """Whether the MLP is gated (SwiGLU, GeGLU): three matrices, its first fused into gate and up halves."""
        return self.mlp in ("swiglu", "geglu")

    @property
    def rotary_size(self) -> int:
        """The dimensions of each head that RoPE rotates."""
        return self.head_size if self.rotary_dim is None else self.rotary_dim

    def is_local(self, layer: int) -> bool:
        """Whether a layer attends within --sliding-window (True) or over the whole context."""
        if self.sliding_window is None:
            return False
        return self.window_pattern is None or self.window_pattern[layer % len(self.window_pattern)] == "L"

    def keys_seen(self, layer: int, T: int) -> int:
        """The most keys one token of a T-token sequence attends to in a layer: its window, else T."""
        return min(T, self.sliding_window) if self.is_local(layer) else T

    def attention_words(self) -> str:
        """The attention in words, for `info`: '4 query heads, 1 key/value head, of 32; qkv bias; RoPE llama3 x8'."""
        kv = self.kv_heads
        words = f"{self.n_head} query heads, {kv} key/value head{'s' if kv != 1 else ''}, of {self.head_size}"
        if self.attn_bias:
            words += "; qkv bias"
        if self.rope_scaling != "none":
            words += f"; RoPE {self.rope_scaling} x{self.rope_factor:g} from {self.rope_context:,}"
        return words

    def extras(self) -> list[str]:
        """The settings beyond the basic block, in words, for `info` ("parallel residual", ...)."""
        words = []
        if self.rotary_dim is not None and self.pos_encoding == "rope":
            words.append(f"RoPE on {self.rotary_dim} of {self.head_size} head dims")
        if self.parallel_residual:
            words.append("parallel residual")
        if self.sliding_window is not None:
            local = sum(self.is_local(i) for i in range(self.n_layer))
            theta = "" if self.rope_local_theta is None else f", RoPE base {self.rope_local_theta:,g}"
            words.append(f"window {self.sliding_window:,} on {local} of {self.n_layer} layers{theta}")
        for name, words_for in (
            ("embed_scale", "embeddings x sqrt(width)"),
            ("norm_offset", "1 + w norms"),
            ("post_norms", "post-norms"),
            ("qk_norm", "QK-norm"),
        ):
            if getattr(self, name):
                words.append(words_for)
        return words

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


# --embedding-lr's need: an embedding of its own; one tied to the LM head is the head too, and trains at
# --learning-rate
UNTIED_EMBEDDING = Needs(
    holds=lambda model: not model.tie_embeddings,
    refused="--embedding-lr {given} is for an untied token embedding, and {source} ties it to the LM head; "
    "drop --embedding-lr",
    refused_new="--embedding-lr {given} is for an untied token embedding, and this model ties it to the LM head; "
    "add --no-tie-embeddings, or drop --embedding-lr",
    aside="--preset {preset}'s --embedding-lr {given} is for an untied embedding; this model's is tied to the LM "
    "head, so it trains at --learning-rate",
)


@dataclass
class TrainConfig:
    """How to train. Field names follow nanoGPT's train.py; one iteration is one optimizer update."""

    PANEL: ClassVar[str] = "Training"

    data: str = setting(
        "",
        "Dataset name under --data-dir (made by nanogpt prepare).",
        Resume.FIXED,
        panel=MAIN,
        refusal="--data {given} is a different dataset from the one {run_dir} trains on ({saved!r}); resume without "
        "--data, or train on it in a new run: nanogpt train --init-from {run_dir} --data {given} --out NEW_FOLDER",
    )
    data_dir: str = setting("data", "Folder of prepared datasets.", Resume.LOCAL, panel=MAIN)
    batch_size: int = setting(
        12, "Sequences per micro-batch (a converted model on a CPU: by its size, with a note).", Resume.CHANGES
    )
    # the model keeps its context (positions, RoPE tables, what exports write); shorter windows cost less (attention
    # is quadratic in their length) and a chat dataset packs its conversations into them. A converted model's long
    # context gets a shorter default, with a note (plan.py, CONVERTED_SEQ_LEN)
    seq_len: int | None = setting(
        None,
        "Tokens per training sequence, at most the model's context (default: --block-size; a Hugging Face or GGUF "
        "model's, up to 1024).",
        Resume.CHANGES,
        default_shown=False,
    )
    gradient_accumulation_steps: int = setting(1, "Micro-batches per update.", Resume.CHANGES)
    max_iters: int = setting(2000, "Optimizer updates in the run.", Resume.CHANGES)
    learning_rate: float = setting(1e-3, "Peak learning rate.", Resume.CHANGES)
    min_lr: float = setting(1e-4, "Final learning rate.", Resume.CHANGES)  # at the end of the decay
    lr_schedule: LRSchedule = setting(
        LRSchedule.cosine, "Learning rate schedule; wsd is warmup-stable-decay.", Resume.CHANGES
    )
    wsd_decay_frac: float = setting(0.2, "wsd: share of the decay iters spent decaying.", Resume.CHANGES)
    warmup_iters: int = setting(100, "Linear warmup updates.", Resume.CHANGES)
    lr_decay_iters: int | None = setting(None, "Updates until --min-lr (default --max-iters).", Resume.CHANGES)
    weight_decay: float = setting(0.1, "AdamW weight decay on matrices.", Resume.CHANGES)  # not on biases, norms
    beta1: float = setting(0.9, "AdamW beta1.", Resume.CHANGES)
    beta2: float = setting(0.99, "AdamW beta2.", Resume.CHANGES)  # 0.95 for large models
    grad_clip: float = setting(1.0, "Clip the gradient norm (0: off).", Resume.CHANGES)
    # its state is the run's: another optimizer starts a new run from the weights
    optimizer: OptimizerName = setting(
        OptimizerName.adamw,
        "muon: Muon on the block matrices, AdamW on the rest.",
        Resume.FIXED,
        refusal="--resume continues the run's --optimizer {saved}; it cannot change to {given} (start a new run "
        "with --init-from instead)",
    )
    # the schedule scales it like --learning-rate. A run trained without one has no optimizer group for the
    # embedding to take a rate of its own
    embedding_lr: float | None = setting(
        None,
        "AdamW's peak learning rate for an untied token embedding.",
        Resume.CHANGES_IF_SET,
        needs=UNTIED_EMBEDDING,
        refusal="--embedding-lr {given} would give the embedding an optimizer group of its own, which {run_dir} was "
        "not trained with; resume without it, or start a new run from these weights with --init-from {run_dir}",
        aside="--preset {preset}'s --embedding-lr {given} is set aside: {run_dir} trains its embedding at "
        "--learning-rate",
    )
    # the schedule scales it like --learning-rate
    muon_lr: float = setting(0.02, "Muon's peak learning rate.", Resume.CHANGES)
    muon_momentum: float = setting(0.95, "Muon's momentum.", Resume.CHANGES)  # Nesterov
    muon_momentum_warmup: int = setting(0, "Updates to raise Muon's momentum from 0.85.", Resume.CHANGES)
    # each step is three small matmuls per matrix: a small share of a CPU update (benchmarks/README.md)
    muon_ns_steps: int = setting(5, "Muon's Newton-Schulz steps.", Resume.CHANGES)
    eval_interval: int = setting(250, "Evaluate and checkpoint every N updates.", Resume.CHANGES)  # and at the end
    eval_iters: int = setting(
        20, "Batches per split in an evaluation (a converted model on a CPU: 2, with a note).", Resume.CHANGES
    )
    # a speedrun under a short --max-time skips it: it costs about ten updates and trains nothing
    eval_first: bool = setting(True, "Evaluate before the first update (the loss at init).", Resume.CHANGES)
    log_interval: int = setting(10, "Progress every N updates.", Resume.CHANGES)
    # seeds the init, the batches, dropout and the evaluation batches
    seed: int = setting(1337, "Random seed.", Resume.CHANGES)
    device: str = setting("auto", "auto, cpu, cuda, cuda:N or mps.", Resume.CHANGES)
    dtype: Dtype = setting(Dtype.auto, "Training precision (auto: from the device).", Resume.CHANGES)
    compile: bool = setting(False, "torch.compile the model.", Resume.CHANGES)
    # a background save holds a host copy of the weights and optimizer state while it writes
    sync_save: bool = setting(
        False, "Write checkpoints on the training thread (no copy of the state in memory).", Resume.CHANGES
    )
    # the schedule still follows max_iters
    stop_at: int | None = setting(None, "Stop after update K as if interrupted.", Resume.INVOCATION)
    # evaluations included (the last one's length is kept free for the final one); the schedule runs on the share
    # of the time spent or of lr_decay_iters done, whichever is further. A resume that raises it trains on
    max_time: float | None = setting(
        None,
        "End after this much training time: seconds, or 90s, 20m, 2h; the LR schedule then follows the time spent.",
        Resume.CHANGES,
    )
    parallel: Parallel = setting(
        Parallel.ddp, "Under torchrun: ddp (weights on every GPU) or fsdp (sharded).", Resume.CHANGES
    )
    # a chat dataset's loss mask: off trains on the prompts too (the comparison the mask is measured against)
    loss_mask: bool = setting(True, "On a chat dataset, train on the assistant's tokens only.", Resume.CHANGES)

    def __post_init__(self):
        check_values(self)
        for name in (
            "batch_size",
            "gradient_accumulation_steps",
            "max_iters",
            "eval_interval",
            "eval_iters",
            "log_interval",
            "muon_ns_steps",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{flag(name)} must be a positive integer, got {value!r}")
        if self.warmup_iters < 0:
            raise ValueError(f"--warmup-iters must be >= 0, got {self.warmup_iters}")
        if self.learning_rate <= 0 or self.min_lr < 0:
            raise ValueError("--learning-rate must be positive and --min-lr non-negative")
        if self.min_lr > self.learning_rate:
            raise ValueError(
                f"--min-lr ({self.min_lr:g}) is above --learning-rate ({self.learning_rate:g}): the "
                "schedule decays from the peak down to --min-lr"
            )
        if self.embedding_lr is not None and self.embedding_lr <= 0:
            raise ValueError(f"--embedding-lr must be positive, got {self.embedding_lr:g}")
        if not 0.0 < self.wsd_decay_frac <= 1.0:
            raise ValueError(f"--wsd-decay-frac must be in (0, 1], got {self.wsd_decay_frac}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("--grad-clip and --weight-decay must be >= 0")
        if self.muon_lr <= 0 or not 0.0 <= self.muon_momentum < 1.0 or self.muon_momentum_warmup < 0:
            raise ValueError("--muon-lr must be positive, --muon-momentum in [0, 1) and --muon-momentum-warmup >= 0")
        if self.optimizer == "muon" and self.parallel == "fsdp":
            raise ValueError(
                "--optimizer muon needs whole matrices, which --parallel fsdp shards across processes; "
                "use --parallel ddp with muon"
            )
        if self.max_time is not None and self.max_time <= 0:
            raise ValueError(f"--max-time must be a positive number of seconds, got {self.max_time}")
        if self.stop_at is not None and self.stop_at <= 0:
            raise ValueError(f"--stop-at must be a positive integer, got {self.stop_at}")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len <= 0):
            raise ValueError(f"--seq-len must be a positive integer, got {self.seq_len!r}")

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters if self.lr_decay_iters is not None else self.max_iters

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# A preset names values for fields of GPTConfig and TrainConfig; flags and config files override it.
_CPU_FAST: dict[str, Any] = dict(
    n_layer=3,
    n_head=4,
    n_embd=128,
    block_size=128,
    batch_size=16,
    max_iters=800,
    dropout=0.0,
    qk_norm=True,
    mlp="relu2",
    logit_softcap=30.0,
    zero_init_proj=True,
    tie_embeddings=False,
    optimizer="muon",
    embedding_lr=0.06,
    muon_lr=0.02,
    muon_momentum=0.95,
    muon_momentum_warmup=100,
    learning_rate=2e-3,
    min_lr=1e-4,
    lr_schedule="wsd",
    wsd_decay_frac=0.7,
    warmup_iters=50,
    eval_iters=20,
    eval_interval=500,
    eval_first=False,
    beta2=0.99,
)

PRESETS: dict[str, dict[str, Any]] = {
    # tests, CI and smoke runs: a few seconds on a CPU
    "tiny": dict(
        n_layer=2,
        n_head=2,
        n_embd=32,
        block_size=32,
        batch_size=8,
        max_iters=50,
        eval_interval=25,
        eval_iters=4,
        warmup_iters=5,
        learning_rate=3e-3,
    ),
    # nanoGPT's CPU recipe for Tiny Shakespeare (char): a couple of minutes on a laptop
    "cpu-char": dict(
        n_layer=4,
        n_head=4,
        n_embd=128,
        block_size=64,
        batch_size=12,
        max_iters=2000,
        dropout=0.0,
        eval_iters=20,
        learning_rate=1e-3,
        min_lr=1e-4,
        warmup_iters=100,
        beta2=0.99,
    ),
    # the cpu-char budget spent better: Muon on the block matrices, QK-norm, squared ReLU, soft-capped logits,
    # zero-initialised projections, a warmup-stable-decay schedule, twice the context, an untied embedding at its
    # own rate; 3 layers and 800 updates take about cpu-char's wall time. The sweeps that chose each value are in
    # benchmarks/README.md ("How the CPU presets were tuned")
    "cpu-fast": _CPU_FAST,
    # nanoGPT's CPU-recipe quality (val ~1.88) in a third of its wall time, e.g. `--max-time 10` on a 2-core CPU:
    # cpu-fast's blocks at cpu-char's context, 2 heads of 64, a short warm-up and one evaluation, at the end (the
    # loss at init is skipped); tuned at equal updates (benchmarks/README.md, "How the CPU presets were tuned")
    "cpu-speedrun": dict(
        _CPU_FAST,
        n_layer=4,
        n_head=2,
        block_size=64,
        max_iters=300,
        muon_momentum_warmup=50,
        learning_rate=3e-3,
        warmup_iters=20,
        eval_interval=1000,
    ),
    # nanoGPT's config/train_shakespeare_char.py: a few minutes on a GPU
    "shakespeare-char": dict(
        n_layer=6,
        n_head=6,
        n_embd=384,
        block_size=256,
        dropout=0.2,
        batch_size=64,
        max_iters=5000,
        learning_rate=1e-3,
        min_lr=1e-4,
        warmup_iters=100,
        beta2=0.99,
        eval_interval=250,
        eval_iters=200,
    ),
    # GPT-2 small and medium shapes: learned positions, tanh GELU and biases, as OpenAI trained them
    "gpt2-124m": dict(
        n_layer=12,
        n_head=12,
        n_embd=768,
        block_size=1024,
        pos_encoding="learned",
        mlp="gelu_tanh",
        bias=True,
        batch_size=12,
        gradient_accumulation_steps=40,
        max_iters=600000,
        learning_rate=6e-4,
        min_lr=6e-5,
        warmup_iters=2000,
        beta2=0.95,
        eval_interval=1000,
        eval_iters=200,
    ),
    "gpt2-350m": dict(
        n_layer=24,
        n_head=16,
        n_embd=1024,
        block_size=1024,
        pos_encoding="learned",
        mlp="gelu_tanh",
        bias=True,
        batch_size=8,
        gradient_accumulation_steps=60,
        max_iters=600000,
        learning_rate=3e-4,
        min_lr=3e-5,
        warmup_iters=2000,
        beta2=0.95,
        eval_interval=1000,
        eval_iters=200,
    ),
}

MODEL_FIELDS = frozenset(f.name for f in dataclasses.fields(GPTConfig))
TRAIN_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainConfig))


def load_setting(default: Any, help: str, option: str | None = None, unset: Any = None) -> Any:
    """A LoadSpec field with its CLI option's help text; option: the flag where it is not the field's name
    (group_size is --int4-group); unset: the value a command passes where the option is not given, where that is
    not the field's default (the library keeps torch's threads, a command chooses them from the load)."""
    metadata: dict[str, Any] = {"help": help, "option": option, "unset": unset if unset is not None else default}
    return dataclasses.field(default=default, metadata=metadata)


# every source a model loads from (interop/source.py parses it): a bare name is a run in checkpoints/, as `nanogpt
# runs` lists it; a LoRA run's weights file holds its adapters, loaded on the base it names
SOURCE_HELP = (
    "Run folder (its best weights) or a run's name in checkpoints/ (a LoRA run loads on its base), a .safetensors "
    "file, a .gguf file (ours or llama.cpp's), a Hugging Face folder or hf:NAME."
)


# LoadSpec's fields that say how decoding runs (the commands that never decode leave them), and those with the ones
# that say where and in what precision the weights run (the commands that read the weights as stored leave them)
DECODING_FIELDS = ("backend", "draft", "draft_tokens", "draft_lookup")
RUNNING_FIELDS = ("device", "dtype", "quantize", "group_size", "threads", *DECODING_FIELDS)


@dataclass(frozen=True)
class LoadSpec:
    """What a command loads and how: the source and the options that sample, chat, eval, serve, inspect and export
    take, declared once. Each command's options are generated from these fields (cli/common.py `load_options`);
    api.load and interop.loading.load_for_inference take the spec whole. A new load option is one field here."""

    source: str = load_setting(dataclasses.MISSING, SOURCE_HELP)
    last: bool = load_setting(False, "Use a run's last weights instead of its best.")
    device: str = load_setting("auto", field_help(TrainConfig, "device"))
    dtype: Dtype = load_setting(Dtype.auto, "Precision the weights are cast to (auto: from the device and their size).")
    quantize: str | None = load_setting(
        None,
        "Weights of the blocks in int8 (a scale per output channel) or int4 (a scale and zero per --int4-group "
        "inputs), on a CPU; the embedding and head keep --dtype.",
    )
    group_size: int = load_setting(32, "Inputs per int4 scale with --quantize int4: 32, 64, 128 or 256.", "int4-group")
    # None keeps torch's threads as they are (the library's default, so two loads compute the same bits); "auto"
    # chooses them from the load now (device.set_threads), what a command does unless --threads is given
    threads: int | str | None = load_setting(
        None,
        "CPU threads (default: one per core that other running work leaves free, adapted while a CPU run trains; "
        "OMP_NUM_THREADS, if set, is kept).",
        unset="auto",
    )
    backend: str | None = load_setting(
        None,
        "How decode steps are computed: cpu (our kernels, on a CPU) or torch (the model's own forward); default: "
        "the first that supports the model.",
    )
    # speculative decoding (inference/speculative.py): the draft loads as this spec says, its source replaced
    draft: str | None = load_setting(
        None,
        "A smaller model with the same tokenizer (any source a model loads from), loaded as the model is, that "
        "proposes tokens for the model to check in one forward: faster decoding, the same greedy text and the same "
        "distribution.",
    )
    draft_tokens: int | None = load_setting(
        None, "Tokens the --draft model proposes at a time (default: adapted to how many are kept)."
    )
    draft_lookup: bool = load_setting(
        False,
        "Where a row's last 3 tokens occurred before in its text, propose the tokens that followed them there "
        "(prompt lookup), checked as a draft's are: no model's cost, often kept in text that repeats (with "
        "--draft, the draft model proposes elsewhere).",
    )

    def __post_init__(self):
        object.__setattr__(self, "source", str(self.source))
        name = str(self.dtype).removeprefix("torch.")  # a torch.dtype or its name
        if name not in [d.value for d in Dtype]:
            raise NanoGPTError(f"dtype must be one of {', '.join(d.value for d in Dtype)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", Dtype(name))
        if (
            self.threads is not None
            and self.threads != "auto"
            and (not isinstance(self.threads, int) or self.threads < 1)
        ):
            raise NanoGPTError(f"--threads must be at least 1, got {self.threads!r}")
        if self.draft is not None:
            object.__setattr__(self, "draft", str(self.draft))
        elif self.draft_tokens is not None and not self.draft_lookup:
            raise NanoGPTError("--draft-tokens sets how many tokens a draft proposes: give --draft or --draft-lookup")
        check_draft_tokens(self.draft_tokens)


def check_draft_tokens(tokens: int | None) -> None:
    """A draft's K: a fixed number of tokens a round (1 or more), or None for the adaptive K. The one check, which
    LoadSpec and a Draft built in Python share."""
    if tokens is not None and (not isinstance(tokens, int) or tokens < 1):
        raise NanoGPTError(f"--draft-tokens must be at least 1 (or left out for an adaptive K), got {tokens!r}")


@functools.cache
def field_types(cls: type) -> dict[str, tuple[type, bool]]:
    """Each field's type, as (int | float | bool | str | a Choice, whether None is allowed)."""
    types = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint) if isinstance(hint, types_module.UnionType) else (hint,)
        kinds = [a for a in args if a is not type(None)]
        if name in {f.name for f in dataclasses.fields(cls)}:
            types[name] = (kinds[0], len(kinds) < len(args))
    return types


def check_values(config) -> None:
    """NaN and infinity pass every comparison-based check, so they are refused first, by flag; a choice field
    holds one of its choices (a value built outside build_configs may be its name)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"--{flag(f.name)} must be a finite number, got {value}")
        kind, _ = field_types(type(config))[f.name]
        if issubclass(kind, Choice) and value not in [c.value for c in kind]:
            raise ValueError(f"--{flag(f.name)} must be one of {', '.join(c.value for c in kind)}, got {value!r}")


def check_arch(c: GPTConfig) -> None:
    """The partial rotary, sliding-window and Gemma settings, each refused by its flag."""
    if c.rotary_dim is not None:
        if c.pos_encoding != "rope":
            raise ValueError(f"--rotary-dim is for --pos-encoding rope, got --pos-encoding {c.pos_encoding}")
        if not isinstance(c.rotary_dim, int) or not 0 < c.rotary_dim <= c.head_size or c.rotary_dim % 2:
            raise ValueError(
                f"--rotary-dim must be an even number from 2 to the head size ({c.head_size}), got {c.rotary_dim!r}"
            )
    if c.sliding_window is not None and (not isinstance(c.sliding_window, int) or c.sliding_window <= 0):
        raise ValueError(f"--sliding-window must be a positive integer, got {c.sliding_window!r}")
    if c.window_pattern is not None:
        if c.sliding_window is None:
            raise ValueError("--window-pattern needs --sliding-window, the window of its local layers")
        if not c.window_pattern or set(c.window_pattern) - {"L", "G"}:
            raise ValueError(f"--window-pattern must be letters L (local) and G (global), got {c.window_pattern!r}")
    if c.rope_local_theta is not None:
        if c.sliding_window is None or c.pos_encoding != "rope":
            raise ValueError("--rope-local-theta needs --sliding-window and RoPE: it is the RoPE base of local layers")
        if c.rope_local_theta <= 0:
            raise ValueError(f"--rope-local-theta must be positive, got {c.rope_local_theta:g}")
    if c.norm_offset and c.norm != "rmsnorm":
        raise ValueError("--norm-offset is a gain of RMSNorm: add --norm rmsnorm")


def show_value(value: Any) -> str:
    """A config value as a flag takes it, for messages: 0.0003, cosine, none."""
    if isinstance(value, float):
        return f"{value:g}"
    return "none" if value is None else str(value)


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


_NAMES = {int: "a whole number", float: "a number", bool: "true or false", str: "text"}


_SECONDS = {"s": 1, "m": 60, "h": 3600}


def parse_duration(value: Any) -> float:
    """A time as --max-time takes it: a number of seconds (600, 1.5) or a number with a unit, 90s, 20m, 2h."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip().lower()
    match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([smh]?)", text)
    if match is None:
        raise NanoGPTError(f"--max-time takes seconds or a time like 90s, 20m or 2h, got {value!r}")
    return float(match.group(1)) * _SECONDS[match.group(2) or "s"]


def parse_value(key: str, value: Any) -> Any:
    """A config-file (or saved config.json) value in its field's type: a whole number where a number is
    asked for becomes a float, a choice's name its Choice; the wrong type is refused, named by its flag.
    The CLI's options are parsed into these types already."""
    kind, optional = {**field_types(GPTConfig), **field_types(TrainConfig)}[key]
    if value is None and optional:
        return None
    if key == "max_time" and isinstance(value, str):  # a config file's "20m"
        return parse_duration(value)
    if issubclass(kind, Choice):
        if value not in [c.value for c in kind] or isinstance(value, bool):
            raise NanoGPTError(f"--{flag(key)} must be one of {', '.join(c.value for c in kind)}, got {value!r}")
        return kind(value)
    accepted = (int, float) if kind is float else (kind,)
    if not isinstance(value, accepted) or (isinstance(value, bool) and kind is not bool):
        raise NanoGPTError(f"--{flag(key)} must be {_NAMES[kind]}, got {value!r}")
    return kind(value)


def build_configs(values: dict[str, Any]) -> tuple[GPTConfig, TrainConfig]:
    """Both configs from merged values, each parsed into its field's type; a validation error becomes one
    NanoGPTError sentence."""
    model_kw, train_kw = split_values({k: parse_value(k, v) for k, v in values.items()})
    try:
        return GPTConfig(**model_kw), TrainConfig(**train_kw)
    except (ValueError, TypeError) as e:
        raise NanoGPTError(str(e)) from None


# --- what a consumer of a GPTConfig computes ----------------------------------------------------------------


class Takes(typing.NamedTuple):
    """The values of one GPTConfig field that a consumer computes: ok(value, config) and, for the refusal, what
    it takes in a few words (only() says it as the flags would)."""

    ok: Callable[[Any, GPTConfig], bool]
    says: str
    values: tuple | None = None  # only()'s values
    shows: Callable[[GPTConfig], str] | None = None  # the config in words where the field alone does not say it


ANY = Takes(lambda value, config: True, "any value")


def only(*values: Any) -> Takes:
    """Exactly these values."""
    return Takes(lambda value, config: value in values, " or ".join(show_value(v) for v in values), values)


def flag_value(name: str, value: Any) -> str:
    """A field's value as its flag is written: --qk-norm, --no-qk-norm, --norm rmsnorm."""
    if isinstance(value, bool):
        return f"--{flag(name)}" if value else f"--no-{flag(name)}"
    return f"--{flag(name)} {show_value(value)}"


@dataclass(frozen=True)
class Features:
    """What one consumer of a GPTConfig (a decode backend, a Hugging Face family) computes, declared for every
    field, each either ANY or the values it takes. tests/test_backends.py fails when a field is missing from any
    consumer's declaration, so a new field is looked at by each of them before it can reach one that would
    compute something else. `refusal` is the one sentence for a config it does not compute."""

    consumer: str  # who, for the sentence: "the cpu backend's fused step", "LlamaForCausalLM"
    takes: dict[str, Takes]

    def mismatches(self, c: GPTConfig) -> list[str]:
        """The fields whose value in c the consumer does not take, in declaration order."""
        return [name for name, takes in self.takes.items() if not takes.ok(getattr(c, name), c)]

    def needs(self, c: GPTConfig) -> str:
        """What c would have to change to, as flags: --norm rmsnorm --mlp swiglu."""
        out = []
        for name in self.mismatches(c):
            takes = self.takes[name]
            if takes.values is not None and len(takes.values) == 1:
                out.append(flag_value(name, takes.values[0]))
            elif takes.shows is not None:
                out.append(takes.says)
            else:
                out.append(f"--{flag(name)} {takes.says}")
        return out[0] if len(out) == 1 else ", ".join(out[:-1]) + " and " + out[-1]

    def refusal(self, c: GPTConfig) -> str | None:
        """Why the consumer does not compute c, naming every field it does not take, or None."""
        wrong = self.mismatches(c)
        if not wrong:
            return None
        shown = ", ".join(
            self.takes[name].shows(c) if self.takes[name].shows else flag_value(name, getattr(c, name))
            for name in wrong
        )
        return f"{self.consumer} does not compute {shown}: it needs {self.needs(c)}"

    def unclassified(self) -> list[str]:
        """GPTConfig's fields this declaration does not name."""
        return [f.name for f in dataclasses.fields(GPTConfig) if f.name not in self.takes]


def features(consumer: str, any_of: typing.Iterable[str], **takes: Takes) -> Features:
    """A declaration: the fields named in any_of take any value, the others what their Takes says."""
    return Features(consumer, {**dict.fromkeys(any_of, ANY), **takes})


EVERY_FIELD = tuple(f.name for f in dataclasses.fields(GPTConfig))  # for a consumer that computes every config
