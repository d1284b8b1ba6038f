"""Inference: sampling, and (with the inference-engine issue) prefill/decode programs and paged KV cache."""
