"""On a CUDA device: the Triton backend with CUDA graphs still reproduces HF greedy tokens.

float32 so the comparison with HF is exact in token ids; the tiny models' peaked logits leave
no near-ties for kernel rounding to flip. Skipped without CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.protocol import SamplingParams
from sluice.workers.config import EngineConfig
from sluice.workers.engine import LLMEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("speculative_tokens", [0, 4], ids=["one-token-steps", "speculation"])
@pytest.mark.parametrize("use_cuda_graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_triton_cuda_greedy_matches_hf(model_fixture: str, use_cuda_graphs: bool, speculative_tokens: int,
                                       request: pytest.FixtureRequest) -> None:
    from transformers import AutoModelForCausalLM

    model_dir: Path = request.getfixturevalue(model_fixture)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, 512, (n,), generator=gen).tolist() for n in (3, 17, 40, 70, 5, 33)]
    prompts += [[7, 8, 9, 10, 11] * 8, [20, 21] * 15]  # repeated text: prompt lookup drafts, some kept
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    expected = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                              eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32", max_model_len=128,
                                    num_kv_blocks=64, max_prefill_chunk=24, use_cuda_graphs=use_cuda_graphs,
                                    num_speculative_tokens=speculative_tokens))
    assert engine.runner.ops.backend == "triton"
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert [r.token_ids for r in engine.generate(prompts, sampling)] == expected
    assert (engine.scheduler.stats.num_draft_tokens > 0) == (speculative_tokens > 0)
