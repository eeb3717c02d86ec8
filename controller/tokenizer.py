"""The exported model's tokenizer and chat template, without transformers (tokenizers + jinja2 only)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from deskfleet.common.json_file import read_json_object


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed."""


class NotUtf8Error(ValueError):
    """Text that came from bytes that are not UTF-8 (Python keeps those as lone surrogates): not encodable."""


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system", "user" or "assistant"
    content: str


class ModelTokenizer:
    """Encodes prompts, decodes tokens and renders the chat template of an export folder."""

    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception for a file it cannot read
            raise ValueError(f"{path} is not a valid tokenizer file: {error}") from error
        config_path = model_dir / "tokenizer_config.json"
        config = read_json_object(config_path) if config_path.is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template_path = model_dir / "chat_template.jinja"
        self.chat_template: str | None = (
            template_path.read_text(encoding="utf-8") if template_path.is_file() else config.get("chat_template"))

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_utf8(text, "the text")
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The chat template rendered as transformers renders it (sandboxed Jinja, same options)."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use a plain prompt")
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(message)

        environment.globals["raise_exception"] = raise_exception
        try:
            template = environment.from_string(self.chat_template)
            return template.render(messages=[{"role": m.role, "content": m.content} for m in messages],
                                   add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as error:
            raise ChatTemplateError(f"the chat template failed: {error}") from error

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        """Token ids of a rendered conversation (the template writes its own special tokens)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def check_utf8(text: str, what: str) -> None:
    """Raise NotUtf8Error naming `what` (e.g. "--prompt 1") when `text` holds bytes that were not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        character = text[error.start]
        shown = (f"byte 0x{ord(character) - 0xDC00:02x}" if 0xDC80 <= ord(character) <= 0xDCFF
                 else f"character {character!r}")
        raise NotUtf8Error(f"{what} is not valid UTF-8 text ({shown} at character {error.start})") from None


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value) if value is not None else None
