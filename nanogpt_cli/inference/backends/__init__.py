"""How a decode step is computed: our x86 kernels (native.py, native.cpp), the decoding form of the model's
operations (decode.py), weight-only quantization (quantize.py) and the per-model cache of those forms
(form_cache.py).

May import: the top-level modules (model, config, errors). Never the rest of inference/, nor any other folder.
"""
