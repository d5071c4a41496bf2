"""The world a run trains in: one process (`World`, whose collectives return their input and whose `wrap`
returns the model unchanged) or the processes of a torchrun launch (`ProcessGroup`: DDP / FSDP2 wrappers, the
collectives the training loop needs, full (unsharded) states for rank 0 to save). The loop calls the same
methods on either and never asks how many processes there are; only the CLI (or a library caller) opens one.

    with distributed.open_world(cfg) as world:
        model = world.wrap(model, "fsdp", dtype)

World-size invariance: --gradient-accumulation-steps G counts micro-batches per update over all ranks. Every
rank draws all G from the one seeded stream and keeps its G / W (`micro_share`), and each rank's loss is
averaged over its own micro-batches; DDP and FSDP then average the gradients over the W ranks, so the update
is the mean over all G micro-batches, as in one process.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from nanogpt_cli.config import TrainConfig
from nanogpt_cli.device import resolve_device
from nanogpt_cli.errors import NanoGPTError

# A collective that waits this long means a rank is gone or stuck: fail rather than hang forever. Long enough
# for rank 0 to gather and save a checkpoint, or for one rank to finish torch.compile, while the others wait.
TIMEOUT = timedelta(minutes=15)


@dataclass(frozen=True)
class World:
    """One process: it is rank 0 of 1, it writes and prints, and every collective returns its input."""

    device: torch.device
    rank: int = 0  # this process among all of them, 0 .. size - 1
    local_rank: int = 0  # this process on its node: its GPU
    size: int = 1  # processes in all
    # how many updates apart the loop asks every rank whether a signal came (a collective that waits for the
    # device): every update in one process, where asking costs nothing; every log interval under torchrun
    stop_check_every: int | None = 1

    @property
    def main(self) -> bool:
        """Rank 0 writes the run folder and prints."""
        return self.rank == 0

    def describe(self, parallel: str) -> str:
        return str(self.device)

    def wrap(self, model: nn.Module, parallel: str, dtype: torch.dtype) -> nn.Module:
        """The model ready for training; optimizers are built on the result's parameters."""
        return model

    def seed_dropout(self, seed: int) -> None:
        """Each rank its own dropout masks, as its own batches (one process keeps torch's stream as it is)."""

    def micro_share(self, n_micro: int) -> range:
        """The micro-batches (indices into the G of one update) this process runs."""
        return range(n_micro)

    def eval_share(self, n_batches: int) -> tuple[list[int], int]:
        """The evaluation batches this process runs, and how many of them count."""
        return list(range(n_batches)), n_batches

    def gradient_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """Backward passes inside reduce the gradients over ranks only when enabled."""
        return contextlib.nullcontext()

    def mean_loss(self, losses: torch.Tensor, counted: int, n_batches: int) -> float:
        """The mean of all processes' evaluation losses, from this one's per-batch losses."""
        return losses.mean().item()

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def max_int(self, value: int) -> int:
        return value

    def from_main(self, values: list[float]) -> list[float]:
        """Rank 0's values, on every rank."""
        return values

    def barrier(self) -> None:
        pass

    def gather_objects(self, obj) -> list | None:
        """Every rank's obj in rank order; None in one process, where there is only this one."""
        return None

    def full_states(self, model: nn.Module, optimizer) -> tuple[dict | None, dict | None]:
        """The model's and the optimizer's whole states for rank 0 to save; None: the objects' own."""
        return None, None

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, sd: dict) -> None:
        optimizer.load_state_dict(sd)


@dataclass(frozen=True)
class ProcessGroup(World):
    """One process of a torchrun launch, in the process group that open_world joined."""

    stop_check_every: int | None = None  # the log interval

    def describe(self, parallel: str) -> str:
        return f"{self.size} x {self.device.type}, {parallel}"

    def wrap(self, model: nn.Module, parallel: str, dtype: torch.dtype) -> nn.Module:
        return wrap(model, parallel, self, dtype)

    def seed_dropout(self, seed: int) -> None:
        torch.manual_seed(seed + self.rank)

    def micro_share(self, n_micro: int) -> range:
        return micro_share(n_micro, self)

    def eval_share(self, n_batches: int) -> tuple[list[int], int]:
        return eval_share(n_batches, self)

    def gradient_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return gradient_sync(model, enabled)

    def mean_loss(self, losses: torch.Tensor, counted: int, n_batches: int) -> float:
        return mean_loss(losses, counted, n_batches)

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        return sum_all(t) / self.size

    def max_int(self, value: int) -> int:
        return max_int(value, self)

    def from_main(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.broadcast(t, src=0)
        return t.tolist()

    def barrier(self) -> None:
        dist.barrier()

    def gather_objects(self, obj) -> list:
        return gather_objects(obj, self)

    def full_states(self, model: nn.Module, optimizer) -> tuple[dict | None, dict | None]:
        return full_states(model, optimizer, self)

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, sd: dict) -> None:
        load_optimizer_state(model, optimizer, sd)


def launched_size() -> int:
    """How many processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@contextlib.contextmanager
def open_world(cfg: TrainConfig) -> Iterator[World]:
    """`with open_world(cfg) as world:` one process's World, or under torchrun this process's place in the
    process group, joined here and left on every way out. What the group cannot do is refused first, before
    any process waits for another."""
    n = launched_size()
    if n <= 1:
        yield World(resolve_device(cfg.device))
        return
    check_world(cfg, n)
    with process_group(cfg.device) as world:
        yield world


def from_main_before_joining(key: str, make: Callable[[], str]) -> str:
    """Under torchrun or --nproc, while planning (before the process group is joined): rank 0's make(), which the
    other ranks wait for, through the key-value store the launcher keeps for its processes."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise NanoGPTError(
            "this launcher keeps no store for its processes (torchrun and --nproc do): start them with torchrun, "
            "or give the values that need one process's figures"
        )
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, is_master=False, timeout=TIMEOUT)
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    key = f"nanogpt/{run}/{key}"  # the store outlives a restart: each attempt its own key
    if int(os.environ.get("RANK", "0")) == 0:
        store.set(key, make())
    return store.get(key).decode()  # a rank 0 that fails ends the launch, and this wait with it


def check_world(cfg: TrainConfig, size: int) -> None:
    """What a run of `size` processes cannot do, refused in one sentence (by the launcher, before any starts)."""
    if size <= 1:
        return
    per_rank(cfg.gradient_accumulation_steps, size)


def process_device(name: str) -> torch.device:
    """The device this process trains on: under torchrun its local rank's GPU (or the CPU), else --device's."""
    if launched_size() > 1:
        return rank_device(name, int(os.environ.get("LOCAL_RANK", "0")))
    return resolve_device(name)


def rank_device(name: str, local_rank: int) -> torch.device:
    """--device under torchrun: one GPU per local rank (cuda:LOCAL_RANK), or the CPU."""
    if name == "mps" or name.startswith("mps:"):
        raise NanoGPTError("--device mps runs one process; start it without --nproc or torchrun")
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda:"):
        raise NanoGPTError(
            f"--device {name}: with several processes each takes the GPU of its local rank; "
            "pass --device cuda (or auto)"
        )
    if name not in ("auto", "cuda"):
        raise NanoGPTError(f"--device {name!r} is not a device; use auto, cpu or cuda with several processes")
    if not torch.cuda.is_available():
        if name == "cuda":
            raise NanoGPTError("--device cuda was asked for, but this torch sees no CUDA GPU; use --device cpu")
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise NanoGPTError(
            f"local rank {local_rank} has no GPU: this node sees {torch.cuda.device_count()}; "
            "start at most that many processes per node (--nproc_per_node)"
        )
    return torch.device("cuda", local_rank)


@contextlib.contextmanager
def process_group(device_name: str) -> Iterator[World]:
    """Join the process group torchrun describes in the environment (nccl on CUDA, gloo on CPU) and leave it
    on every way out. A normal exit first waits for every rank, so that no process ends (and has torchrun
    stop the others) while rank 0 still writes or prints."""
    rank, local_rank, size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    device = rank_device(device_name, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=TIMEOUT, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=TIMEOUT)
    try:
        yield ProcessGroup(device, rank, local_rank, size)
        dist.barrier()
        # from here on each rank only tears down and exits; after a stop with a non-zero exit, the first rank
        # out makes torchrun SIGTERM the rest: let them finish their exit (and status) instead of dying in it
        with contextlib.suppress(ValueError):  # ValueError: not the main thread
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    finally:
        gc.collect()  # the wrapped model's cycles hold on to the group's work objects: free them while it lives
        dist.destroy_process_group()


# --- dealing out the work ---


def per_rank(n_micro: int, size: int) -> int:
    """Micro-batches per rank for --gradient-accumulation-steps n_micro, or the one-sentence refusal."""
    if n_micro % size != 0:
        raise NanoGPTError(
            f"--gradient-accumulation-steps ({n_micro}) counts micro-batches over all processes and "
            f"must be divisible by the number of processes ({size})"
        )
    return n_micro // size


def micro_share(n_micro: int, world: World) -> range:
    """The micro-batches (indices into the global G of one update) this rank runs: a contiguous G / W."""
    per = per_rank(n_micro, world.size)
    return range(world.rank * per, (world.rank + 1) * per)


def eval_share(n_batches: int, world: World) -> tuple[list[int], int]:
    """The evaluation batches this rank runs (strided) and how many of them count. Every rank makes the same
    number of forward passes, as FSDP gathers the weights in each one with every rank taking part: a rank
    short of batches repeats its first, uncounted."""
    mine = list(range(world.rank, n_batches, world.size))
    passes = -(-n_batches // world.size)
    return mine + [mine[0] if mine else 0] * (passes - len(mine)), len(mine)


def eval_prefix(mine: list, n_batches: int, world: World) -> tuple[list, int]:
    """This rank's share of the first n_batches evaluation batches, from its share of more of them (`mine`, as
    eval_share ordered them: a prefix of the strided indices, then repeats), padded as eval_share pads; and how many
    count."""
    passes, counted = -(-n_batches // world.size), len(range(world.rank, n_batches, world.size))
    return mine[:counted] + mine[:1] * (passes - counted), counted


def mean_loss(losses: torch.Tensor, counted: int, n_batches: int) -> float:
    """The mean over all ranks' evaluation batches, from this rank's per-batch losses (the first `counted`
    count), summed in float64 so the order of the ranks does not show."""
    return (sum_all(losses[:counted].double().sum()) / n_batches).item()


# --- wrapping the model ---


def wrap(model: nn.Module, parallel: str, world: World, dtype: torch.dtype) -> nn.Module:
    """The model ready for data-parallel training; it must already sit on world.device, identical on every rank
    (same seed, or the same weights loaded). Optimizers are built on the result's parameters."""
    if parallel == "ddp":
        import inspect

        from torch.nn.parallel import DistributedDataParallel as DDP

        # our buffers are fixed position tables: broadcasting them in every forward is wasted work, and a
        # broadcast in a forward that only some ranks run (an evaluation) would deadlock (the flag was renamed)
        renamed = "forward_sync_buffers" in inspect.signature(DDP).parameters
        no_buffer_sync = {"forward_sync_buffers": False} if renamed else {"broadcast_buffers": False}
        return DDP(model, device_ids=[world.device.index] if world.device.type == "cuda" else None, **no_buffer_sync)
    assert parallel == "fsdp", parallel  # TrainConfig checked it
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        raise NanoGPTError(
            f"--parallel fsdp needs torch 2.6 or newer (FSDP2); this is {torch.__version__}: "
            "upgrade torch or use --parallel ddp"
        ) from None

    if dtype == torch.float16:
        raise NanoGPTError(
            "--parallel fsdp trains in bfloat16 or float32; float16 needs a sharded grad scaler "
            "this trainer does not have; use --dtype bfloat16"
        )
    # an explicit mesh: the default one follows torch.cuda when a GPU is visible, even for a CPU run
    mesh = init_device_mesh(world.device.type, (world.size,))
    # on CUDA bf16 weights in the forward and backward, gradients reduced and kept in fp32; the autocast
    # around the forward still picks each op's precision as in one process
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if world.device.type == "cuda" and dtype == torch.bfloat16
        else MixedPrecisionPolicy()
    )
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # the rest: embeddings, final norm, LM head
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The GPT inside a DDP wrapper (FSDP2 shards the module in place: it is its own inside)."""
    return getattr(model, "module", model)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Backward passes inside skip the gradient all-reduce when not enabled: the non-last micro-batches of an
    accumulation only add to the local gradients, which the last one then reduces once."""
    if is_ddp(model):
        with contextlib.nullcontext() if enabled else model.no_sync():
            yield
    else:  # FSDP2
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


# --- collectives ---


def max_int(value: int, world: World) -> int:
    """The largest of every rank's value, on every rank: a stop flag one rank raised stops them all."""
    t = torch.tensor([value], dtype=torch.int64, device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def sum_all(t: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of a tensor (a copy; every rank gets it)."""
    t = t.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def gather_objects(obj, world: World) -> list:
    """Every rank's obj (a small picklable value: an RNG state), in rank order, on every rank."""
    out: list = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


# --- full states for the checkpoint files ---


def _full(cpu_offload: bool = True):
    """Options for torch's state-dict helpers: whole (unsharded) states, on rank 0's CPU when offloaded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)


def is_ddp(model: nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def full_states(model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> tuple[dict | None, dict | None]:
    """The model's and the optimizer's whole states for rank 0 to save, laid out as in one process; {} on the
    other ranks. Every rank must call it (FSDP gathers the shards, into new tensors on rank 0's CPU that the
    save keeps without copying them again). With DDP every rank holds all of it already: both are then None,
    meaning the objects' own (the optimizer may be several, Muon's), which a background save copies."""
    if is_ddp(model):
        return None, None
    return full_model_state(model), full_optimizer_state(model, optimizer)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict, unsharded, on rank 0's CPU (the other ranks get {}); every rank must
    call it. Keys as in the unwrapped GPT's state_dict()."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full())


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The parameter names in the optimizer's order: position i is parameter i of optimizer.state_dict()."""
    names = {id(p): name for name, p in unwrap(model).named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's whole state, unsharded, on rank 0's CPU, in the layout of optimizer.state_dict() of one
    process (parameters by position), so that the optimizer file does not depend on the world size. The
    other ranks get {}; every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if not optimizer.state:  # before the first step; the helper would take a step (lr 0) to make some state,
        return optimizer.state_dict() if dist.get_rank() == 0 else {}  # and AdamW's step count would be off by one
    sd = get_optimizer_state_dict(model, optimizer, options=_full())
    if not sd:
        return {}
    index = {name: i for i, name in enumerate(_param_names(model, optimizer))}
    return {
        "state": {index[name]: state for name, state in sd["state"].items()},
        "param_groups": [dict(g, params=[index[name] for name in g["params"]]) for g in sd["param_groups"]],
    }


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, sd: dict) -> None:
    """Load a one-process optimizer.state_dict() (parameters by position) into the optimizer of a wrapped
    model, on any world size; every rank passes the whole state (FSDP keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if is_ddp(model) or not sd["state"]:  # not sharded, or saved before the first step: nothing to shard
        optimizer.load_state_dict(sd)
        return
    names = _param_names(model, optimizer)
    by_name = {
        "state": {names[i]: state for i, state in sd["state"].items()},
        "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in sd["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=_full(cpu_offload=False))
