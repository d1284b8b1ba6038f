"""The inference engine: continuous batching over the prefill/decode programs and a paged KV cache.

::

    engine = Engine.from_model(model, tokenizer)        # in-process, bound to the live weights (RLHF)
    engine = Engine.from_static("model.llmkit")          # the static model file (the server)
    outs = engine.generate(["Once upon"], SamplingParams(temperature=0, max_tokens=32))

    rid = engine.add_request(ids, params, callback=on_output)   # streaming: thread-safe
    while engine.has_work():
        engine.step()                                    # one scheduler step (one thread only)
    engine.abort(rid)                                    # cancel: its KV blocks are freed

Both sources run the same scheduler, sampler and runner. ``add_request`` and ``abort`` may be
called from any thread (they queue); ``step`` from one thread at a time (``EngineThread`` does it
for the server). Callbacks run on the stepping thread, once per step that changed the request.

Guarantee (docs/serve.md): a request's tokens, greedy or seeded, are bitwise the same whether it
runs alone, in a batch, or after a prefix-cache hit.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np

from llmkit.tokenizer import FILES as TOKENIZER_FILES
from llmkit.tokenizer import Tokenizer, TokenizerError

from .blocks import BlockManager
from .chat import ChatTemplate, ChatTemplateError
from .detokenize import Detokenizer
from .programs import (
    BLOCK_SIZE,
    DECODE_TILE,
    PREFILL_TILE,
    ModelSpec,
    model_spec,
    retype_pool,
    runs_native,
    unpack_panel_weights,
)
from .request import Completion, FinishReason, Request, RequestOutput
from .runner import DecodeBatch, ModelRunner, PrefillBatch
from .sampling import Sampler, SamplingParams, merge_stop_ids
from .scheduler import Scheduler


class EngineConfigError(ValueError):
    """An EngineConfig that cannot work with the model (the CLI reports it in one line)."""


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings (block_size and the tiles apply to programs traced in-process; a static model
    file fixes them at export)."""

    max_batch: int = 8  # requests running at once (decode batch size)
    max_tokens_per_step: int = 256  # decode tokens + prompt tokens per step
    num_blocks: int | None = None  # KV blocks in the pool; default: max_batch full-context sequences
    kv_memory_bytes: int | None = None  # or: as many KV blocks as fit in these bytes (not both)
    block_size: int = BLOCK_SIZE  # tokens per KV block (= prefill chunk)
    prefill_tile: int = PREFILL_TILE  # rows per BLAS call in prefill (batch invariance); 0 = plain linear
    decode_tile: int = DECODE_TILE  # rows per BLAS call in decode; 0 = plain linear
    enable_prefix_caching: bool = True
    # from_model: weights relaid once into the layouts the kernels read fastest (refreshed after
    # each update); False: the programs read the parameters' own arrays (RLHF: nothing to refresh)
    relayout_weights: bool = True
    max_model_len: int | None = None  # context limit; default (and at most): the model's
    # "cinn": fused compiled kernels, the ops' C kernels and one-call replays of the decode step;
    # "none": the op table's reference kernels; None: to_static's default (cinn where cc works).
    compiler: str | None = None
    # the KV cache's: None, the model's dtype; "int8" (float32 models): int8 codes and a float32
    # scale per (token, kv head) row, quantized as stored (docs/serve.md, "The paged KV cache")
    kv_dtype: str | None = None


class Engine:
    """See the module docstring."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer | None,
        config: EngineConfig | None = None,
        *,
        model_name: str = "model",
        chat_template: ChatTemplate | None = None,
        generation_defaults: dict[str, Any] | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.config = config = config or EngineConfig()
        self.runner = runner
        self.spec = runner.spec
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.chat_template = chat_template or ChatTemplate.of(tokenizer)
        self.generation_defaults = dict(generation_defaults or {})
        eos = set(eos_token_ids) | (set(tokenizer.eos_ids) if tokenizer is not None else set())
        self.eos_token_ids = frozenset(eos)
        limit = self.spec.max_model_len
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.blocks = BlockManager(runner.num_blocks, self.spec.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.blocks, config.max_batch, config.max_tokens_per_step, self.spec.block_size
        )
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.num_prompt_tokens = 0  # computed (not cached) prompt tokens
        self.num_generated_tokens = 0
        self.num_steps = 0

    # ---- construction -------------------------------------------------------------------------
    @staticmethod
    def _num_blocks(config: EngineConfig, max_len: int, spec: ModelSpec) -> int:
        """The pool's size (its cap: memory is committed as blocks are first used)."""
        cap = config.kv_memory_bytes
        if cap is None:
            if config.num_blocks is not None:
                return config.num_blocks
            return config.max_batch * -(-max_len // spec.block_size)
        if config.num_blocks is not None:
            raise EngineConfigError("give the KV cache's size as num_blocks or kv_memory_bytes, not both")
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < spec.block_bytes:
            raise EngineConfigError(
                f"the KV cache memory (--kv-memory, kv_memory_bytes) must hold at least one KV block "
                f"of this model ({spec.block_bytes} bytes), got {cap!r} bytes"
            )
        return cap // spec.block_bytes

    @staticmethod
    def _kv_spec(config: EngineConfig, spec: ModelSpec) -> ModelSpec:
        """``spec`` with the KV dtype of ``config`` (checked)."""
        if config.kv_dtype in (None, spec.dtype):
            return spec
        if config.kv_dtype != "int8" or spec.dtype != "float32":
            raise EngineConfigError(
                f"the KV cache dtype (--kv-dtype, kv_dtype) must be the model's ({spec.dtype})"
                f"{' or int8' if spec.dtype == 'float32' else ''}, got {config.kv_dtype!r}"
            )
        return dataclasses.replace(spec, kv_dtype=config.kv_dtype)

    @classmethod
    def from_model(
        cls, model: Any, tokenizer: Any = None, config: EngineConfig | None = None, model_name: str = "model"
    ) -> Engine:
        """An engine over programs traced from ``model`` (a LlamaForCausalLM-like causal LM).

        The programs read the model's parameters at every step, so the engine follows training
        updates; call :meth:`reset_prefix_cache` after changing the weights.
        """
        config = config or EngineConfig()
        max_len = min(
            config.max_model_len or model.config.max_position_embeddings, model.config.max_position_embeddings
        )
        spec = cls._kv_spec(config, model_spec(model, config.block_size))
        runner = ModelRunner.from_model(
            model,
            cls._num_blocks(config, max_len, spec),
            config.block_size,
            config.prefill_tile,
            config.decode_tile,
            config.compiler,
            config.relayout_weights,
            spec.kv_dtype,
        )
        tok = None if tokenizer is None else Tokenizer.of(tokenizer)
        return cls(runner, tok, config, model_name=model_name, eos_token_ids=model.config.eos_ids)

    @classmethod
    def from_static(cls, path: str | os.PathLike[str], config: EngineConfig | None = None) -> Engine:
        """An engine over a static model file written by ``llmkit export`` (no model code needed)."""
        from llmkit.framework import jit

        config = config or EngineConfig()
        # the score program (echo, prompt_logprobs) is parsed at its first use: most servers never
        # run it (not deferred where its weights are unpacked with the others'; its pool is retyped,
        # for another KV dtype, when the runner binds it)
        lazy = ("score",) if runs_native(config.compiler) else ()
        sm = jit.load(path, compiler=config.compiler, lazy=lazy)
        spec, tokenizer = _check_static(sm)
        spec = cls._kv_spec(config, spec)
        if spec.kv_dtype:
            retype_pool(sm.programs.values(), spec)
        if not runs_native(config.compiler):
            unpack_panel_weights(sm.programs.values())  # the reference kernels read [in, out]
        meta = sm.metadata
        max_len = min(config.max_model_len or spec.max_model_len, spec.max_model_len)
        runner = ModelRunner.from_static(sm, cls._num_blocks(config, max_len, spec), spec)
        return cls(
            runner,
            tokenizer,
            config,
            model_name=meta.get("model_name", "model"),
            chat_template=ChatTemplate.from_metadata(meta["chat_template"])
            if "chat_template" in meta
            else None,
            generation_defaults=meta.get("generation"),
            eos_token_ids=meta.get("eos_token_ids", ()),
        )

    # ---- submitting (any thread) ----------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt's token ids. The BOS rule (docs/serve.md): a text prompt gets the tokenizer's BOS
        when its ``add_bos_token`` says so (default yes); token ids are taken as given."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: a text prompt needs a tokenizer; pass token ids")
            return self.tokenizer.encode(prompt, add_bos=getattr(self.tokenizer, "add_bos_token", True))
        return [int(t) for t in prompt]

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        callback: Callable[[RequestOutput], None] | None = None,
        seed: int | None = None,
    ) -> str:
        """Queue a request (text or token ids); returns its id. ``seed`` overrides ``params.seed``.

        Raises ValueError (naming prompt or max_tokens) when it cannot fit the context.
        """
        params = params or SamplingParams()
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.spec.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise ValueError(f"prompt: token id {bad} is out of range for a vocabulary of {vocab}")
        if len(ids) + min(params.max_tokens, 1) > self.max_model_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens do not fit the context of {self.max_model_len} tokens"
                + (" (at least one new token must fit)" if params.max_tokens else "")
            )
        if params.prompt_logprobs is not None:
            if not self.runner.can_score:
                raise ValueError(
                    "prompt_logprobs: this model file has no score program (exported by an older "
                    "llmkit); export it again with llmkit export"
                )
            if params.prompt_logprobs > self.spec.score_top_k:
                raise ValueError(
                    f"prompt_logprobs: at most {self.spec.score_top_k} (the score program's top-k), "
                    f"got {params.prompt_logprobs}"
                )
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: {params.max_tokens} new tokens after a {len(ids)}-token prompt exceed the "
                f"context of {self.max_model_len} tokens (at most {self.max_model_len - len(ids)})"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer")
        rid = request_id or f"req-{next(self._ids)}"
        req = Request(
            request_id=rid,
            prompt_ids=ids,
            params=params,
            sampler=Sampler(params, ids, seed=seed),
            detok=Detokenizer(self.tokenizer, params.stop),
            stop_ids=merge_stop_ids(params, self.eos_token_ids),
            callback=callback,
        )
        with self._lock:
            if rid in self._requests:
                raise ValueError(f"request_id: {rid!r} is already in use")
            self._requests[rid] = req
            self._inbox.append(req)
        return rid

    def abort(self, request_id: str) -> None:
        """Cancel a request (at the start of the next step; unknown or finished ids are ignored)."""
        self._aborts.append(request_id)

    # ---- stepping (one thread) ------------------------------------------------------------------
    def has_work(self) -> bool:
        s = self.scheduler
        return bool(self._inbox or self._aborts or s.waiting or s.running)

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns (and passes to callbacks) the outputs of changed requests."""
        touched: list[Request] = []
        self._drain(touched)
        plan = self.scheduler.schedule()
        bs = self.spec.block_size
        if plan.decode:
            batch = DecodeBatch()
            for r in plan.decode:
                batch.add(r.output_ids[-1], r.prompt_len + len(r.output_ids) - 1, r.blocks, bs)
            logits = self.runner.decode(batch)
            for r, row in zip(plan.decode, logits):
                r.computed += 1
                self._append_token(r, row)
                touched.append(r)
        if plan.prefill:
            batch, last = PrefillBatch(), []
            for r, start, n in plan.prefill:
                row = batch.add_segment(r.prompt_ids[start : start + n], start, r.blocks, bs)
                if start + n == r.prompt_len:
                    batch.logit_rows.append(row)
                    last.append(r)
            if any(r.scores_prompt for r, _, _ in plan.prefill):
                logits = self._score(plan.prefill, batch)
            else:
                logits = self.runner.prefill(batch)
            for r, start, n in plan.prefill:
                r.computed = start + n
                self.num_prompt_tokens += n
                self._register_prefix(r)
            for r, row in zip(last, logits):
                if r.params.max_tokens == 0:  # scored, nothing to generate
                    self._finish(r, FinishReason.LENGTH)
                else:
                    self._append_token(r, row)
                touched.append(r)
        self.num_steps += not plan.empty
        return self._flush(touched)

    def _score(self, chunks: list[tuple[Request, int, int]], batch: PrefillBatch) -> np.ndarray:
        """Run the prefill batch through the score program; the scoring requests' prompt logprobs
        (row ``i`` of a chunk at ``start`` scores prompt token ``start + i + 1``). Returns the logits
        at ``batch.logit_rows``, as prefill would."""
        targets = []
        for r, start, n in chunks:
            nxt = r.prompt_ids[start + 1 : start + n + 1]
            targets += nxt + [0] * (n - len(nxt))  # the prompt's last row has no target
        s = self.runner.score(batch, targets)
        row = 0
        for r, start, n in chunks:
            if r.scores_prompt:  # kept as arrays (PromptLogprobs): no Python object per position
                k, end = r.params.prompt_logprobs, row + min(n, r.prompt_len - 1 - start)
                at = slice(row, end)
                r.prompt_scores.append((s.target_logprobs[at], s.top_ids[at, :k], s.top_logprobs[at, :k]))
            row += n
        return s.logits

    def _drain(self, touched: list[Request]) -> None:
        while self._inbox:
            self.scheduler.add(self._inbox.popleft())
        while self._aborts:
            req = self._requests.get(self._aborts.popleft())
            if req is not None and not req.finished:
                self._finish(req, FinishReason.ABORT)
                touched.append(req)

    def _append_token(self, r: Request, logits: np.ndarray) -> None:
        choice = r.sampler(logits)
        tok = choice.token_id
        r.sampler.accept(tok)
        r.output_ids.append(tok)
        r.pending_ids.append(tok)
        self.num_generated_tokens += 1
        if r.params.logprobs is not None:
            r.logprobs.append(choice)
            r.pending_logprobs.append(choice)
        is_stop = tok in r.stop_ids
        delta, stopped = r.detok.add(tok, visible=not is_stop)
        r.pending_text += delta
        if is_stop or stopped:
            self._finish(r, FinishReason.STOP)
        elif len(r.output_ids) >= r.params.max_tokens:
            self._finish(r, FinishReason.LENGTH)

    def _finish(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        if not r.detok.stopped:
            r.pending_text += r.detok.finish()
        self.scheduler.remove(r)

    def _register_prefix(self, r: Request) -> None:
        full = min(len(r.prefix_hashes), r.computed // self.spec.block_size)
        for i in range(r.registered, full):
            self.blocks.register(r.blocks[i], r.prefix_hashes[i])
        r.registered = max(r.registered, full)

    def _flush(self, touched: list[Request]) -> list[RequestOutput]:
        outs = []
        seen: set[int] = set()
        for r in touched:
            if id(r) in seen:
                continue
            seen.add(id(r))
            out = r.take_output()
            if r.finished:
                with self._lock:
                    self._requests.pop(r.request_id, None)
            outs.append(out)
            if r.callback is not None:
                r.callback(out)
        return outs

    def fail_all(self, reason: str = FinishReason.ERROR) -> list[RequestOutput]:
        """End every queued and running request (after an engine error, or at shutdown)."""
        touched: list[Request] = []
        while self._inbox:
            self.scheduler.add(self._inbox.popleft())
        for r in list(self.scheduler.waiting) + list(self.scheduler.running):
            if not r.finished:
                self._finish(r, reason)
                touched.append(r)
        self._aborts.clear()
        return self._flush(touched)

    # ---- convenience ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run ``prompts`` to completion (on this thread; not while an EngineThread runs the engine)."""
        plist = (
            list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        )
        if len(plist) != len(prompts):
            raise ValueError(f"params: got {len(plist)} for {len(prompts)} prompts")
        done: dict[str, Completion] = {}
        reqs: dict[str, Request] = {}
        ids = []
        for p, sp in zip(prompts, plist):
            rid = self.add_request(p, sp)
            reqs[rid] = self._requests[rid]
            ids.append(rid)
        while len(done) < len(ids):
            for out in self.step():
                if out.finished and out.request_id in reqs:
                    done[out.request_id] = reqs[out.request_id].completion()
        return [done[i] for i in ids]

    # ---- state ----------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (their K/V came from the weights they were computed with)."""
        self.blocks.reset_prefix_cache()

    def weights_changed(self) -> None:
        """Call after updating the weights of a ``from_model`` engine (an RLHF policy step).

        Forgets cached prefixes and the relaid weight copies. (Rebinding a parameter, as
        ``set_value`` and optimizers do, is detected anyway; writing into a parameter's array in
        place is not, and this call is what makes it safe.)
        """
        self.blocks.reset_prefix_cache()
        self.runner.weights_changed()

    def stats(self) -> dict[str, int]:
        """Counters and gauges for monitoring (read from any thread; values are a snapshot)."""
        s, b = self.scheduler, self.blocks
        return {
            "running": len(s.running),
            "waiting": len(s.waiting) + len(self._inbox),
            "kv_blocks_used": b.num_used,
            "kv_blocks_total": b.num_blocks,
            "kv_blocks_cached": b.num_cached,
            "prefix_cache_queries": b.prefix_queries,
            "prefix_cache_hits": b.prefix_hits,
            "prompt_tokens": self.num_prompt_tokens,
            "generated_tokens": self.num_generated_tokens,
            "steps": self.num_steps,
        }


class _EngineFields(TypedDict):
    engine: ModelSpec  # the programs' cache geometry and context


class StaticMetadata(_EngineFields, total=False):
    """The metadata ``llmkit export`` writes into a static model file's manifest for the engine."""

    model_name: str
    chat_template: Any  # the Jinja source string (an older llmkit wrote a dict): ChatTemplate.from_metadata
    generation: dict[str, float]  # sampling defaults: temperature, top_p, top_k
    eos_token_ids: list[int]


def _check_static(sm: Any) -> tuple[ModelSpec, Tokenizer]:
    """The engine's view of a loaded static model file, every part checked (:class:`FormatError`
    naming the field): the metadata's schema and values, the programs' KV pool and logits against
    the metadata, the tokenizer against the vocabulary."""
    from llmkit.framework.jit import FormatError
    from llmkit.framework.jit.model_file import check_json

    where = str(sm.path / "manifest.json")
    meta = sm.metadata
    if "engine" not in meta:
        raise FormatError(
            f"{sm.path}: not an inference model file (no engine metadata); write one with llmkit export"
        )
    check_json(meta, StaticMetadata, where, "metadata")
    spec = ModelSpec.from_dict(meta["engine"])
    for k, v in spec.to_dict().items():
        if isinstance(v, int) and v < 1 and not (k.endswith("_tile") and v == 0):
            raise FormatError(f"{where}: metadata.engine.{k}: must be positive, got {v}")
    if "chat_template" in meta:
        try:
            ChatTemplate.from_metadata(meta["chat_template"])
        except ChatTemplateError as e:
            raise FormatError(f"{where}: {e}") from None
    gen = meta.get("generation", {})
    try:
        SamplingParams(**{k: gen[k] for k in ("temperature", "top_p", "top_k") if k in gen})
    except (TypeError, ValueError) as e:
        raise FormatError(f"{where}: metadata.generation: {e}") from None
    bad = [t for t in meta.get("eos_token_ids", ()) if not 0 <= t < spec.vocab_size]
    if bad:
        raise FormatError(
            f"{where}: metadata.eos_token_ids: {bad[0]} is not a token id (vocabulary of {spec.vocab_size})"
        )
    pool = list(spec.pool_shape(0))
    # score is optional: files exported before it existed serve everything but echo
    entries = sm.manifest["programs"]  # (load_model checked each loaded function against its entry)
    for name in ("prefill", "decode", *(["score"] if "score" in entries else [])):
        fn = entries.get(name)
        if fn is None or not fn["inputs"] or not fn["outputs"]:
            raise FormatError(
                f"{where}: programs: no {name!r} program of the engine's signature; write the file with "
                "llmkit export"
            )
        got, logits = fn["inputs"][-1], fn["outputs"][0]
        shape = list(got["shape"])
        if (
            len(shape) != len(pool)
            or shape[:2] + shape[3:] != pool[:2] + pool[3:]
            or got["dtype"] != spec.dtype
        ):
            raise FormatError(
                f"{where}: metadata.engine: {spec.dtype}{pool} (blocks at dim 2) does not match the {name} "
                f"program's KV pool {got['dtype']}{shape}"
            )
        if logits["shape"][-1:] != [spec.vocab_size]:
            raise FormatError(
                f"{where}: metadata.engine.vocab_size: {spec.vocab_size}, but the {name} program's logits "
                f"are {logits['shape']}"
            )
    names = [n for n in sm.manifest["files"] if n in TOKENIZER_FILES]  # files() of the exporter
    try:  # an old file holds only tokenizer.model
        tokenizer = Tokenizer.from_files({n: sm.file(n) for n in names}, origin=str(sm.path))
    except TokenizerError as e:
        raise FormatError(str(e)) from None
    if tokenizer.vocab_size > spec.vocab_size:
        raise FormatError(
            f"{sm.path}: the tokenizer has {tokenizer.vocab_size} tokens, the programs only "
            f"{spec.vocab_size} logits"
        )
    return spec, tokenizer
