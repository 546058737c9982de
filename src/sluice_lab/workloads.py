"""Request sets for `sluice bench engine`: what the engines are timed on.

- `chat` (the default): the conversations shipped in `data/chat_prompts.json` (written for this
  bench: several domains, short and long prompts, multi-turn, some sharing a long support-handbook
  system context), rendered by the model's own chat template, decoded with sampling
  (temperature 0.8, top_p 0.95, a seed per request) to long-tailed output lengths, ignore_eos.
- `code` and `translation`: the chat set's conversations of that domain only, sampled the same
  way: text that copies from its prompt, where prompt-lookup speculation can pay.
- `random`: random token ids, greedy (the bench's original workload). A small model fed noise falls
  into repetition loops that speculation drafts perfectly, so it flatters speculation; it is kept
  as a named scenario, reported beside `chat`, never instead of it.

Every request set is a function of the seed: both engines of a comparison get the same prompts,
output lengths and sampling settings.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from sluice.protocol import SamplingParams
from sluice_lab.loadgen.prompts import LengthDist

WORKLOADS = ("chat", "random", "code", "translation")
CHAT_TEMPERATURE = 0.8
CHAT_TOP_P = 0.95

Requests = list[tuple[list[int], int]]  # (prompt token ids, output tokens)


@dataclass(frozen=True, slots=True)
class Workload:
    """One request set and how it is decoded (temperature 0 = greedy)."""

    name: str
    requests: Requests
    temperature: float
    top_p: float
    seed: int

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sampling_params(self) -> list[SamplingParams]:
        """One per request; sampled requests get seeds seed*1_000_003 + i, so each differs and
        the set is reproducible."""
        if self.greedy:
            return [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in self.requests]
        return [SamplingParams(max_tokens=o, temperature=self.temperature, top_p=self.top_p, ignore_eos=True,
                               seed=self.seed * 1_000_003 + i)
                for i, (_, o) in enumerate(self.requests)]

    def peer_spec(self) -> dict[str, Any]:
        """What the peer's runner (vllm_runner.py, another interpreter) needs: plain JSON."""
        return {"requests": self.requests, "temperature": self.temperature, "top_p": self.top_p}

    def summary(self) -> dict[str, Any]:
        return {"num_requests": len(self.requests), "temperature": self.temperature, "top_p": self.top_p,
                "prompt_tokens": sum(len(p) for p, _ in self.requests),
                "output_tokens": sum(o for _, o in self.requests),
                "max_output_tokens": max(o for _, o in self.requests),
                "max_prompt_tokens": max(len(p) for p, _ in self.requests)}


def load_conversations(domain: str | None = None) -> tuple[list[list[dict[str, str]]], list[str]]:
    """The shipped conversations as chat messages (optionally one domain's), and their domains."""
    text = resources.files("sluice_lab").joinpath("data/chat_prompts.json").read_text(encoding="utf-8")
    data = json.loads(text)
    systems: dict[str, str] = data["system_contexts"]
    conversations, domains = [], []
    for conv in data["conversations"]:
        if domain is not None and conv["domain"] != domain:
            continue
        messages = [{"role": "system", "content": systems[conv["system"]]}] if conv["system"] else []
        for i, turn in enumerate(conv["turns"]):
            messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": turn})
        conversations.append(messages)
        domains.append(conv["domain"])
    return conversations, domains


def _chat_tokenizer(model_dir: str | Path) -> Any:
    """The model's tokenizer; one without a chat template (the demo model) gets the gateway's
    fallback, so every model renders chat the way sluice serves it."""
    from transformers import AutoTokenizer

    from sluice.gateway.generation.tokenization import FALLBACK_CHAT_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    return tokenizer


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The ids the gateway sends for these messages: the template's text, then encoded as is."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_requests(model_dir: str | Path, num: int, seed: int, output_len: LengthDist,
                  domain: str | None = None) -> Requests:
    """`num` requests cycling through the (shuffled) conversations, each rendered once by the
    model's chat template with the generation prompt; lengths drawn from `output_len`."""
    tokenizer = _chat_tokenizer(model_dir)
    conversations, _ = load_conversations(domain)
    if not conversations:
        raise ValueError(f"no shipped conversation of domain {domain!r}")
    rendered = [_render(tokenizer, c) for c in conversations]
    rng = random.Random(seed)
    order = list(range(len(rendered)))
    requests: Requests = []
    while len(requests) < num:
        rng.shuffle(order)
        requests.extend((list(rendered[i]), 0) for i in order[: num - len(requests)])
    return [(p, output_len.sample(rng)) for p, _ in requests]


def random_requests(num: int, seed: int, prompt_len: LengthDist, output_len: LengthDist, vocab: int) -> Requests:
    """Random token ids as prompts (the bench's original workload)."""
    import torch

    rng = random.Random(seed)
    prompt_lens = [prompt_len.sample(rng) for _ in range(num)]
    output_lens = [output_len.sample(rng) for _ in range(num)]
    gen = torch.Generator().manual_seed(seed)
    low = min(16, vocab - 1)  # skip the lowest ids, where tokenizers keep their special tokens
    return [(torch.randint(low, vocab, (p,), generator=gen).tolist(), o)
            for p, o in zip(prompt_lens, output_lens, strict=True)]


def make_workload(name: str, model_dir: str | Path, num: int, seed: int, prompt_len: LengthDist,
                  output_len: LengthDist, vocab: int) -> Workload:
    if name == "random":
        return Workload(name, random_requests(num, seed, prompt_len, output_len, vocab), 0.0, 1.0, seed)
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    domain = None if name == "chat" else name
    return Workload(name, chat_requests(model_dir, num, seed, output_len, domain), CHAT_TEMPERATURE, CHAT_TOP_P,
                    seed)


def chat_prompt_pool(model_dir: str | Path, seed: int) -> list[list[int]]:
    """Every shipped conversation rendered once, in a seeded order (latency points draw from it)."""
    tokenizer = _chat_tokenizer(model_dir)
    conversations, _ = load_conversations()
    rendered = [_render(tokenizer, c) for c in conversations]
    random.Random(seed + 1).shuffle(rendered)
    return rendered


class RandomPrompts:
    """Random token ids of a drawn length, greedy: `bench slo`'s original load, kept beside `chat`."""

    name = "random"
    temperature = 0.0
    top_p = 1.0

    def __init__(self, vocab: int) -> None:
        self._vocab = vocab

    def prompts(self, rng: random.Random, bounds: tuple[int, int], num: int) -> list[list[int]]:
        return [[rng.randrange(16, self._vocab) for _ in range(rng.randint(*bounds))] for _ in range(num)]


class ChatPrompts:
    """Natural chat prompts of a drawn length, sampled like `chat`: loads shaped in token lengths.

    Each shipped conversation whose rendered length lies within the bounds is used once per draw
    (shuffled). The rest are retrieval-style prompts: a shorter shipped conversation whose system
    message carries reference text (the shipped turns, from a random place, cycled) cut to a length
    drawn within the bounds. A bound below every conversation gets the shortest one.
    """

    name = "chat"
    temperature = CHAT_TEMPERATURE
    top_p = CHAT_TOP_P

    def __init__(self, model_dir: str | Path) -> None:
        self._tokenizer = _chat_tokenizer(model_dir)
        self._conversations, _ = load_conversations()
        self._rendered = [_render(self._tokenizer, c) for c in self._conversations]
        # The turns' text, encoded one turn at a time (the whole is longer than some models' context).
        turns = [m["content"] + "\n\n" for c in self._conversations for m in c if m["role"] != "system"]
        self._corpus = [i for ids in self._tokenizer(turns, add_special_tokens=False)["input_ids"] for i in ids]

    def prompts(self, rng: random.Random, bounds: tuple[int, int], num: int) -> list[list[int]]:
        low, high = bounds
        fitting = [ids for ids in self._rendered if low <= len(ids) <= high]
        rng.shuffle(fitting)
        shorter = [c for c, ids in zip(self._conversations, self._rendered, strict=True) if len(ids) < low]
        out = [list(ids) for ids in fitting[:num]]
        while len(out) < num:
            if not shorter:
                out.append(min(self._rendered, key=lambda ids: len(ids)).copy())
                continue
            out.append(self._with_reference(rng.choice(shorter), rng.randint(low, high), rng, high))
        rng.shuffle(out)
        return out

    def _with_reference(self, conversation: list[dict[str, str]], length: int, rng: random.Random,
                        high: int) -> list[int]:
        system = conversation[0]["content"] if conversation[0]["role"] == "system" else "You are a helpful assistant."
        turns = [m for m in conversation if m["role"] != "system"]

        def render(reference: list[int]) -> list[int]:
            text = f"{system}\n\nReference material:\n{self._tokenizer.decode(reference)}"
            return _render(self._tokenizer, [{"role": "system", "content": text}, *turns])

        need = max(0, length - len(render([])))
        start = rng.randrange(len(self._corpus))
        reference = [self._corpus[(start + i) % len(self._corpus)] for i in range(need)]
        ids = render(reference)
        while len(ids) > high and reference:  # decoding and encoding again may merge or split a few
            reference = reference[: len(reference) - (len(ids) - high)]
            ids = render(reference)
        return ids
