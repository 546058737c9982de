"""Typed configuration of one inference engine and of its scheduler.

`EngineConfig` is what an operator sets (one per worker process). `SchedulerConfig` is the subset the
pure-Python scheduler needs, built by the engine once the KV pool size and the model's context length
are known. Both are frozen and validated on construction; no torch import here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

POLICIES = ("chunked", "prefill_first", "static")
CHUNK_POLICIES = ("fixed", "adaptive")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KERNEL_BACKENDS = ("auto", "torch", "triton")
MAX_BLOCK_SIZE = 256

_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _optional_positive(name: str, value: int | None) -> None:
    if value is not None:
        _positive(name, value)


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _speculation(num_tokens: int, lookup_min: int, lookup_max: int) -> None:
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be 0 (off) or a positive integer, got {num_tokens!r}")
    _positive("prompt_lookup_min", lookup_min)
    _positive("prompt_lookup_max", lookup_max)
    if lookup_min > lookup_max:
        raise ValueError(f"prompt_lookup_min ({lookup_min}) must not exceed prompt_lookup_max ({lookup_max})")


def _share(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")


def _block_size(value: int) -> None:
    # Kernels index a block with tl.arange(0, BLOCK_SIZE), which needs a power of two.
    _positive("block_size", value)
    if value > MAX_BLOCK_SIZE or value & (value - 1):
        raise ValueError(f"block_size must be a power of two between 1 and {MAX_BLOCK_SIZE}, got {value}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Settings of one engine (one model on one device)."""

    model: str
    """Path to a local Hugging Face model directory (per worker: `sluice worker --model`)."""
    device: str = "cpu"
    """`cpu`, `cuda` or `cuda:N` (per worker: `sluice worker --device`)."""
    dtype: str = "auto"
    """`auto` (float32 on CPU, bfloat16 on CUDA), `float32`, `bfloat16` or `float16`."""
    block_size: int = 16
    """Tokens per KV-cache block: a power of two from 1 to 256."""
    num_kv_blocks: int | None = None
    """The KV pool's size in blocks; unset = derived from the memory budget."""
    kv_cache_bytes: int | None = None
    """CPU KV pool budget in bytes; unset = `cpu_memory_utilization` of the memory available once the
    weights are loaded (like `gpu_memory_utilization` on CUDA), capped at what `max_num_seqs`
    sequences of `max_model_len` tokens can ever hold."""
    cpu_memory_utilization: float = 0.25
    """CPU: the fraction of the memory left after the weights that the KV pool may take, in (0, 1]."""
    gpu_memory_utilization: float = 0.90
    """CUDA: the fraction of the device's memory the engine may fill (the KV pool gets what the weights
    and other processes leave of it), in (0, 1]."""
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step (prompt chunks and decodes together)."""
    # 128 running sequences: the bench's 128-request set starts at once, so a long answer is not
    # admitted late and left decoding alone at the end (docs/lab/notebook.md: ~1.04x at 128 requests).
    max_num_seqs: int = 128
    """Sequences running at once, at most."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output) in tokens; unset = the model's `max_position_embeddings`."""
    policy: str = "chunked"
    """`chunked` (decode-first: running decodes first, prompt chunks fill the rest of the budget),
    `prefill_first` (a new prompt is prefilled whole before decodes continue) or `static` (classic
    static batching, a baseline: a batch holds what waits at the worker when it starts, and the
    gateway keeps that queue `dispatch.max_worker_waiting` short, so raise that to the batch wanted)."""
    max_prefill_chunk: int | None = None
    """Cap on one request's prefill chunk per step, in tokens; unset = the step budget."""
    chunk_policy: str = "fixed"
    """`chunked` policy: `fixed` (prefill fills the step budget, each chunk capped by `max_prefill_chunk`)
    or `adaptive` (each step's prefill is the largest whose predicted step time keeps every decoding
    stream with an ITL target inside it, from a cost model fitted on the engine's own steps; at
    least `min_prefill_chunk`; the whole budget when no such stream decodes; docs/objectives.md)."""
    min_prefill_chunk: int = 32
    """`adaptive` chunk policy: the prefill budget never goes below this (a long prompt keeps progressing
    under an ITL target no step can meet)."""
    itl_slow_share: float = 0.0
    """`adaptive` chunk policy: the share of a stream's token gaps that may exceed its ITL target, in
    [0, 1) (1 - the objectives' percentile: 0.05 for p95). While every decoding stream has such gaps
    left (of max_tokens - 1, less the slow gaps it has seen), a step may take the whole prefill budget;
    0 = every step holds the target."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of a prompt prefix computed before (salted per tenant: tenants never share
    blocks). Under the `chunked` policy a request whose next 64 or more tokens another request is
    still prefilling (one system prompt, arriving together) waits for them to be cached rather than
    compute them beside it."""
    num_speculative_tokens: int | None = None
    """Prompt-lookup speculation (workers/speculative.py): up to this many draft tokens per decode,
    copied from where the request's last n tokens (n from `prompt_lookup_max` down to
    `prompt_lookup_min`) occurred before in its prompt or output, and verified in the same step. The
    output is unchanged (a draft is kept only where it equals what the sampler picks); 0 = off.
    Unset = 4 on the CPU, 0 on CUDA: a verification step runs eager there, outside the decode CUDA
    graphs, and cost the H200 26% of its throughput when few drafts were kept (bench/KERNEL_NOTES.md)."""
    prompt_lookup_max: int = 4
    """Longest n-gram of the request's last tokens looked up for drafts."""
    prompt_lookup_min: int = 1
    """Shortest n-gram of the request's last tokens looked up for drafts."""
    kernel_backend: str = "auto"
    """`auto` (Triton on CUDA, torch on CPU), `torch` or `triton`."""
    use_cuda_graphs: bool = True
    """CUDA: run decode batches as captured CUDA graphs."""
    seed: int = 0
    """Seed of the seeds drawn for sampled requests that set none (a request's own seed wins)."""
    grammar_compile_timeout_s: float = 10.0
    """Structured outputs: a grammar not compiled within this many seconds fails its request alone
    (compiles run beside the engine loop; other requests keep stepping meanwhile)."""
    grammar_cache_size: int = 256
    """Structured outputs: compiled grammars kept, by hash of (tokenizer, kind, spec)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("model must be the path of a local model directory, got an empty value")
        if not _DEVICE_RE.match(self.device):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        _one_of("dtype", self.dtype, DTYPES)
        _block_size(self.block_size)
        _optional_positive("num_kv_blocks", self.num_kv_blocks)
        _optional_positive("kv_cache_bytes", self.kv_cache_bytes)
        for name in ("cpu_memory_utilization", "gpu_memory_utilization"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        _optional_positive("max_model_len", self.max_model_len)
        _one_of("policy", self.policy, POLICIES)
        _optional_positive("max_prefill_chunk", self.max_prefill_chunk)
        _one_of("chunk_policy", self.chunk_policy, CHUNK_POLICIES)
        _positive("min_prefill_chunk", self.min_prefill_chunk)
        _share("itl_slow_share", self.itl_slow_share)
        _speculation(self.resolved_num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max)
        _one_of("kernel_backend", self.kernel_backend, KERNEL_BACKENDS)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        timeout = self.grammar_compile_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < float("inf"):
            raise ValueError(f"grammar_compile_timeout_s must be a positive number of seconds, got {timeout!r}")
        _positive("grammar_cache_size", self.grammar_cache_size)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def resolved_num_speculative_tokens(self) -> int:
        """Draft tokens per decode: None becomes 4 on CPU and 0 (off) on CUDA."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        return 0 if self.is_cuda else 4

    @property
    def resolved_dtype(self) -> str:
        """The dtype name actually used: "auto" becomes float32 on CPU and bfloat16 on CUDA."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.is_cuda else "float32"

    @property
    def resolved_kernel_backend(self) -> str:
        """"auto" becomes "triton" on CUDA and "torch" on CPU."""
        if self.kernel_backend != "auto":
            return self.kernel_backend
        return "triton" if self.is_cuda else "torch"


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """What the scheduler and block manager need; built once the pool size is known."""

    policy: str
    block_size: int
    num_kv_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    max_prefill_chunk: int | None = None
    enable_prefix_caching: bool = True
    num_speculative_tokens: int = 0
    chunk_policy: str = "fixed"
    min_prefill_chunk: int = 32
    itl_slow_share: float = 0.0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        _one_of("policy", self.policy, POLICIES)
        _block_size(self.block_size)
        _positive("num_kv_blocks", self.num_kv_blocks)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_model_len", self.max_model_len)
        _optional_positive("max_prefill_chunk", self.max_prefill_chunk)
        _one_of("chunk_policy", self.chunk_policy, CHUNK_POLICIES)
        _positive("min_prefill_chunk", self.min_prefill_chunk)
        _share("itl_slow_share", self.itl_slow_share)
        _speculation(self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max)
        # The pool may hold fewer tokens than max_model_len: prompts that do not fit are refused
        # at add_request, and a request that outgrows the whole pool finishes with "length".

    @property
    def prefill_chunk(self) -> int:
        """Largest prefill chunk of one request in one step."""
        if self.max_prefill_chunk is None:
            return self.max_num_batched_tokens
        return min(self.max_prefill_chunk, self.max_num_batched_tokens)

    @classmethod
    def from_engine_config(
        cls, cfg: EngineConfig, num_kv_blocks: int, max_model_len: int
    ) -> SchedulerConfig:
        return cls(
            policy=cfg.policy,
            block_size=cfg.block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=max_model_len,
            max_prefill_chunk=cfg.max_prefill_chunk,
            enable_prefix_caching=cfg.enable_prefix_caching,
            num_speculative_tokens=cfg.resolved_num_speculative_tokens,
            prompt_lookup_max=cfg.prompt_lookup_max,
            prompt_lookup_min=cfg.prompt_lookup_min,
            chunk_policy=cfg.chunk_policy,
            min_prefill_chunk=cfg.min_prefill_chunk,
            itl_slow_share=cfg.itl_slow_share,
        )
