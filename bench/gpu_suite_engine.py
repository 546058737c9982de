"""Section 4 of bench/gpu_suite.py: the whole engine on a Llama-3-8B-shaped random bf16 model.

Reports, against floors derived from the ceilings measured in section 1:
  - decode ms/step at batch 1, 8, 64, 256 and context 1k, 4k; floor = (weight bytes + KV bytes
    read by the step) / copy bandwidth. A case whose KV does not fit the pool is skipped.
  - prefill tokens/s for one 2k and one 8k prompt; achieved FLOP/s vs the bf16 matmul ceiling.
  - end-to-end output tokens/s of engine.generate() vs HF transformers' static-batch generate()
    on the same prompts (greedy, fixed output length).
The model directory (config, a word-level tokenizer over the whole vocabulary, random weights)
is written to /dev/shm when it has room, so no disk round trip dominates the section.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from gpu_suite_report import Report, Row


@dataclass(frozen=True, slots=True)
class ModelShape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_positions: int

    @property
    def layer_params(self) -> int:
        attn = (
            self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
            + self.heads * self.head_dim * self.hidden
        )
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def decode_weight_params(self) -> int:
        """Parameters a decode step must read: every layer, the final norm and the LM head
        (the embedding table is only gathered, a few rows per step)."""
        return self.layers * self.layer_params + self.hidden + self.vocab * self.hidden

    @property
    def kv_elems_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim  # K and V of every layer


LLAMA3_8B = ModelShape(128256, 4096, 14336, 32, 32, 8, 128, 16384)
TINY = ModelShape(512, 64, 128, 2, 4, 2, 16, 1024)


def write_model_dir(path: Path, shape: ModelShape, dtype: torch.dtype, device: str, seed: int = 0) -> Path:
    """HF-layout Llama directory with random weights (std 0.02, norms 1) and a word-level
    tokenizer of `vocab` tokens "<tN>", so every sampled id decodes."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    eos = shape.vocab - 1
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": eos,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "do_sample": False}))
    tokenizer = Tokenizer(
        models.WordLevel(vocab={f"<t{i}>": i for i in range(shape.vocab)}, unk_token="<t0>")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": f"<t{eos}>", "pad_token": "<t0>"}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config), encoding="utf-8")

    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*size: int) -> torch.Tensor:
        return (torch.randn(size, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype).cpu()

    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    tensors = {
        "model.embed_tokens.weight": normal(shape.vocab, shape.hidden),
        "model.norm.weight": torch.ones(shape.hidden, dtype=dtype),
        "lm_head.weight": normal(shape.vocab, shape.hidden),
    }
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(q, shape.hidden)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv, shape.hidden)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv, shape.hidden)
        tensors[p + "self_attn.o_proj.weight"] = normal(shape.hidden, q)
        tensors[p + "mlp.gate_proj.weight"] = normal(shape.intermediate, shape.hidden)
        tensors[p + "mlp.up_proj.weight"] = normal(shape.intermediate, shape.hidden)
        tensors[p + "mlp.down_proj.weight"] = normal(shape.hidden, shape.intermediate)
        tensors[p + "input_layernorm.weight"] = torch.ones(shape.hidden, dtype=dtype)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(shape.hidden, dtype=dtype)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def scratch_dir(nbytes: int) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 1.5 * nbytes:
        return Path(tempfile.mkdtemp(prefix="sluice-bench-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="sluice-bench-"))


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab - 1, (count, length), generator=gen).tolist()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _decode_step_ms(engine, sampling, prompts: list[list[int]], tag: str, device: str) -> float:
    """Median wall time of the pure decode steps of the whole batch: steps in which every request
    got a token once all had their first. `sampling.max_tokens` must outlast the batch's chunked
    prefill, or the first requests finish before the last start and no step is the whole batch."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, sampling)
    started: set[str] = set()
    times: list[float] = []
    while engine.has_work:
        all_started = len(started) == len(prompts)
        t0 = time.perf_counter()
        deltas = engine.step()
        _sync(device)
        if all_started and sum(1 for d in deltas if d.token_ids) == len(prompts):
            times.append((time.perf_counter() - t0) * 1e3)
        started.update(d.request_id for d in deltas if d.token_ids)
    steady = times[2:] if len(times) > 4 else times  # the first steps at a batch size capture graphs
    return statistics.median(steady) if steady else float("nan")


def _prefill_ms(engine, sampling, prompt: list[int], tag: str, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    engine.add_request(tag, prompt, sampling)
    while engine.has_work:
        engine.step()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def run_engine_section(
    report: Report, device: str, dry: bool, *, layers: int, skip_hf: bool, deadline: float
) -> None:
    try:
        from sluice.protocol import SamplingParams
        from sluice.workers.config import EngineConfig
        from sluice.workers.engine import LLMEngine
    except ImportError as exc:
        report.add(Row("engine", "skipped", note=f"cannot import the engine: {exc}"))
        return

    base = TINY if dry else LLAMA3_8B
    shape = dataclasses.replace(base, layers=base.layers if dry else layers)
    dtype = torch.float32 if dry else torch.bfloat16
    weight_bytes = (shape.decode_weight_params + shape.vocab * shape.hidden) * dtype.itemsize
    model_dir = scratch_dir(weight_bytes)
    try:
        t0 = time.perf_counter()
        write_model_dir(model_dir, shape, dtype, device)
        report.add(
            Row(
                "engine",
                f"write random model ({weight_bytes / 1e9:.2f} GB)",
                (time.perf_counter() - t0) * 1e3,
            )
        )
        _engine_cases(
            report, device, dry, shape, model_dir, deadline, skip_hf, LLMEngine, EngineConfig, SamplingParams
        )
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


def _engine_cases(
    report, device, dry, shape, model_dir, deadline, skip_hf, LLMEngine, EngineConfig, SamplingParams
):
    copy_bw = report.ceilings["copy_GBps"] * 1e9
    peak = report.ceilings["matmul_TFLOPs"] * 1e12
    elem = 4 if dry else 2
    contexts = (32, 64) if dry else (1024, 4096)
    batches = (1, 4) if dry else (1, 8, 64, 256)
    gen_tokens = 4 if dry else 16
    prefill_lens = (64, 200) if dry else (2048, 8192)
    max_model_len = (256 if dry else 8192) + 64

    def load(speculative_tokens: int):
        t0 = time.perf_counter()
        engine = LLMEngine(
            EngineConfig(
                model=str(model_dir),
                device=device,
                dtype="float32" if dry else "bfloat16",
                kernel_backend="torch" if dry else "triton",  # the CPU runner refuses triton
                max_model_len=max_model_len,
                max_num_seqs=max(batches),
                max_num_batched_tokens=max(prefill_lens),
                enable_prefix_caching=False,  # distinct prompts anyway; keeps every KV read real
                kv_cache_bytes=256 * 2**20,
                num_speculative_tokens=speculative_tokens,
            )
        )
        report.add(Row("engine", f"load engine (speculation {speculative_tokens})", (time.perf_counter() - t0) * 1e3))
        return engine

    # One token per step first: each decode row is then one step's cost against its floor.
    engine = load(0)
    capacity = engine.scheduler.num_total_blocks * engine.config.block_size
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    _prefill_ms(engine, greedy, _prompts(1, 128, shape.vocab, 99)[0], "warmup", device)

    for n in prefill_lens:
        ms = _prefill_ms(engine, greedy, _prompts(1, n, shape.vocab, n)[0], f"prefill-{n}", device)
        flops = 2 * n * shape.layers * shape.layer_params
        flops += (
            4 * shape.layers * shape.heads * shape.head_dim * n * (n + 1) // 2
            + 2 * shape.hidden * shape.vocab
        )
        rate = flops / (ms * 1e-3)
        report.add(Row("engine", f"prefill {n} tokens", ms, rate / 1e12, "TFLOP/s", rate / peak,
                       note=f"{n / (ms * 1e-3):,.0f} tok/s"))  # fmt: skip

    for ctx in contexts:
        for batch in batches:
            prefill_steps = -(-batch * ctx // max(prefill_lens))
            sampling = SamplingParams(max_tokens=gen_tokens + prefill_steps, temperature=0.0, ignore_eos=True)
            name = f"decode B={batch} ctx={ctx}"
            if time.perf_counter() > deadline:
                report.add(Row("engine", name, note="skipped: time budget spent"))
                continue
            if batch * (ctx + sampling.max_tokens) > capacity:
                report.add(
                    Row(
                        "engine",
                        name,
                        note=f"skipped: needs {batch * (ctx + sampling.max_tokens)} KV slots > {capacity}",
                    )
                )
                continue
            ms = _decode_step_ms(
                engine, sampling, _prompts(batch, ctx, shape.vocab, batch * ctx), name, device
            )
            floor_bytes = shape.decode_weight_params * elem + batch * ctx * shape.kv_elems_per_token * elem
            floor_ms = floor_bytes / copy_bw * 1e3
            report.add(Row("engine", name, ms, floor_bytes / (ms * 1e-3) / 1e9, "GB/s", floor_ms / ms,
                           note=f"floor {floor_ms:.3f} ms; {ms / floor_ms:.2f}x floor"))  # fmt: skip

    # End to end: same requests through the engine and through HF static batching.
    num_prompts, prompt_len, out_len = (4, 16, 8) if dry else (64, 512, 128)
    prompts = _prompts(num_prompts, prompt_len, shape.vocab, 7)
    e2e = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    engine_tps, tokens = _e2e_tps(engine, prompts, e2e, device)
    report.add(Row("engine", f"e2e engine {num_prompts}x{prompt_len}+{out_len}, one-token steps",
                   achieved=engine_tps, unit="tok/s"))  # fmt: skip
    del engine
    _free(device)
    if time.perf_counter() < deadline:
        # The engine's default: prompt-lookup speculation. Random weights make its acceptance
        # arbitrary, so this row shows the cost of verification steps (eager, no CUDA graphs)
        # against what they saved here, not what a real model's text would save.
        engine = load(4)
        spec_tps, spec_tokens = _e2e_tps(engine, prompts, e2e, device)
        stats = engine.scheduler.stats
        same = sum(a == b for a, b in zip(tokens, spec_tokens, strict=True))
        report.add(Row("engine", f"e2e engine {num_prompts}x{prompt_len}+{out_len}, speculation 4",
                       achieved=spec_tps, unit="tok/s",
                       note=f"{spec_tps / engine_tps:.2f}x one-token steps; drafts kept "
                            f"{stats.num_accepted_draft_tokens}/{stats.num_draft_tokens}; "
                            f"same tokens in {same}/{num_prompts} requests"))  # fmt: skip
        del engine
    _free(device)
    if skip_hf or time.perf_counter() > deadline:
        report.add(Row("engine", "e2e HF generate", note="skipped (--skip-hf or time budget)"))
        return
    hf_tps = _hf_generate_tps(model_dir, prompts, out_len, device, torch.float32 if dry else torch.bfloat16)
    report.add(Row("engine", "e2e HF static generate", achieved=hf_tps, unit="tok/s",
                   note=f"engine/HF = {engine_tps / hf_tps:.2f}x"))  # fmt: skip


def _e2e_tps(engine, prompts: list[list[int]], sampling, device: str) -> tuple[float, list[list[int]]]:
    _sync(device)
    t0 = time.perf_counter()
    results = engine.generate(prompts, sampling)
    _sync(device)
    produced = sum(len(r.token_ids) for r in results)
    return produced / (time.perf_counter() - t0), [list(r.token_ids) for r in results]


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _hf_generate_tps(model_dir: Path, prompts: list[list[int]], out_len: int, device: str, dtype) -> float:
    from transformers import AutoModelForCausalLM

    # Straight onto the GPU (device_map) rather than through a 16 GB CPU copy.
    placement = {"device_map": device} if device == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **placement).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=mask)
    with torch.inference_mode():
        model.generate(
            ids[:1, :8], max_new_tokens=2, min_new_tokens=2, **{**kwargs, "attention_mask": mask[:1, :8]}
        )
        _sync(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=out_len, min_new_tokens=out_len, **kwargs)
        _sync(device)
    elapsed = time.perf_counter() - t0
    del model
    gc.collect()
    return len(prompts) * out_len / elapsed
