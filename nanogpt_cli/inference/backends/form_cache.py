"""One decoding form per model (the engine's DecodePlan: packed and transposed weight copies), kept on the model
and reused by every engine built on it while its weights are unchanged, so a chat reply or an eval batch does not
repack the weights nor hold a second copy of them per engine.

    plan = cached_form(model, lambda: build(model), vocab_size)     # built again only after a change

A change is any of: a parameter, buffer or submodule replaced (quantization, LoRA layers merged or swapped), its
data moved or cast (Module.to), an in-place write to a parameter or buffer (copy_, load_state_dict, foreach
optimizers: each bumps the tensor's version counter), a step of any torch optimizer (counted by a hook on every
optimizer, installed with the first form: the fused AdamW kernels write the parameters without bumping their
counters; before any form exists no step needs counting), the training mode, or the extra values
the caller keys on. In-place writes through `.data` or to inference tensors are not seen: a model holding
inference tensors is never cached.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

ATTRIBUTE = "_decode_form"  # where the model keeps its FormCache
STEPS = [0]  # optimizer steps taken in this process since the first form was built (count_step)
HOOK: list = []  # the optimizer hook's handle, once a form has been built


def count_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """After every optimizer step: any cached form may now hold old weights."""
    STEPS[0] += 1


def count_steps() -> None:
    """Count optimizer steps from now on: called before the first form is built, never on import, so a process
    that only trains carries no hook of ours."""
    if not HOOK:
        HOOK.append(register_optimizer_step_post_hook(count_step))


class FormCache:
    """The last form built for a model and the state it was built from. Copies of the model (deepcopy, pickle)
    start empty: the form's tensors belong to the original's weights."""

    def __init__(self):
        self.refs: list[weakref.ref] = []  # the modules and tensors, by weak reference: an id could be reused
        self.versions: tuple = ()  # each tensor's version counter, storage, dtype and shape when the form was built
        self.extra: tuple = ()  # the optimizer steps, the training mode, the quantization and the caller's values
        self.value: Any = None  # the form itself

    def __deepcopy__(self, memo: dict) -> FormCache:
        return FormCache()

    def __reduce__(self):
        return (FormCache, ())

    def matches(self, objects: list, versions: tuple, extra: tuple) -> bool:
        """Whether the form was built from exactly these objects at these versions."""
        if self.value is None or extra != self.extra or versions != self.versions or len(objects) != len(self.refs):
            return False
        return all(ref() is obj for ref, obj in zip(self.refs, objects))


def model_state(model: nn.Module) -> tuple[list, tuple] | None:
    """Every submodule, parameter and buffer of the model and what each tensor is now (version counter, storage,
    dtype, shape); None where a tensor keeps no counter (an inference tensor), whose writes could not be seen."""
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_inference() for t in tensors):
        return None
    # the storage's address and dtype as well: Module.to() and `p.data = ...` swap a parameter's data in place,
    # keeping its identity and version counter
    return [*model.modules(), *tensors], tuple((t._version, t.data_ptr(), t.dtype, t.shape) for t in tensors)


def cached_form(model: nn.Module, build: Callable[[], Any], *extra: Any) -> Any:
    """build()'s result for the model's current state: the one built before where nothing has changed since
    (module docstring), else a new one, which replaces it. extra: further values the form depends on."""
    state = model_state(model)
    if state is None:
        return build()
    count_steps()
    objects, versions = state
    quantized = getattr(model, "quantized", None), getattr(model, "quant_group_size", None)
    key = (STEPS[0], model.training, *quantized, *extra)
    cache = model.__dict__.get(ATTRIBUTE)
    if cache is None:
        cache = FormCache()
        object.__setattr__(model, ATTRIBUTE, cache)  # a plain attribute: not in state_dict, not a submodule
    if cache.matches(objects, versions, key):
        return cache.value
    cache.value = None  # the old form let go before the new one is built: never two at once
    with torch.no_grad():
        value = build()
    cache.refs, cache.versions, cache.extra, cache.value = [weakref.ref(o) for o in objects], versions, key, value
    return value
