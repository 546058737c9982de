"""`sluice bench grammar-libs`: llguidance vs xgrammar on this machine, to choose the engine's
grammar library by measurement (issue #31).

For each library, with the model's tokenizer (SmolLM2's 49k vocab by default):
- cold compile of a nested JSON Schema (lists of objects, enums, optional fields): from the schema
  text to the first token mask, with no cache (a library that defers work to the first mask pays
  it here);
- warm compile: the same schema again (each library's own cache, or a copy of the compiled matcher);
- per-step mask cost at 1, 16 and 64 constrained rows: filling the bitmask of every row and applying
  it to a [rows, vocab] float32 logits tensor, while each row walks a valid document token by token
  (rows start at different offsets, so their parser states differ).
Every round alternates the libraries (interleaved), and the medians are reported.

xgrammar is not a dependency of sluice (it was measured and not chosen; it needs torch): install it
into the venv that runs this command (`pip install xgrammar`).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

# A nested schema of the kind extraction jobs send (pydantic's shape: $defs, enums, optional fields).
NESTED_SCHEMA: dict[str, Any] = {
    "$defs": {
        "Item": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 16},
                "kind": {"enum": ["tool", "part", "service"]},
                "quantity": {"type": "integer"},
                "note": {"anyOf": [{"type": "string", "maxLength": 24}, {"type": "null"}]},
            },
            "required": ["name", "kind", "quantity", "note"],
            "additionalProperties": False,
        },
    },
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 24},
        "priority": {"enum": ["low", "normal", "high"]},
        "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "maxItems": 4},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "total": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    },
    "required": ["customer", "priority", "items", "tags", "total"],
    "additionalProperties": False,
}

# A document valid for NESTED_SCHEMA, in the compact form both libraries generate.
NESTED_EXAMPLE = json.dumps({
    "customer": "Ada Lovelace Ltd", "priority": "high",
    "items": [{"name": "gear wheel", "kind": "part", "quantity": 12, "note": None},
              {"name": "oiling", "kind": "service", "quantity": 1, "note": "before winter"}],
    "tags": ["urgent", "repeat"], "total": 1024.5,
}, separators=(", ", ": "))


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)


def _p90_ms(samples: list[float]) -> float:
    return round(sorted(samples)[int(0.9 * len(samples))] * 1e3, 4)


class _Lib:
    name = ""

    def cold(self, schema: str) -> Any: ...
    def warm(self, schema: str) -> Any: ...
    def matchers(self, compiled: Any, n: int) -> list[Any]:
        raise NotImplementedError
    def fill(self, matchers: list[Any]) -> Any: ...
    def apply(self, logits: Any, bitmask: Any) -> None: ...
    def advance(self, matcher: Any, token: int) -> None: ...


class _Guidance(_Lib):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        from sluice.grammar.spec import JSON_OPTIONS

        self._lg, self._lt, self._options = llguidance, llguidance.torch, JSON_OPTIONS
        self._tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self._executor = llguidance.LLExecutor(num_threads=1)
        self._cache: dict[str, Any] = {}
        self._vocab = vocab

    def cold(self, schema: str) -> Any:
        grammar = self._lg.LLMatcher.grammar_from_json_schema(schema, defaults=self._options)
        matcher = self._lg.LLMatcher(self._tok, grammar)
        matcher.compute_bitmask()  # llguidance builds lexer states lazily: count the first mask
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        self._cache[schema] = matcher
        return matcher

    def warm(self, schema: str) -> Any:
        return self._cache[schema].deep_copy()

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [compiled.deep_copy() for _ in range(n)]

    def fill(self, matchers: list[Any]) -> Any:
        bitmask = self._lt.allocate_token_bitmask(len(matchers), self._vocab)
        self._lt.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        return bitmask

    def apply(self, logits: Any, bitmask: Any) -> None:
        # llguidance's own CPU apply is a torch.compile'd function (an inductor build in the worker);
        # the engine uses sluice's (workers/grammar_mask.py: its native kernel where built), so
        # that is what is measured.
        from sluice.workers.grammar_mask import apply_bitmask_to_rows

        apply_bitmask_to_rows(logits, range(logits.shape[0]), bitmask)

    def advance(self, matcher: Any, token: int) -> None:
        if not matcher.consume_token(token):
            raise RuntimeError(matcher.get_error())


class _XGrammar(_Lib):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import xgrammar

        self._xgr = xgrammar
        self._info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self._compiler = xgrammar.GrammarCompiler(self._info, max_threads=1)
        self._vocab = vocab

    def cold(self, schema: str) -> Any:
        compiler = self._xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))
        matcher = self._xgr.GrammarMatcher(compiled)
        bitmask = self._xgr.allocate_token_bitmask(1, self._vocab)
        matcher.fill_next_token_bitmask(bitmask, 0)
        self._compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))  # warm cache
        return compiled

    def warm(self, schema: str) -> Any:
        return self._compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self._xgr.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matchers: list[Any]) -> Any:
        bitmask = self._xgr.allocate_token_bitmask(len(matchers), self._vocab)
        for i, m in enumerate(matchers):  # vLLM's xgrammar backend fills row by row too
            m.fill_next_token_bitmask(bitmask, i)
        return bitmask

    def apply(self, logits: Any, bitmask: Any) -> None:
        self._xgr.apply_token_bitmask_inplace(logits, bitmask)  # its native CPU kernel

    def advance(self, matcher: Any, token: int) -> None:
        if not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar refused token {token}")


def _mask_cost(lib: _Lib, compiled: Any, path: list[int], rows: int, steps: int,
               vocab: int) -> tuple[list[float], list[float]]:
    """Seconds per step to fill the rows' bitmask, and to apply it to fresh logits."""
    import torch

    matchers = lib.matchers(compiled, rows)
    offsets = [(i * 7) % len(path) for i in range(rows)]
    for m, offset in zip(matchers, offsets, strict=True):
        for token in path[:offset]:
            lib.advance(m, token)
    fills, applies = [], []
    for _ in range(steps):
        logits = torch.randn(rows, vocab)
        start = time.perf_counter()
        bitmask = lib.fill(matchers)
        middle = time.perf_counter()
        lib.apply(logits, bitmask)
        fills.append(middle - start)
        applies.append(time.perf_counter() - middle)
        for i in range(rows):
            if offsets[i] == len(path) - 1:  # restart a finished row on a fresh matcher
                matchers[i], offsets[i] = lib.matchers(compiled, 1)[0], 0
            lib.advance(matchers[i], path[offsets[i]])
            offsets[i] += 1
    return fills, applies


def engine_mask_cost(tokenizer: Any, vocab: int, rows: list[int], steps: int) -> dict[str, dict[str, float]]:
    """The engine's per-step mask cost (llguidance's parallel fill, sluice's apply) at each row
    count, walking NESTED_EXAMPLE as `run` does: median ms per step, by row count."""
    lib = _Guidance(tokenizer, vocab)
    path = [*tokenizer.encode(NESTED_EXAMPLE), tokenizer.eos_token_id]
    compiled = lib.cold(json.dumps(NESTED_SCHEMA))
    out = {}
    for n in rows:
        fill, apply = _mask_cost(lib, compiled, path, n, steps, vocab)
        out[str(n)] = {"fill_ms": _median_ms(fill), "apply_ms": _median_ms(apply)}
    return out


def run(model_dir: Path, rows: list[int], steps: int, rounds: int, json_out: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from sluice.workers.model.config import ModelConfig

    torch.set_num_threads(1)
    import llguidance.torch  # noqa: F401  (imports torch: not part of the tokenizer setup timed below)
    import xgrammar  # noqa: F401

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    path = [*tokenizer.encode(NESTED_EXAMPLE), tokenizer.eos_token_id]
    schema = json.dumps(NESTED_SCHEMA)
    setup: dict[str, float] = {}
    libs: list[_Lib] = []
    for cls in (_Guidance, _XGrammar):
        start = time.perf_counter()
        libs.append(cls(tokenizer, vocab))
        setup[cls.name] = round((time.perf_counter() - start) * 1e3, 2)
    cold: dict[str, list[float]] = {lib.name: [] for lib in libs}
    warm: dict[str, list[float]] = {lib.name: [] for lib in libs}
    fills: dict[str, dict[int, list[float]]] = {lib.name: {n: [] for n in rows} for lib in libs}
    applies: dict[str, dict[int, list[float]]] = {lib.name: {n: [] for n in rows} for lib in libs}
    for r in range(rounds):
        for lib in libs if r % 2 == 0 else libs[::-1]:  # interleaved, alternating who goes first
            # A fresh schema per round (a changed maxLength): no library may serve it from a cache.
            fresh = schema.replace('"maxLength": 16', f'"maxLength": {16 + r}')
            start = time.perf_counter()
            compiled = lib.cold(fresh)
            cold[lib.name].append(time.perf_counter() - start)
            start = time.perf_counter()
            lib.warm(fresh)
            warm[lib.name].append(time.perf_counter() - start)
            for n in rows:
                fill, apply = _mask_cost(lib, compiled, path, n, steps, vocab)
                fills[lib.name][n].extend(fill)
                applies[lib.name][n].extend(apply)
    report = {
        "what": "grammar library choice: cold/warm compile of a nested JSON Schema, per-step mask cost",
        "model": str(model_dir), "vocab": vocab, "document_tokens": len(path), "rounds": rounds,
        "steps_per_round": steps, "torch_threads": 1, "library_threads": 1,
        "tokenizer_setup_ms": setup,
        "libraries": {
            lib.name: {
                "cold_compile_ms": _median_ms(cold[lib.name]),
                "warm_compile_ms": _median_ms(warm[lib.name]),
                "mask_fill_ms": {str(n): _median_ms(fills[lib.name][n]) for n in rows},
                "mask_fill_p90_ms": {str(n): _p90_ms(fills[lib.name][n]) for n in rows},
                "mask_apply_ms": {str(n): _median_ms(applies[lib.name][n]) for n in rows},
            }
            for lib in libs
        },
    }
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report
