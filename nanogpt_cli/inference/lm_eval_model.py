"""Our model as an lm-evaluation-harness model, registered as `nanogpt`: lm_eval.simple_evaluate scores it on any task.

    lm = NanoGPTLM("checkpoints/shk", batch_size=32)    # any source the commands load, or an InferenceModel
    results = lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"], limit=100)

The three requests a task makes, on our own code:
- loglikelihood (multiple choice): loglikelihood.score_continuations, each context run once for all its choices;
- loglikelihood_rolling (perplexity tasks): evaluate.score_tokens, the sliding window of `eval perplexity`, over
  the end-of-text token and the document (a tokenizer without that token: the document alone, its first token
  unscored, exactly what `eval perplexity --input` scores);
- generate_until: the engine's batched decoding through inference/sample.py, with each request's stop texts and
  token limit (greedy unless the task samples).

Text becomes tokens as lm-eval's `hf` backend makes them: a context's trailing spaces move to the continuation, a
pair is encoded whole and split at the context's length, and the end-of-text marker in a text is the end-of-text
token. Importing this module needs lm-eval (the `eval` extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nanogpt_cli.config import Dtype
from nanogpt_cli.data.chat_template import EOT, ChatTemplate, encode, specials
from nanogpt_cli.errors import NanoGPTError, require
from nanogpt_cli.inference.evaluate import score_tokens
from nanogpt_cli.inference.loglikelihood import score_continuations
from nanogpt_cli.inference.sample import Sampler, SampleSettings
from nanogpt_cli.interop.loading import InferenceModel, load_for_inference

_model = require("lm_eval.api.model", "eval", "scoring lm-eval tasks", package="lm-eval")
_registry = require("lm_eval.api.registry", "eval", "scoring lm-eval tasks", package="lm-eval")

# the task's generation settings this backend follows; lm-eval normalises max_new_tokens & co. to max_gen_toks
GEN_KEYS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty"}
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default, as its `hf` backend has it
# batch_size None (or lm-eval's "auto"): each request's rows chosen so that what they hold stays within BATCH_BYTES
# beside the weights, MAX_ROWS at most. A generating row holds keys and values for the model's whole context
# (SmolLM2-135M's 8,192 tokens: 377 MB in float32, so 20 rows took 8.8 GB); a scored row, its activations and,
# rolling, its logits over the vocabulary.
BATCH_BYTES = 2 << 30
MAX_ROWS = 32


@_registry.register_model("nanogpt")
class NanoGPTLM(_model.TemplateLM):
    """lm-eval's model interface on a loaded nanogpt model. pretrained: a run folder, .safetensors, Hugging Face
    folder, hf:NAME or .gguf (what `--model_args pretrained=...` names), or an InferenceModel already loaded, then
    `source` says where from (the results record it; a Hugging Face folder's chat template is read there).
    batch_size: rows per forward; stride: tokens between the rolling windows (default: eval perplexity's, half the
    context); seed: sampling's, for tasks that sample; quantize, group_size: int8 or int4 weights for the blocks
    (`--quantize`, `--int4-group`; load_for_inference). batch_size None or "auto": chosen by memory (BATCH_BYTES)."""

    def __init__(
        self,
        pretrained: str | Path | InferenceModel,
        last: bool = False,
        device: str | None = "auto",
        dtype: str = "float32",
        batch_size: int | str | None = None,
        stride: int | None = None,
        seed: int = 1234,
        source: str | None = None,
        max_batch_size: int | None = None,  # lm-eval hands it to every model; it sizes `auto` batches only
        quantize: str | None = None,
        group_size: int | str = 32,
        **unknown: Any,
    ):
        super().__init__()
        if unknown:
            raise NanoGPTError(f"the nanogpt model takes no argument {', '.join(sorted(unknown))}")
        if batch_size == "auto":
            batch_size = None
        if batch_size is not None and (not str(batch_size).isdigit() or int(batch_size) < 1):
            raise NanoGPTError(f"--batch-size must be a whole number of rows, at least 1, got {batch_size!r}")
        if isinstance(pretrained, InferenceModel):
            self.loaded, self.source = pretrained, source
        else:
            self.source = str(pretrained)
            if not str(group_size).isdigit():
                raise NanoGPTError(f"--int4-group (group_size=) must be a whole number of inputs, got {group_size!r}")
            self.loaded = load_for_inference(
                pretrained,
                last=bool(last),
                device=device or "auto",
                dtype=Dtype(dtype),
                quantize=quantize,
                group_size=int(group_size),
            )
        self.batch_size = int(batch_size) if batch_size is not None else None  # None: rows chosen by memory
        self.stride, self.seed = stride, int(seed)
        self.tokenizer = self.loaded.tokenizer
        self._device = self.loaded.device
        self._template: ChatTemplate | None = None

    @property
    def model(self):
        return self.loaded.model

    @property
    def eot_token_id(self) -> int | None:
        return self.tokenizer.eot_id

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def max_length(self) -> int:
        return self.loaded.block_size

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.describe().get("name", "")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return encode(string, self.tokenizer)  # "<|endoftext|>" in a text is the token, as transformers reads it

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    # --- rows by memory ---

    def rows(self, per_row: float) -> int:
        """Rows of a forward: batch_size, else as many rows of per_row bytes as BATCH_BYTES holds (1 to MAX_ROWS)."""
        if self.batch_size is not None:
            return self.batch_size
        return max(1, min(MAX_ROWS, int(BATCH_BYTES // max(per_row, 1))))

    def row_bytes(self, tokens: int, kind: str) -> float:
        """About what a row of `tokens` tokens holds while it runs: its activations (the widest of a block: the
        MLP's hidden layer beside the residual; attention runs in torch's fused kernel), and for `generate` the keys
        and values of the model's whole context (the engine's cache), for `context` those of its tokens in every
        layer (the contexts' pass of loglikelihood), for `rolling` its logits (float32, and the loss's copy)."""
        cfg = self.model.config
        size = self.model.transformer.wte.weight.element_size()
        held = 4 * cfg.n_embd + 3 * cfg.hidden_size
        if kind == "generate":
            return size * (tokens * held + cfg.kv_values_per_token * cfg.block_size)
        if kind == "context":
            return size * tokens * (held + 2 * cfg.kv_heads * cfg.head_size * cfg.n_layer)
        return size * tokens * held + 4 * 2 * tokens * cfg.vocab_size  # rolling

    # --- the three requests ---

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        if self.eot_token_id is None and any(r.args[0] == "" for r in requests):
            raise NanoGPTError(
                f"the task scores texts without a context, and the {self.tokenizer_name} tokenizer has no "
                "end-of-text token to start them from"
            )
        return super().loglikelihood(requests, disable_tqdm=True)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = [(context, continuation) for _, context, continuation in requests]
        longest = min(max((len(c) + len(k) for c, k in pairs), default=1), self.max_length + 1)
        out = score_continuations(self.model, pairs, self.rows(self.row_bytes(longest, "context")), self.vocab_size)
        for (key, _, _), answer in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for request in requests:
            (text,) = request.args
            ids = self.tok_encode(text)
            tokens = ids if self.eot_token_id is None else [self.eot_token_id, *ids]
            rows = self.rows(self.row_bytes(min(len(tokens), self.max_length), "rolling"))
            nll, _ = score_tokens(self.model, tokens, self.stride, rows, vocab_size=self.vocab_size)
            out.append(-nll)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), -nll)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests with the same generation settings are decoded together, longest prompts first (prompts of
        one length share their prefill), batch_size rows at a time (or as many as memory allows: rows)."""
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        sampler = Sampler(self.loaded)
        for members in groups.values():
            settings = self._settings(requests[members[0]].args[1])
            prompts = {i: self._prompt(requests[i].args[0], settings.max_new_tokens) for i in members}
            order = sorted(members, key=lambda i: len(prompts[i]), reverse=True)
            rows = self.rows(self.row_bytes(len(prompts[order[0]]), "generate"))
            for start in range(0, len(order), rows):
                part = order[start : start + rows]
                for i, result in zip(part, sampler.generate_many([prompts[i] for i in part], settings)):
                    out[i] = result.text
                    self.cache_hook.add_partial("generate_until", requests[i].args, result.text)
        return out

    def _settings(self, gen_kwargs: dict) -> SampleSettings:
        """A task's generation settings (lm-eval's keys) as ours: greedy unless it samples with a temperature."""
        from lm_eval.models.utils import normalize_gen_kwargs

        kwargs = dict(normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS))
        if kwargs.get("num_beams", 1) == 1:
            kwargs.pop("num_beams", None)
        unknown = sorted(set(kwargs) - GEN_KEYS)
        if unknown:
            raise NanoGPTError(
                "the task asks for generation settings nanogpt's engine does not have: "
                + ", ".join(f"{k}={kwargs[k]!r}" for k in unknown)
            )
        until = kwargs["until"]
        stop = [until] if isinstance(until, str) else [s for s in until if s]
        sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature") or 0.0) > 0
        return SampleSettings(
            max_new_tokens=int(kwargs["max_gen_toks"]),
            temperature=float(kwargs["temperature"]) if sample else 0.0,
            top_k=int(kwargs.get("top_k") or 0) if sample else None,
            top_p=float(kwargs.get("top_p") or 1.0) if sample else 1.0,
            min_p=float(kwargs.get("min_p") or 0.0) if sample else 0.0,
            repetition_penalty=float(kwargs.get("repetition_penalty") or 1.0),
            seed=self.seed,
            stop=stop,
        )

    def _prompt(self, context: str, max_new_tokens: int) -> list[int]:
        """The context's token ids, cut from the left to leave room for the answer in the window, as the `hf`
        backend cuts them; where that would leave under half the window, the last half (the engine's window then
        slides on as the answer grows). An empty context starts from the end-of-text token."""
        ids = self.tok_encode(context) if context else []
        if not ids:
            if self.eot_token_id is None:
                raise NanoGPTError(
                    f"the task generates from an empty prompt, and the {self.tokenizer_name} tokenizer has no "
                    "end-of-text token to start from"
                )
            ids = [self.eot_token_id]
        keep = max(self.max_length - max_new_tokens, self.max_length // 2, 1)
        return ids[-keep:]

    # --- chat templates and what the results record ---

    @property
    def template(self) -> ChatTemplate:
        """The model's own chat template, or the plain User:/Assistant: transcript of a base model."""
        if self._template is None:
            meta, tokenizer = self.loaded.meta, self.tokenizer
            if self.source is None:
                eos = EOT if tokenizer.eot_id is not None else None
                self._template = ChatTemplate.for_meta(meta, eos, special=specials(tokenizer) or None)
            else:
                where = self.loaded.source.location if self.loaded.source is not None else self.source
                self._template = ChatTemplate.for_model(meta, tokenizer, where)
        return self._template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.template.render(chat_history, add_generation_prompt)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.template.source if chat_template else None

    def get_model_info(self) -> dict[str, Any]:
        return {
            "model_source": self.source,
            "model_num_parameters": self.model.num_params(non_embedding=False),
            "model_dtype": str(self.loaded.dtype),
        }
