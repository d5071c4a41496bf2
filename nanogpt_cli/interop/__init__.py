"""Models in and out: load any source the tool reads, and write the formats other tools read.

    loaded = load_for_inference("checkpoints/shk"); export("checkpoints/shk", "hf", Path("exports/shk"))

- hf.py: the one name mapping between our GPT and Hugging Face architectures (GPT-2, Llama, GPT-NeoX)
- gguf_file.py: GGUF files, written for llama.cpp and read back
- gguf_pre.py: llama.cpp's pre-tokenizer names and the cut each makes, as a tokenizer.json's pre-tokenizers
- source.py: what a source names (run folder, .safetensors, LoRA run, Hugging Face folder or hf:NAME, .gguf), parsed
  once into a typed value
- loading.py: any parsed source -> a model, dispatched on its type
- materialize.py: a model built on the meta device and filled a tensor at a time, cast and quantized as it goes
- export.py: Hugging Face folders, GGUF files and PEFT adapters from a run

May import: the top-level modules, data/ and runs/. Never training/, inference/, serve/, inspect/ or cli/.
"""
