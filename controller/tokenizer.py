"""The exported model's tokenizer and chat template, without transformers (tokenizers + jinja2 only)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from deskfleet.common.json_file import read_json_object
from deskfleet.common.model_spec import model_file

from .chat_template import ChatTemplateError, render_isolated

__all__ = ["ChatMessage", "ChatTemplateError", "ModelTokenizer", "NotUtf8Error", "check_utf8"]


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
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (model_dir / name).exists() or (model_dir / name).is_symlink():
                model_file(model_dir, name)  # the prompt must never take in a file a folder links to
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception for a file it cannot read
            raise ValueError(f"{path} is not a valid tokenizer file: {error}") from error
        config_path = model_dir / "tokenizer_config.json"
        config = read_json_object(config_path) if config_path.is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template_path = model_dir / "chat_template.jinja"
        try:
            self.chat_template: str | None = (template_path.read_text(encoding="utf-8") if template_path.is_file()
                                              else _configured_template(config.get("chat_template"), config_path))
        except UnicodeDecodeError as error:
            raise ChatTemplateError(f"{template_path} is not UTF-8 text: {error}") from None

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_utf8(text, "the text")
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The chat template rendered as transformers renders it (sandboxed Jinja, same options), in a child
        process with a memory and a time limit (controller/chat_template.py)."""
        return self.render_chats([messages], add_generation_prompt)[0]

    def render_chats(self, conversations: list[list[ChatMessage]], add_generation_prompt: bool = True) -> list[str]:
        """render_chat of each conversation, all in one child process."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template")  # callers say what to do instead
        return render_isolated(self.chat_template, [
            {"messages": [{"role": m.role, "content": m.content} for m in messages],
             "add_generation_prompt": add_generation_prompt, "bos_token": self.bos_token or "",
             "eos_token": self.eos_token or ""} for messages in conversations])

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


def _configured_template(value: object, config_path: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or transformers' list of named templates (the one
    named "default" is the chat template)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        if isinstance(named.get("default"), str):
            return str(named["default"])
        raise ChatTemplateError(f"{config_path}: chat_template lists no template named \"default\"")
    raise ChatTemplateError(f"{config_path}: chat_template must be a string or a list of named templates, "
                            f"not {type(value).__name__}")
