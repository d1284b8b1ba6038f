"""llmkit: train, align, quantize and serve Llama models; every job runs the same static program."""

__version__ = "0.1.0"
