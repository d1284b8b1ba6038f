"""The ``llmkit`` command line: ``llmkit <command> [args]``.

Commands are a table from name to (one-line help, "module:function"); a command's module is
imported only when it runs, and the function parses its own arguments (``llmkit train --help``).
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train a Llama model from a YAML config", "llmkit.train.cli:main"),
    "plan": (
        "pick the fastest parallel plan that fits: llmkit plan CFG --world N --mem-gb M [--gpu H100]",
        "llmkit.train.auto_plan:plan_main",
    ),
    "generate": ("generate text from a trained model", "llmkit.generate:main"),
    "tokenizer": (
        "train a sentencepiece tokenizer (llmkit tokenizer train ...)",
        "llmkit.train.cli:tokenizer_main",
    ),
    "rlhf": (
        "align a model: GRPO, PPO, RLOO, DPO (llmkit rlhf reward: a reward model)",
        "llmkit.rlhf.cli:main",
    ),
    "plot": (
        "plot runs to PNG (training loss, RLHF reward and KL, quantization's perplexity)",
        "llmkit.train.cli:plot_main",
    ),
    "checkpoint": (
        "merge a checkpoint written by several processes, or a LoRA run's adapters into its base",
        "llmkit.train.cli:checkpoint_main",
    ),
    "quantize": (
        "quantize a model's weights to int8 or int4 (GPTQ or RTN)",
        "llmkit.quant.cli:quantize_main",
    ),
    "eval": ("perplexity of a model on held-out text", "llmkit.quant.cli:eval_main"),
    "export": ("write the static model file a server runs", "llmkit.serve.export:main"),
    "serve": ("serve a static model file over an OpenAI-compatible HTTP API", "llmkit.serve.server:main"),
}


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's input being wrong: printed as one line, no traceback."""
    errors: list[type[BaseException]] = [FileNotFoundError, NotADirectoryError, IsADirectoryError]
    for mod, name in [
        ("llmkit.framework.opspec", "OpError"),
        ("llmkit.framework.serialization", "SafetensorsError"),
        ("llmkit.train.config", "ConfigError"),
        ("llmkit.framework.distributed.parallel_plan", "PlanError"),
        ("llmkit.train.data", "DataError"),
        ("llmkit.train.checkpoint", "ResumeError"),
        ("llmkit.train.plot", "PlotError"),
        ("llmkit.rlhf.rewards", "RewardError"),
        ("llmkit.models.llama.config", "LlamaConfigError"),
        ("llmkit.models.llama.checkpoint", "CheckpointError"),
        ("llmkit.models.llama.lora", "LoraError"),
        ("llmkit.tokenizer", "TokenizerError"),
        ("llmkit.framework.jit", "FormatError"),
        ("llmkit.serve.export", "ExportError"),
        ("llmkit.infer.engine", "EngineConfigError"),
        ("llmkit.quant.format", "QuantError"),
        ("llmkit.quant.evaluate", "EvalError"),
    ]:
        m = sys.modules.get(mod)
        if m is not None and hasattr(m, name):
            errors.append(getattr(m, name))
    return tuple(errors)


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: llmkit <command> [args]   (llmkit <command> --help for its options)", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (help_, _) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        from llmkit import __version__

        print(f"llmkit {__version__}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        hint = difflib.get_close_matches(name, COMMANDS, 1)
        print(
            f"llmkit: unknown command {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else ""),
            file=sys.stderr,
        )
        print(usage(), file=sys.stderr)
        return 2
    module, func = COMMANDS[name][1].split(":")
    fn = getattr(importlib.import_module(module), func)
    try:
        return int(fn(argv[1:]) or 0)
    except KeyboardInterrupt:
        print("llmkit: interrupted", file=sys.stderr)
        return 130
    except _user_errors() as e:
        if os.environ.get("LLMKIT_DEBUG"):
            raise
        print(f"llmkit {name}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
