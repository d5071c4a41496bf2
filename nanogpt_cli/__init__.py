"""nanogpt: prepare text, train a small GPT, sample from it and evaluate it.

nanogpt prepare examples/tinyshakespeare.txt --name shakespeare-char --tokenizer char
"""

__version__ = "0.1.0"
