"""PIR: llmkit's intermediate representation (see ``DESIGN.md``, "PIR").

``from llmkit.framework import ir``::

    p = ir.parse(text)                 # -> Program (raises ir.ParseError with line:column)
    print(p)                           # the text form; parse(str(p)) prints the same text
    p.verify()                         # raises ir.VerifyError naming the op
    ir.PassManager(["canonicalize", "cse", "dce"]).run(p)
    outs = ir.interpret(p, x, w)       # numpy in, numpy out (op-table reference kernels)

Building programs (what the tracer does)::

    p = ir.Program()
    f = p.add_function("main", [("x", ir.TensorType(["B", 64], "float32"))])
    b = ir.Builder.at_end(f.body)
    y = b.llm.exp(f.args[0])           # or b.create("llm.exp", [x], attrs) -> Operation
    b.ret(y)

Map of the package, bottom up (no module imports one above it): ``errors``, ``lexer``,
``attributes`` (values of the IR and their text form; types are ``framework/types.py``),
``printer`` (the text form), ``opdef`` (interfaces, the dialect registry; traits are
``opspec.Trait``), ``core`` (Value, Operation, Block, Region), ``dialects/`` (builtin, llm, cinn,
dist), ``builder``, ``verifier``, ``program``, ``text_parser`` / ``parser``, ``interpreter``
(with ``run_group``, every unfused group's fallback), ``rewriter`` (PatternRewriter and the
worklist driver), ``drr`` (declarative rules), ``pass_manager`` and ``passes/`` (dce, cse,
fold-constants, canonicalize, simplify-shapes, fuse-patterns).
"""

from __future__ import annotations

from ..opspec import Trait
from ..types import ScalarType, TensorType, Type
from . import (  # passes register themselves with pass_manager (dialects with opdef, below)
    drr,
    passes,
)
from .attributes import (
    ArrayAttr,
    Attribute,
    BoolAttr,
    DenseAttr,
    DictAttr,
    DimAttr,
    DTypeAttr,
    FloatAttr,
    IntAttr,
    MeshAttr,
    NoneAttr,
    OpaqueAttr,
    PlacementAttr,
    ShapeAttr,
    StrAttr,
    to_attr,
)
from .builder import Builder
from .core import Block, BlockArgument, Operation, OpResult, Region, Value, paused_gc
from .dialects.builtin import ConstantOp, FuncOp, ModuleOp, ReturnOp
from .dialects.cinn import FusionOp
from .dialects.llm import LlmOp, op_class
from .errors import IRError, ParseError, VerifyError
from .interpreter import InterpretError, interpret
from .opdef import Dialect, Interface, OpDef, OpView, dialects, lookup
from .parser import parse
from .pass_manager import Pass, PassManager, make_pass, register_pass, registered_passes
from .program import Program
from .rewriter import PatternRewriter, RewritePattern, apply_patterns, pattern
from .verifier import verify

__all__ = [
    "ArrayAttr",
    "Attribute",
    "Block",
    "BlockArgument",
    "BoolAttr",
    "Builder",
    "ConstantOp",
    "DTypeAttr",
    "DenseAttr",
    "Dialect",
    "DictAttr",
    "DimAttr",
    "FloatAttr",
    "FuncOp",
    "FusionOp",
    "IRError",
    "IntAttr",
    "Interface",
    "InterpretError",
    "LlmOp",
    "MeshAttr",
    "ModuleOp",
    "NoneAttr",
    "OpDef",
    "OpResult",
    "OpView",
    "OpaqueAttr",
    "Operation",
    "ParseError",
    "Pass",
    "PassManager",
    "PatternRewriter",
    "PlacementAttr",
    "Program",
    "Region",
    "ReturnOp",
    "RewritePattern",
    "ScalarType",
    "ShapeAttr",
    "StrAttr",
    "TensorType",
    "Trait",
    "Type",
    "Value",
    "VerifyError",
    "apply_patterns",
    "dialects",
    "drr",
    "interpret",
    "lookup",
    "make_pass",
    "op_class",
    "parse",
    "passes",
    "pattern",
    "paused_gc",
    "register_pass",
    "registered_passes",
    "to_attr",
    "verify",
]
