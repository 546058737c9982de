"""Compiled grammars for one tokenizer, and the per-request matcher that follows a request's output.

No torch (the engine's tensor side, workers/grammar_mask.py, fills and applies the masks).

`GrammarCompiler.submit()` compiles off the caller's thread (a small thread pool; llguidance drops
the GIL while it builds a grammar), and caches the compiled grammar by a hash of (tokenizer, kind,
spec): the same schema sent again costs one copy of a matcher. A `Matcher` is one request's
position in its grammar: it consumes the request's output tokens, rolls back what the engine drops
(rejected drafts are never consumed: the scheduler asks how many drafts the grammar accepts, and
the runner consumes drafts only around computing their masks), and says when the grammar is done.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from llguidance import LLMatcher, LLTokenizer

from sluice.grammar.spec import LIMITS, GrammarError, to_grammar
from sluice.protocol import StructuredOutput


class TokenRefused(ValueError):
    """The grammar refused a token the engine sampled for its request. Masks allow only accepted
    tokens, so this means a broken mask (e.g. a matcher that failed inside the library and allows
    nothing): the engine ends that request alone with an error."""


class Matcher:
    """One request's state in its grammar (owned by its `Request`)."""

    __slots__ = ("ll",)

    def __init__(self, ll: LLMatcher) -> None:
        self.ll = ll  # workers/grammar_mask.py computes its masks

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance past `tokens`; raises TokenRefused when the grammar refuses one (masks allow only
        accepted tokens, and drafts are checked with `num_accepted` first; see TokenRefused)."""
        if tokens and not self.ll.consume_tokens(list(tokens)):
            raise TokenRefused(f"the grammar refused the output: {self.ll.get_error()}")

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and not self.ll.rollback(num_tokens):
            raise ValueError(f"the grammar cannot roll back {num_tokens} tokens: {self.ll.get_error()}")

    def num_accepted(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar accepts from here (the drafts worth checking)."""
        return self.ll.validate_tokens(list(tokens)) if tokens else 0

    @property
    def is_done(self) -> bool:
        """The grammar matched a whole output: nothing but EOS may follow (the request finishes "stop")."""
        return self.ll.is_stopped()

    @property
    def error(self) -> str:
        return self.ll.get_error()


class GrammarCompiler:
    """Compiles `StructuredOutput`s for one tokenizer off the engine loop; cached by content hash."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], *,
                 tokenizer_id: str, max_workers: int = 1, cache_size: int = 256) -> None:
        """`tokenizer`: the model's HF tokenizer; `vocab_size`: the model's logits width (masks
        have one bit per logit; ids past the tokenizer's vocab are never allowed)."""
        self._eos_ids = frozenset(eos_token_ids)
        if not self._eos_ids:
            raise ValueError("a grammar needs the model's EOS token ids")
        self._tokenizer_id = tokenizer_id
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers,
                                                           thread_name_prefix="grammar-compile")
        # Every EOS id of the model is the grammar's EOS (allowed where the grammar may end).
        # The tokenizer's token table (a few seconds for a 49k vocab) is built in the pool as well:
        # the engine starts at once, and the first compile waits for it.
        # When the token table was ready (monotonic seconds; None before): compile time limits
        # count from here, not from a request that arrived while it was being built. Set before the
        # build is submitted: a quick build would otherwise finish first and be overwritten.
        self.ready_at: float | None = None
        self._ll_tokenizer = self._pool.submit(self._build_tokenizer, tokenizer, vocab_size)
        self._cache: OrderedDict[str, concurrent.futures.Future[LLMatcher]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.vocab_size = vocab_size

    def _build_tokenizer(self, tokenizer: Any, vocab_size: int) -> LLTokenizer:
        import llguidance.hf

        built = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(self._eos_ids))
        self.ready_at = time.monotonic()
        return built

    def key(self, structured: StructuredOutput) -> str:
        digest = hashlib.sha256()
        for part in (self._tokenizer_id, structured.kind, structured.spec):
            digest.update(part.encode("utf-8", "surrogatepass"))
            digest.update(b"\0")
        return digest.hexdigest()

    def submit(self, structured: StructuredOutput) -> concurrent.futures.Future[LLMatcher]:
        """A future of the compiled grammar (a matcher in its start state: copy it, never advance it).
        A cached compile is returned as is, done or not; a failed one is forgotten (its request gets
        the error, and the next one compiles again)."""
        key = self.key(structured)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, structured)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: self._forget_failed(key, f))
        return future

    def _forget_failed(self, key: str, future: concurrent.futures.Future[LLMatcher]) -> None:
        if future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _compile(self, structured: StructuredOutput) -> LLMatcher:
        grammar = to_grammar(structured)
        matcher = LLMatcher(self._ll_tokenizer.result(), grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise GrammarError("structured", f"the grammar does not compile: {matcher.get_error()}")
        # llguidance builds lexer states lazily: the first mask belongs to the compile, off the loop.
        matcher.compute_bitmask()
        if matcher.is_error():
            raise GrammarError("structured", f"the grammar does not compile: {matcher.get_error()}")
        return matcher

    def matcher(self, compiled: LLMatcher, output_token_ids: Sequence[int] = ()) -> Matcher:
        """A request's own matcher, advanced past the output it already has (a resumed request's
        tokens from an earlier attempt). Raises ValueError if the grammar refuses them."""
        matcher = Matcher(compiled.deep_copy())
        matcher.consume(output_token_ids)
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
