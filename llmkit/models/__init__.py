"""Model families: each package holds its config, layers, checkpoint io and tokenizer."""
