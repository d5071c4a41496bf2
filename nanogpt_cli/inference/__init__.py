"""Using a trained model: the decode engine and the thin layers that generate, chat and score with it.

    sampler = Sampler.load("checkpoints/shk"); results = sampler.generate_many(["ROMEO:"], SampleSettings())

- engine.py: the KV cache with a position per row, logits processing, the token loop
- backends/: how a prefill and a decode step are computed, behind one interface: torch (the model's own forward)
  and cpu (our kernels); the engine takes the first that supports the model
- sample.py: prompts -> text, one or many, streamed; chat.py: a conversation turned into prompts
- evaluate.py: loss, perplexity and bits per byte of a split or of texts
- loglikelihood.py: log-probabilities of continuations after contexts, each context run once for its choices
- lm_eval_model.py: the model as an lm-evaluation-harness model (`nanogpt`); tasks.py: running lm-eval's tasks

May import: the top-level modules, data/, runs/ and interop/. Never training/, serve/, inspect/ or cli/.
"""
