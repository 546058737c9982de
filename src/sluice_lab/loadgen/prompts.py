"""Length distributions and synthetic prompts for the load generator.

Prompts are synthesized from a fixed English word list so that their token count lands near a
target for common BPE tokenizers (most listed words are one token). When a tokenizer directory
is given, `PromptFactory` calibrates words per token against it, which makes targets close for
any model, including the demo model's small vocabulary.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

_WORD_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no more "
    "out up into do any your what time some can only other new about over such after first two "
    "also then them may these well most where through back years much before just good people "
    "work life day part world house system group number way water city market report "
    "model data result river music school table street light paper money family story history "
    "answer question summary document language translate context search agent code function "
    "value method server request token stream batch queue worker engine memory cache window"
)
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A token-count distribution: fixed, uniform (inclusive), lognormal, or values from a file.

    lognormal is parameterised by its median and sigma (of the underlying normal), clamped to
    [min, max]; file draws uniformly from a list of observed lengths.
    """

    kind: str
    value: int = 0
    low: int = 1
    high: int = 1
    median: float = 1.0
    sigma: float = 0.0
    values: tuple[int, ...] = ()

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        """A command-line spec: "fixed:N", "uniform:MIN:MAX" or "lognormal:MEDIAN:SIGMA[:MIN:MAX]"
        (ValueError naming the spec otherwise)."""
        kind, *fields = spec.split(":")
        try:
            nums = [float(f) for f in fields]
        except ValueError:
            nums = []
        counts = {"fixed": (1,), "uniform": (2,), "lognormal": (2, 4)}
        if kind not in counts or len(nums) not in counts[kind]:
            raise ValueError(f"bad length distribution {spec!r}; use fixed:N, uniform:MIN:MAX or "
                             "lognormal:MEDIAN:SIGMA[:MIN:MAX]")
        lengths = nums[2:] if kind == "lognormal" else nums  # the fields that are token counts
        if any(n != int(n) or n < 1 for n in lengths):
            raise ValueError(f"bad length distribution {spec!r}: lengths must be positive integers")
        if kind == "fixed":
            return cls("fixed", value=int(nums[0]))
        low, high = (int(n) for n in lengths) if lengths else (1, 1_000_000)
        if high < low:
            raise ValueError(f"bad length distribution {spec!r}: MIN must not exceed MAX")
        if kind == "uniform":
            return cls("uniform", low=low, high=high)
        median, sigma = nums[0], nums[1]
        if median < 1 or sigma < 0:
            raise ValueError(f"bad length distribution {spec!r}: MEDIAN must be >= 1 and SIGMA >= 0")
        return cls("lognormal", low=low, high=high, median=median, sigma=sigma)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.value
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        if self.kind == "lognormal":
            drawn = round(rng.lognormvariate(math.log(self.median), self.sigma))
            return min(self.high, max(self.low, drawn))
        return rng.choice(self.values)

    @property
    def mean(self) -> float:
        if self.kind == "fixed":
            return float(self.value)
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        if self.kind == "lognormal":
            return self.median * math.exp(self.sigma**2 / 2)
        return sum(self.values) / len(self.values)


def lengths_from_jsonl(path: Path, field: str) -> tuple[int, ...]:
    """Positive integer `field` of every JSON line of `path` (ValueError naming line and field)."""
    values: list[int] = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            value = row.get(field) if isinstance(row, dict) else None
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{path}:{number}: {field!r} must be a positive integer, got {value!r}")
            values.append(value)
    if not values:
        raise ValueError(f"{path}: no lengths found")
    return tuple(values)


class PromptFactory:
    """Builds prompts of approximately `n` tokens from the word list.

    `tokens_per_word` comes from the tokenizer when one is given (measured on a long sample);
    otherwise 1.0, which holds for the word list under GPT/Llama-style BPE vocabularies.
    """

    def __init__(self, tokenizer_dir: str | None = None, tokens_per_word: float = 1.0) -> None:
        self.tokens_per_word = tokens_per_word
        if tokenizer_dir:
            from tokenizers import Tokenizer

            path = Path(tokenizer_dir) / "tokenizer.json"
            if not path.is_file():
                raise ValueError(f"{tokenizer_dir}: no tokenizer.json to calibrate prompt lengths")
            sample = " ".join(random.Random(0).choices(WORDS, k=2000))
            encoded = Tokenizer.from_file(str(path)).encode(sample, add_special_tokens=False)
            self.tokens_per_word = len(encoded.ids) / 2000

    def make(self, n_tokens: int, rng: random.Random) -> str:
        words = max(1, round(n_tokens / self.tokens_per_word))
        return " ".join(rng.choices(WORDS, k=words))
