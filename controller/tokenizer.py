"""The exported model's tokenizer and chat template, without transformers (tokenizers + jinja2 only)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from tokenizers import Tokenizer

from deskfleet.common.json_file import read_json_object
from deskfleet.common.model_spec import model_file

# A rendered conversation is at most this long: a template that loops or multiplies its way past it is
# stopped (a model folder from elsewhere may carry one that fills the machine's memory).
MAX_RENDERED_CHARS = 4_000_000


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
        """The chat template rendered as transformers renders it (sandboxed Jinja, same options)."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use a plain prompt")
        environment = _ChatSandbox(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(message)

        environment.globals["raise_exception"] = raise_exception
        try:
            template = environment.from_string(self.chat_template)
            chunks, length = [], 0
            for chunk in template.generate(messages=[{"role": m.role, "content": m.content} for m in messages],
                                           add_generation_prompt=add_generation_prompt,
                                           bos_token=self.bos_token or "", eos_token=self.eos_token or ""):
                length += len(chunk)
                if length > MAX_RENDERED_CHARS:
                    raise ChatTemplateError(f"the chat template renders more than {MAX_RENDERED_CHARS} characters")
                chunks.append(chunk)
            return "".join(chunks)
        except ChatTemplateError:
            raise
        except (TemplateError, ArithmeticError, TypeError, ValueError, LookupError, AttributeError,
                RecursionError, MemoryError) as error:  # a template's own mistake, never a traceback
            raise ChatTemplateError(f"the chat template failed: {type(error).__name__}: {error}") from None

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


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """The sandbox transformers renders chat templates in, less what no chat template needs and a template
    from elsewhere could fill the memory with: lipsum, and a string or list multiplied past the output cap."""

    intercepted_binops = frozenset({"*"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals.pop("lipsum", None)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            sequence, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(sequence, str | list | tuple) and isinstance(times, int) \
                    and len(sequence) * times > MAX_RENDERED_CHARS:
                raise SecurityError(f"the chat template repeats a sequence past {MAX_RENDERED_CHARS} items")
        return super().call_binop(context, operator, left, right)


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
