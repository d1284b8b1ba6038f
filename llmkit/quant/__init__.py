"""Weight-only quantization: int8 per output channel, int4 in groups; RTN and GPTQ (docs/quantize.md).

::

    model = LlamaForCausalLM.from_pretrained("runs/tiny/checkpoints/step-00000600/model")
    quantize_model(model, QuantConfig(bits=4, group_size=128, method="gptq"), calib_ids)
    model.save_pretrained("tiny-int4")       # config.json carries quantization_config
    LlamaForCausalLM.from_pretrained("tiny-int4")   # QuantizedLinear layers; exports and serves as is
"""

from __future__ import annotations

from .evaluate import EvalError, eval_tokens, evaluate
from .format import QuantConfig, QuantError, QuantizedWeight, pack, quantize_rtn, unpack
from .gptq import Hessian, gptq
from .quantize import install, quantize_model, save_quantized, set_act_bits, targets, weight_bytes

__all__ = [
    "EvalError",
    "Hessian",
    "QuantConfig",
    "QuantError",
    "QuantizedWeight",
    "eval_tokens",
    "evaluate",
    "gptq",
    "install",
    "pack",
    "quantize_model",
    "quantize_rtn",
    "save_quantized",
    "set_act_bits",
    "targets",
    "unpack",
    "weight_bytes",
]
