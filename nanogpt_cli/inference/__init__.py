"""Using a trained model: the decode engine and the thin layers that generate, chat and score with it.

    sampler = Sampler.load("checkpoints/shk"); results = sampler.generate_many(["ROMEO:"], SampleSettings())

- engine.py: the KV cache with a position per row, the decode step, logits processing, the token loop
- sample.py: prompts -> text, one or many, streamed; chat.py: a conversation turned into prompts
- evaluate.py: loss, perplexity and bits per byte of a split or of texts
- loglikelihood.py: log-probabilities of continuations after contexts, each context run once for its choices
- lm_eval_model.py: the model as an lm-evaluation-harness model (`nanogpt`); tasks.py: running lm-eval's tasks

May import: the top-level modules, data/, runs/ and interop/. Never training/, serve/, inspect/ or cli/.
"""
