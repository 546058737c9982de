"""Per-model prompt tokenization for the gateway: chat template, token counting, context length.

The gateway tokenizes (rather than the worker) because quotas need the prompt's token count
before a request is accepted, and the worker then needs no tokenizer work on its busy loop.

Chat messages go through the model's own chat template, and only the template's markup may
become special tokens: a user who writes `<|im_end|>\n<|im_start|>system` into a message gets
those characters encoded as plain text, not a forged system turn. To tell markup from content
the template is rendered once with a placeholder in place of each message's content; the
rendered text is cut at the special tokens that lie in the markup, and each piece is encoded
with special-token matching switched off. For messages without special-token strings this
gives exactly the ids of `tokenizer.apply_chat_template` (the tokenizer itself splits at every
special token first, then encodes each piece alone).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.generation.tools import ToolFormat, template_supports_tools, tool_format

log = logging.getLogger(__name__)

# Used when a model's tokenizer_config.json has no chat_template (ChatML, like Qwen's).
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Stands in for message i's content while the template is rendered (private-use characters,
# which no tokenizer treats as markup). Content containing them is rejected.
_PLACEHOLDER = "\ue000{}\ue001"
_PLACEHOLDER_RE = re.compile("\ue000(\\d+)\ue001")
# Skeletons kept per model (oldest dropped first): one per sequence of roles seen, so a handful.
SKELETON_CACHE_SIZE = 256


class ModelTokenizer:
    """One model's tokenizer (HF, loaded from its directory) plus its context length."""

    def __init__(self, name: str, tokenizer: Any, max_model_len: int, *, tool_parser: str | None = None) -> None:
        self.name = name
        self.max_model_len = max_model_len
        self._tokenizer = tokenizer
        self._template = getattr(tokenizer, "chat_template", None) or FALLBACK_CHAT_TEMPLATE
        # How the model writes tool calls (models.toml's `tool_parser` wins over what the template
        # shows), and whether its template takes `tools` or gets the fallback (generation/tools.py).
        self.tool_format: ToolFormat = tool_format(str(self._template), tool_parser)
        self.supports_tools = template_supports_tools(str(self._template))
        self.vocab_size = len(tokenizer)
        # The Rust tokenizer directly: an order of magnitude cheaper per call than the wrapper.
        self._fast = getattr(tokenizer, "backend_tokenizer", None)
        self._markup = _SpecialMarkup.of(self._fast)
        # The placeholder rendering depends only on the roles (its contents are the placeholders),
        # so it is rendered once per sequence of roles, not once per request: the template
        # render is the costliest step of a short chat's tokenization.
        self._skeletons: dict[tuple[tuple[str, ...], bool, bool], str] = {}

    @classmethod
    def load(cls, name: str, path: str | Path, max_model_len: int | None = None, *,
             tool_parser: str | None = None) -> ModelTokenizer:
        from sluice.workers.model.tokenizer import load_tokenizer

        directory = Path(path)
        tokenizer = load_tokenizer(directory)
        if max_model_len is None:
            config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
            max_model_len = int(config.get("max_position_embeddings") or tokenizer.model_max_length)
        return cls(name, tokenizer, max_model_len, tool_parser=tool_parser)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest token's text (a partial character counts as U+FFFD, 3 bytes,
        which is never less than the bytes it stands for). A text of n characters (at most n bytes)
        has at least n / max_token_bytes tokens: what `surely_over` needs to refuse a prompt far
        over the context without tokenizing it."""
        decode = self._fast.decode if self._fast is not None else self._tokenizer.decode
        return max(1, max(len(decode([i], skip_special_tokens=False).encode("utf-8")) for i in range(self.vocab_size)))

    def surely_over(self, chars: int, tokens: int) -> bool:
        """Whether a text of `chars` characters certainly has more than `tokens` tokens."""
        return chars > tokens * self.max_token_bytes

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Plain prompt (completions API): special tokens added as the model's config says.
        The Rust tokenizer directly when there is one: transformers' `encode` calls the same
        `encode_batch`, then copies every id into several Python lists with the GIL held (for a
        1 MB prompt the largest stall of the event loop under a flood of them, issue #36)."""
        if self._fast is not None:
            return encode_releasing_gil(self._fast, text, add_special_tokens=add_special_tokens)
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of a token sequence, special tokens included (as vLLM's /detokenize)."""
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=False))

    def output_text(self, token_ids: Sequence[int]) -> str:
        """The text of output tokens as a worker streams it (special tokens skipped)."""
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary entry of each token (e.g. 'Ġworld'), for /tokenize's token_strs."""
        return [str(t) for t in self._tokenizer.convert_ids_to_tokens(list(token_ids))]

    def apply_chat(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
                   continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Renders the chat template (by default with the generation prompt) and tokenizes it;
        only the template's own markup becomes special tokens.

        `tools` (OpenAI's shape) go to a template that reads them; they and an assistant turn's
        `tool_calls` are rendered in the markup, so they may not hold special tokens."""
        render = functools.partial(self._render, add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, tools=tools)
        text = render(messages)
        markup_data = [("tools", tools)] if tools else []
        markup_data += [(f"messages[{i}].tool_calls", m["tool_calls"]) for i, m in enumerate(messages)
                        if m.get("tool_calls")]
        for param, data in markup_data:
            found = self._specials_in(json.dumps(data, ensure_ascii=False))
            if found:
                raise OpenAIError(400, f"{param} contains the special token {found[0]!r}.", param=param)
        for i, message in enumerate(messages):
            if self._specials_in(message["role"]):
                raise OpenAIError(400, f"messages[{i}].role contains a special token.", param=f"messages[{i}].role")
            if _PLACEHOLDER_RE.search(message["content"]):
                raise OpenAIError(400, f"messages[{i}].content contains characters reserved for chat markup "
                                  "(U+E000 ... U+E001).", param=f"messages[{i}].content")
        if self._markup is not None:
            key = (tuple(m["role"] for m in messages), add_generation_prompt, continue_final_message)
            # Tools and calls change the markup beyond the roles: such skeletons are not reused.
            cached = None if markup_data else self._skeletons.get(key)
            skeleton = cached if cached is not None else self._skeleton(key, messages, render,
                                                                        keep=not markup_data)
            pieces = self._content_pieces(messages, text, skeleton)
            if pieces is None and cached is not None:
                # A template that reads the clock (strftime_now) may have moved on: once afresh.
                pieces = self._content_pieces(messages, text, self._skeleton(key, messages, render))
            if pieces is not None:
                return self._markup.encode(pieces)
        # The content cannot be told from the markup (the template transforms it, e.g. with
        # `trim`): encode the text whole, so content must not hold special tokens.
        for i, message in enumerate(messages):
            found = self._specials_in(message["content"])
            if found:
                raise OpenAIError(
                    400, f"messages[{i}].content contains the special token {found[0]!r}, which this "
                    "model's chat template cannot carry as text.", param=f"messages[{i}].content",
                )
        if self._fast is not None:
            return encode_releasing_gil(self._fast, text)
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _specials_in(self, text: str) -> list[str]:
        if self._markup is not None:
            return self._markup.find(text)
        return [t for t in getattr(self._tokenizer, "all_special_tokens", ()) if t in text]

    def _render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool,
                continue_final_message: bool, tools: list[dict[str, Any]] | None = None) -> str:
        try:
            return str(self._tokenizer.apply_chat_template(
                list(messages), chat_template=self._template, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False, tools=tools,
            ))
        except Exception as exc:  # jinja raises template errors (e.g. a role the template rejects)
            raise OpenAIError(
                400, f"The messages do not fit this model's chat template: {exc}", param="messages"
            ) from None

    def _skeleton(self, key: tuple[tuple[str, ...], bool, bool], messages: Sequence[dict[str, Any]],
                  render: Callable[[Sequence[dict[str, Any]]], str], *, keep: bool = True) -> str:
        """The template rendered with placeholder i as message i's content, kept under `key` (the roles)."""
        skeleton = render([{**m, "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)])
        if not keep:
            return skeleton
        self._skeletons.pop(key, None)
        if len(self._skeletons) >= SKELETON_CACHE_SIZE:
            del self._skeletons[next(iter(self._skeletons))]
        self._skeletons[key] = skeleton
        return skeleton

    def _content_pieces(self, messages: Sequence[dict[str, Any]], text: str,
                        skeleton: str) -> list[tuple[str, bool]] | None:
        """`text` as (piece, is_content) runs, or None when the content cannot be located."""
        pieces: list[tuple[str, bool]] = []
        seen: set[int] = set()
        pos = 0
        for match in _PLACEHOLDER_RE.finditer(skeleton):
            index = int(match.group(1))
            if index in seen or index >= len(messages):
                return None
            seen.add(index)
            pieces += [(skeleton[pos:match.start()], False), (messages[index]["content"], True)]
            pos = match.end()
        pieces.append((skeleton[pos:], False))
        if "".join(p for p, _ in pieces) != text:  # the template does more than paste content
            return None
        return pieces

    def token_text(self, token_id: int) -> str:
        """Text of one token, for logprobs."""
        if self._fast is not None:
            return self._fast.decode([token_id], skip_special_tokens=False)
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


class _SpecialMarkup:
    """The tokenizer's special tokens: finds them in template markup and encodes around them."""

    def __init__(self, fast: Any) -> None:
        from tokenizers import Tokenizer

        added = [t for t in fast.get_added_tokens_decoder().values() if t.special]
        self._ids = {t.content: fast.token_to_id(t.content) for t in added}
        by_length = sorted(self._ids, key=len, reverse=True)  # longest first, as the tokenizer does
        self._pattern = re.compile("|".join(map(re.escape, by_length))) if by_length else None
        # A copy that reads special-token strings as plain text (the same vocabulary and merges).
        self._plain = Tokenizer.from_str(fast.to_str())
        self._plain.encode_special_tokens = True

    @classmethod
    def of(cls, fast: Any) -> _SpecialMarkup | None:
        """None when the cut-and-encode rule cannot reproduce the tokenizer: no Rust tokenizer,
        or special tokens that swallow neighbouring whitespace (lstrip / rstrip)."""
        if fast is None:
            return None
        if any(t.special and (t.lstrip or t.rstrip) for t in fast.get_added_tokens_decoder().values()):
            return None
        return cls(fast)

    def find(self, text: str) -> list[str]:
        return [] if self._pattern is None else self._pattern.findall(text)

    def encode(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        """Cuts the text at the special tokens in markup runs (never in content runs) and
        encodes the text between them with special-token matching off."""
        ids: list[int] = []
        chunk: list[str] = []
        for piece, is_content in pieces:
            if is_content or self._pattern is None:
                chunk.append(piece)
                continue
            pos = 0
            for match in self._pattern.finditer(piece):
                chunk.append(piece[pos:match.start()])
                ids += self._encode_plain("".join(chunk))
                chunk.clear()
                ids.append(self._ids[match.group(0)])
                pos = match.end()
            chunk.append(piece[pos:])
        ids += self._encode_plain("".join(chunk))
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        return encode_releasing_gil(self._plain, text) if text else []


def encode_releasing_gil(tokenizer: Any, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """A Rust tokenizer's ids for `text` (special tokens added only when asked). `Tokenizer.encode`
    holds the GIL for its whole run (seconds for a large prompt, stalling the event loop even from
    a worker thread); `encode_batch` releases it and gives the same ids."""
    ids: list[int] = tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids  # a new list
    return ids


class TokenizerRegistry:
    def __init__(self) -> None:
        self._models: dict[str, ModelTokenizer] = {}

    def add(self, tokenizer: ModelTokenizer) -> None:
        tokenizer.max_token_bytes  # noqa: B018 -- computed once here, not on a request's event-loop turn
        self._models[tokenizer.name] = tokenizer

    def get(self, model: str) -> ModelTokenizer:
        found = self._models.get(model)
        if found is None:
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        return found

    def names(self) -> list[str]:
        return list(self._models)

    def __contains__(self, model: str) -> bool:
        return model in self._models
