"""Chat messages <-> token ids with the policy's own tokenizer and chat template.

Engines take token ids (:mod:`mars_megatron.rollout.engine`), agents speak in chat messages
(:mod:`mars_megatron.agents`); this is the one place that turns one into the other. Prompts longer than
``max_input_tokens`` (MarsRL caps agent input at 32k) are refused with the count, or, on request,
truncated in the middle, keeping the start (instructions, problem) and the end (the latest turn and the
assistant header the model continues from).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mars_megatron.agents.roles import Message

MAX_INPUT_TOKENS = 32768
"""MarsRL's evaluation cap on an agent's input."""


class PromptTooLongError(ValueError):
    """A templated prompt exceeds the input budget; carries both counts."""

    def __init__(self, num_tokens: int, max_input_tokens: int) -> None:
        super().__init__(f"prompt has {num_tokens} tokens, more than max_input_tokens={max_input_tokens}")
        self.num_tokens = num_tokens
        self.max_input_tokens = max_input_tokens


REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json")


def refuse_remote_code(model_dir: str | Path) -> None:
    """Refuse a model folder whose config asks transformers for code of its own (``auto_map``): mars never
    runs code that comes with a model, and transformers would otherwise ask on stdin whether to."""
    from mars_megatron.json_file import read_json

    for name in REMOTE_CODE_FILES:
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        try:
            data = read_json(path)
        except ValueError:
            continue  # unreadable: whoever reads it for real names it
        if isinstance(data, dict) and data.get("auto_map"):
            raise ValueError(
                f"{path}: field 'auto_map' asks to run the model folder's own Python code; mars runs no code "
                "from model files (use a model whose architecture transformers knows)"
            )


class ChatCodec:
    """Encodes chat messages into prompt ids (generation prompt appended) and decodes output ids."""

    def __init__(
        self, tokenizer: Any, *, max_input_tokens: int = MAX_INPUT_TOKENS, truncate: bool = False
    ) -> None:
        if max_input_tokens < 2:
            raise ValueError(f"max_input_tokens must be >= 2, got {max_input_tokens}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.max_input_tokens = max_input_tokens
        self.truncate = truncate

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **kwargs: Any) -> ChatCodec:
        """The tokenizer of ``model_dir``, checked once here: a folder that asks for remote code is refused,
        and a tokenizer or chat template that does not load, or templates a probe message into no tokens,
        is refused naming the folder (instead of failing, or prompting nothing, mid-run)."""
        from transformers import AutoTokenizer

        refuse_remote_code(model_dir)
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        except Exception as e:  # transformers raises many types (JSONDecodeError, KeyError, OSError, ...)
            raise ValueError(f"{model_dir}: the tokenizer does not load ({type(e).__name__}: {e})") from None
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"{model_dir}: the tokenizer has no chat template (chat_template.jinja)")
        codec = cls(tokenizer, **kwargs)
        try:
            probe = codec.encode([{"role": "user", "content": "1+1"}])
        except PromptTooLongError:
            return codec
        except Exception as e:  # jinja2's TemplateError, SecurityError, UndefinedError, ...
            raise ValueError(f"{model_dir}: the chat template fails ({type(e).__name__}: {e})") from None
        if not probe:
            raise ValueError(f"{model_dir}: the tokenizer and chat template turn a message into no tokens")
        return codec

    def encode(self, messages: Sequence[Message]) -> tuple[int, ...]:
        """Prompt ids for the assistant's next turn; raises :class:`PromptTooLongError` unless truncating."""
        encoded = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True
        )
        # transformers 5 returns a BatchEncoding here; older versions a plain list of ids
        ids = list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)
        if len(ids) <= self.max_input_tokens:
            return tuple(ids)
        if not self.truncate:
            raise PromptTooLongError(len(ids), self.max_input_tokens)
        tail = self.max_input_tokens // 4
        return tuple(ids[: self.max_input_tokens - tail] + ids[len(ids) - tail :])

    @property
    def end_of_turn(self) -> int:
        """The token that ends an assistant turn (where the engines stop)."""
        return int(self.tokenizer.eos_token_id)

    def encode_text(self, text: str) -> tuple[int, ...]:
        """Plain text as tokens, no chat template, no special tokens: what a tool's observation adds to a
        response after the turn that called it."""
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        """Output text without special tokens (end-of-turn markers); ``<think>`` tags are kept."""
        ids = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)  # numpy: Python ints
        return self.tokenizer.decode(ids, skip_special_tokens=True)
