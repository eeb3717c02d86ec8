"""The exported model's tokenizer and chat template, without transformers (tokenizers + jinja2 only)."""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from deskfleet.common.json_file import JsonFileError, read_json_object
from deskfleet.common.model_spec import incomplete_export, load_manifest, model_file, verify_files

from .chat_template import ChatTemplateError, ChatTemplateRefusal, TemplateRenderer, render_isolated
from .token_bytes import TokenBytes

# ModelTokenizer encodes a text as a batch of one: tokenizers' encode holds the GIL for the whole text (a 266,000-
# character prompt tokenized in a worker thread held `serve`'s event loop, every client's stream, 0.17-0.2 s;
# encode_batch 0.01 s). With its thread pool off, that batch runs on the calling thread, and a child process started
# afterwards (the chat template's renderer) is not warned that the pool was used before a fork.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

__all__ = ["ChatMessage", "ChatTemplateError", "ModelTokenizer", "NotUtf8Error", "RenderedChat", "check_utf8"]

# Where render_chats stands in for a special token's text that a message holds: one code point of Unicode's
# plane 15 (private use) a special token, shifted past any that the template or a message holds itself.
_STAND_IN_BASE = 0xF0000
_STAND_IN_END = 0x10FFFE


class NotUtf8Error(ValueError):
    """Text that came from bytes that are not UTF-8 (Python keeps those as lone surrogates): not encodable."""


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system", "user" or "assistant"
    content: str


class RenderedChat(str):
    """A rendered conversation (render_chats); `typed` are the spans (start, end) of the text where a message's
    content, not the template, wrote a special token's text: encode() makes those text, not control tokens."""

    typed: tuple[tuple[int, int], ...]

    def __new__(cls, text: str, typed: tuple[tuple[int, int], ...] = ()) -> RenderedChat:
        rendered = super().__new__(cls, text)
        rendered.typed = typed
        return rendered


CHAT_TEMPLATE_FILE = "chat_template.jinja"


class ModelTokenizer:
    """Encodes prompts, decodes tokens and renders the chat template of an export folder."""

    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        for name in ("tokenizer.json", "tokenizer_config.json", CHAT_TEMPLATE_FILE):
            if (model_dir / name).exists() or (model_dir / name).is_symlink():
                model_file(model_dir, name)  # the prompt must never take in a file a folder links to
        if (model_dir / "manifest.json").is_file():
            _verify_tokenizer_files(model_dir)
        # Read here, parsed from the text: Tokenizer.from_file takes the path as UTF-8, and a folder name that is
        # not (undecodable bytes, which Python keeps as surrogates) was reported as a broken tokenizer file.
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path} is not a valid tokenizer file: not UTF-8 text ({error})") from None
        except OSError as error:
            raise ValueError(f"{path} cannot be read: {error.strerror or error}") from None
        try:
            self._tokenizer = Tokenizer.from_str(text)
        except Exception as error:  # tokenizers raises a bare Exception for a file it cannot read
            raise ValueError(f"{path} is not a valid tokenizer file: {error}") from error
        added = self._tokenizer.get_added_tokens_decoder()
        self._special_ids = {token_id for token_id, token in added.items() if token.special}
        # longest first: of "<|end|>" and "<|end|>x" the regex takes the longer where both match
        self._specials = sorted({token.content for token in added.values() if token.special and token.content},
                                key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, self._specials))) if self._specials else None
        self._text_tokenizer: Tokenizer | None = None  # special tokens' text encoded as text (_as_text)
        decoder = self._tokenizer.decoder
        self.token_bytes = TokenBytes(json.loads(decoder.__getstate__()) if decoder is not None else None,
                                      self._tokenizer.id_to_token,
                                      lambda token: self.decode([token], skip_special_tokens=False),
                                      {token_id: token.content for token_id, token in added.items()})
        config_path = model_dir / "tokenizer_config.json"
        config = read_json_object(config_path) if config_path.is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template_path = model_dir / CHAT_TEMPLATE_FILE
        try:
            self.chat_template: str | None = (template_path.read_text(encoding="utf-8") if template_path.is_file()
                                              else _configured_template(config.get("chat_template"), config_path))
        except UnicodeDecodeError as error:
            raise ChatTemplateError(f"{template_path} is not UTF-8 text: {error}") from None
        # what errors name the template by: its file, or the tokenizer config that holds it
        self._template_source = str(template_path) if template_path.is_file() else f"chat_template of {config_path}"
        # an export whose manifest names the template file that is gone: damaged, not a model without a template
        self._lost_template = template_path if self.chat_template is None and not template_path.exists() \
            and _manifest_names(model_dir, template_path.name) else None
        # where the template renders: a child process of its own for each call, or the one a chat keeps
        self.renderer: TemplateRenderer | None = None

    def require_chat_template(self, refusal: str) -> None:
        """ChatTemplateError unless the model has a chat template: `refusal` (the caller says what to do instead)
        for a model that has none, or, for an export that lost the file its manifest names, that it is incomplete
        (it said the model had no template, and generate ran on without a word)."""
        if self._lost_template is not None:
            raise ChatTemplateError(incomplete_export(self._lost_template))
        if not self.chat_template:
            raise ChatTemplateError(refusal)

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """At most how many characters of text one token stands for: its vocabulary entry's length, an upper bound
        (a byte-level entry holds a character per byte; a SentencePiece or WordPiece one its text and a marker)."""
        return max(map(len, self._tokenizer.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, the text of special tokens in it (e.g. "</s>") as those tokens, as transformers
        encodes it; except in a RenderedChat, where the special tokens' text that the messages held is text."""
        check_utf8(text, "the text")
        encoding = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        typed = text.typed if isinstance(text, RenderedChat) else ()
        if not typed:
            return list(encoding.ids)
        ids: list[int] = []
        for token, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            if token in self._special_ids and any(start < stop and begin < end for begin, stop in typed):
                ids += self._as_text(text[start:end])
            else:
                ids.append(token)
        return ids

    def token_starts(self, text: str) -> list[int]:
        """Where each token of encode(text) starts in `text`, in characters (a token the tokenizer adds, such as
        BOS, at 0); for plain text, not a RenderedChat."""
        return [start for start, _ in self._tokenizer.encode_batch([text], add_special_tokens=True)[0].offsets]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The chat template rendered as transformers renders it (sandboxed Jinja, same options), in a child
        process with a memory and a time limit (controller/chat_template.py)."""
        return self.render_chats([messages], add_generation_prompt)[0]

    def render_chats(self, conversations: list[list[ChatMessage]], add_generation_prompt: bool = True) -> list[str]:
        """render_chat of each conversation, all in one child process (`renderer`'s, when set)."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template")  # callers say what to do instead
        # A message holding a special token's text ("<|im_end|>", "</s>", typed, pasted or written by the
        # model as plain text) would end its turn or open another role once encoded (transformers' own
        # apply_chat_template + encode does): the template renders it as a stand-in, which comes back as that
        # text marked as typed, for encode() to keep as text. Conversations without any render as ever.
        contents = [message.content for messages in conversations for message in messages]
        typed = self._special_text is not None and any(self._special_text.search(text) for text in contents)
        base = _stand_in_base(len(self._specials), [self.chat_template, *contents]) if typed else None
        render = self.renderer.render if self.renderer is not None else render_isolated
        try:
            texts = render(self.chat_template, [
                {"messages": [{"role": m.role, "content": self._stand_ins(m.content, base)} for m in messages],
                 "add_generation_prompt": add_generation_prompt, "bos_token": self.bos_token or "",
                 "eos_token": self.eos_token or ""} for messages in conversations])
        except ChatTemplateRefusal:  # the template's words about the conversation: no file to fix
            raise
        except ChatTemplateError as error:  # which file to fix: "TemplateSyntaxError: ..." alone named none
            raise ChatTemplateError(f"{self._template_source}: {error}", error.conversation) from None
        return [self._restored(text, base) for text in texts]

    def end_of_turn_ids(self) -> frozenset[int]:
        """The special token the chat template writes right after an assistant's message: what ends a reply.
        Some models' generation config lists only the end of the whole text as EOS, not the end of a turn
        (ChatML's <|im_end|>, Gemma's <end_of_turn>); without it a reply runs on into turns the model invents.
        Empty when the template ends a turn with no special token or cannot render an exchange."""
        probe = "deskfleet end-of-turn probe"
        try:
            text = self.render_chat([ChatMessage("user", "Hello."), ChatMessage("assistant", probe)],
                                    add_generation_prompt=False)
        except ChatTemplateError:
            return frozenset()
        at = text.rfind(probe)
        if at < 0:
            return frozenset()
        for token in self.encode(str(text)[at + len(probe):], add_special_tokens=False):
            if token in self._special_ids:
                return frozenset({token})
            if self.decode([token], skip_special_tokens=False).strip():
                break  # text before any special token: this template ends a turn with text
        return frozenset()

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        """Token ids of a rendered conversation (the template writes its own special tokens)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def _stand_ins(self, content: str, base: int | None) -> str:
        if base is None or self._special_text is None:
            return content
        return self._special_text.sub(lambda match: chr(base + self._specials.index(match[0])), content)

    def _restored(self, text: str, base: int | None) -> RenderedChat:
        """The rendered text with each stand-in back as its special token's text, that text's spans typed."""
        if base is None:
            return RenderedChat(text)
        pieces, typed, length, last = [], [], 0, 0
        for match in re.finditer(f"[{chr(base)}-{chr(base + len(self._specials) - 1)}]", text):
            special = self._specials[ord(match[0]) - base]
            pieces += [text[last:match.start()], special]
            length += match.start() - last
            typed.append((length, length + len(special)))
            length += len(special)
            last = match.end()
        pieces.append(text[last:])
        return RenderedChat("".join(pieces), tuple(typed))

    def _as_text(self, text: str) -> list[int]:
        """`text` (a special token's text) encoded as text, as it encodes after a line break: not as the
        start of the input, where a SentencePiece tokenizer would put a space before it."""
        if self._text_tokenizer is None:
            self._text_tokenizer = Tokenizer.from_str(self._tokenizer.to_str())
            self._text_tokenizer.encode_special_tokens = True
        encoding = self._text_tokenizer.encode("\n" + text, add_special_tokens=False)
        if any(start < 1 < end for start, end in encoding.offsets):  # merged with the line break: take it alone
            return list(self._text_tokenizer.encode(text, add_special_tokens=False).ids)
        return [token for token, (start, _) in zip(encoding.ids, encoding.offsets, strict=True) if start >= 1]


def _stand_in_base(count: int, texts: list[str]) -> int:
    """The first of `count` consecutive code points from _STAND_IN_BASE on that none of `texts` holds."""
    used = {ord(character) for text in texts for character in text if ord(character) >= _STAND_IN_BASE}
    base = _STAND_IN_BASE
    while any(code in used for code in range(base, base + count)):
        base += count
    if base + count > _STAND_IN_END:
        raise ChatTemplateError("the conversation uses every private-use code point of planes 15 and 16")
    return base


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


def _verify_tokenizer_files(model_dir: Path) -> None:
    """An export's tokenizer files against its manifest: only the IR files were checked, so a lost or damaged
    tokenizer_config.json silently dropped the template's BOS and end tokens. Not chat_template.jinja: the one file
    an admin may edit in place (a template's fix); a lost one is named once a template is needed."""
    manifest = load_manifest(model_dir)
    names = [name for name in manifest.tokenizer_files if name in manifest.files and name != CHAT_TEMPLATE_FILE]
    for name in names:
        if not (model_dir / name).exists():
            raise FileNotFoundError(incomplete_export(model_dir / name))
    verify_files(model_dir, manifest, names)


def _manifest_names(model_dir: Path, name: str) -> bool:
    """Whether `model_dir`'s manifest.json (an export's) names the file `name`; False where there is none to read."""
    try:
        files = read_json_object(model_dir / "manifest.json").get("files")
    except (FileNotFoundError, JsonFileError):
        return False  # not an export, or one whose manifest loading the model names the fault of
    return isinstance(files, dict) and name in files


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
