"""Training recipe of the embedded demo model (issue 8): corpus, tokenizer, packed ids,
MLX training with a jointly trained MTP head, GGUF export and a report.

Run `python -m tools.demo_model --help` from the repository root.
"""
