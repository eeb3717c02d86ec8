"""Rendering a model's chat template in a child process with a memory limit and a time limit.

A chat template is code that came with the model folder; transformers renders it in Jinja's sandbox, which
stops it reaching Python's internals but not filling the memory (a string doubled in a loop, a huge
format width, a power of a power). So the template runs here, as transformers runs it, in a child Python
with its address space capped at RENDER_MEMORY_BYTES (where the OS allows: not on Windows) and killed after
RENDER_TIMEOUT_S; a failure of the template in any form is a ChatTemplateError naming it. One child renders
every conversation of a call (about 50 ms to start), up to RENDER_BATCH_CONVERSATIONS of them or
RENDER_BATCH_CHARS of their text: more (a `generate --chat --prompts-file` of 600,000 lines took 24 s in one
child) go in as many children, so the time and memory limits bound a template's work on its conversations, not
the size of the caller's batch.

A chat renders a turn or two every message, and a child's start was most of a small model's wait for the first
token (70-90 ms of it on the demo model): `TemplateRenderer` keeps one child for the whole chat, under the same
memory limit, the time limit holding per request. A request that times out, is interrupted (Ctrl-C) or leaves the
child unsure (MemoryError) ends that child; the next request starts another.

Run as `python -m deskfleet.controller.chat_template`: a JSON request on stdin, a JSON answer on stdout; with
`--serve`, one JSON request a line, one JSON answer a line, until stdin ends.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import IO, Any

RENDER_TIMEOUT_S = 10.0
RENDER_MEMORY_BYTES = 2 << 30  # the child's whole address space, Python included
MAX_RENDERED_CHARS = 4_000_000  # one rendered conversation
# A child's share of a call: 10,000 one-line prompts render in about 0.3 s, 30x within the time limit, and
# 64M characters of messages stay well within its memory limit as the request, its parsed copy and the texts.
RENDER_BATCH_CONVERSATIONS = 10_000
RENDER_BATCH_CHARS = 64_000_000


class ChatTemplateError(ValueError):
    """The model has no usable chat template, or the template failed or refused the conversation. `conversation`:
    which of the conversations a render was given it failed on (from 0), where it failed on one."""

    def __init__(self, message: str, conversation: int | None = None) -> None:
        super().__init__(message)
        self.conversation = conversation


class ChatTemplateRefusal(ChatTemplateError):
    """The template refused the conversation with its own words (its raise_exception, e.g. "roles must
    alternate"): a message for the user about the conversation, not a fault of the template file."""


def render_isolated(template: str, conversations: list[dict[str, Any]]) -> list[str]:
    """Each conversation's `template.render(**conversation)`, rendered in child processes (one per batch)."""
    return _render_batches(conversations, lambda batch: _render_in_child(template, batch))


class TemplateRenderer:
    """One child process rendering every request, under render_isolated's limits (see the module's doc). A context
    manager: leaving it ends the child."""

    def __init__(self) -> None:
        self._child: subprocess.Popen[str] | None = None
        self._answers: queue.Queue[str | None] = queue.Queue()
        self._errors: IO[bytes] | None = None  # the child's stderr, for what a crash said
        self._reader: threading.Thread | None = None

    def __enter__(self) -> TemplateRenderer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        """The running child's process id (None when none runs)."""
        return self._child.pid if self._child is not None else None

    def render(self, template: str, conversations: list[dict[str, Any]]) -> list[str]:
        """Each conversation's `template.render(**conversation)`, as render_isolated gives it."""
        return _render_batches(conversations, lambda batch: self._render_batch(template, batch))

    def close(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        child.kill()
        child.wait()
        # The reader sees the end of the dead child's output and stops; only then is its pipe closed here (closing a
        # text stream another thread is reading is not safe)
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.join(RENDER_TIMEOUT_S)
        streams = [child.stdin, self._errors] + ([child.stdout] if reader is None or not reader.is_alive() else [])
        for stream in streams:
            if stream is not None:
                try:
                    stream.close()
                except OSError:  # a request left unsent in the buffer of the pipe to a child that is gone
                    pass
        self._errors = None

    def _render_batch(self, template: str, conversations: list[dict[str, Any]]) -> list[str]:
        child = self._started()
        assert child.stdin is not None
        try:
            child.stdin.write(json.dumps({"template": template, "conversations": conversations}) + "\n")
            child.stdin.flush()
            line = self._answers.get(timeout=RENDER_TIMEOUT_S)
        except queue.Empty:
            self.close()
            raise ChatTemplateError(f"the chat template took more than {RENDER_TIMEOUT_S:.0f} s to render") from None
        except OSError:  # the child ended before it took the request
            line = None
        except BaseException:  # Ctrl-C: its answer would come as the next request's
            self.close()
            raise
        if line is None:
            said = self._said()
            self.close()
            raise ChatTemplateError("the chat template failed while rendering (its child ended; it may have needed "
                                    f"more than {RENDER_MEMORY_BYTES >> 30} GiB): {said or child.returncode}")
        answer = json.loads(line)
        if answer.get("ended"):  # the child answered and left (a MemoryError leaves it unsure of its state)
            self.close()
        if "error" in answer:
            raise _error_of(answer)
        return [str(text) for text in answer["texts"]]

    def _started(self) -> subprocess.Popen[str]:
        if self._child is not None and self._child.poll() is not None:
            self.close()  # it ended between requests (killed from outside): this request gets a new one
        if self._child is None:
            self._answers = queue.Queue()  # nothing a killed child wrote is read as an answer
            self._errors = tempfile.TemporaryFile()
            # A session (a process group on Windows) of its own: the terminal's Ctrl-C, which stops a reply and
            # which the chat survives, goes to the foreground group, and would kill the child between requests.
            isolation: dict[str, Any] = {"start_new_session": True}
            if sys.platform == "win32":
                isolation = {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP}
            child = subprocess.Popen([sys.executable, "-m", "deskfleet.controller.chat_template", "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._errors, text=True,
                                     encoding="utf-8", **isolation)
            self._reader = threading.Thread(target=_read_answers, args=(child.stdout, self._answers), daemon=True,
                                            name="chat-template-answers")
            self._reader.start()
            self._child = child
        return self._child

    def _said(self) -> str:
        """The end of what the child wrote to stderr (a crash's traceback)."""
        if self._errors is None:
            return ""
        try:
            self._errors.seek(0)
            return self._errors.read().decode("utf-8", "replace").strip()[-300:]
        except OSError:
            return ""


def _read_answers(stdout: IO[str] | None, answers: queue.Queue[str | None]) -> None:
    """Every line the child writes, then None when it ends (the queue is the renderer's for this child only)."""
    assert stdout is not None
    try:
        for line in stdout:
            answers.put(line)
    except (OSError, ValueError):  # a pipe that broke
        pass
    answers.put(None)


def _render_batches(conversations: list[dict[str, Any]],
                    render: Callable[[list[dict[str, Any]]], list[str]]) -> list[str]:
    """`render` of each batch (_batches), in order; an error's `conversation` counted in all of them."""
    texts: list[str] = []
    for batch in _batches(conversations):
        try:
            texts += render(batch)
        except ChatTemplateError as error:
            if error.conversation is not None:
                error.conversation += len(texts)
            raise
    return texts


def _batches(conversations: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """`conversations` in order, in batches of at most RENDER_BATCH_CONVERSATIONS and RENDER_BATCH_CHARS of
    message text (a conversation longer than that alone is a batch of its own)."""
    batches: list[list[dict[str, Any]]] = []
    batch: list[dict[str, Any]] = []
    chars = 0
    for conversation in conversations:
        size = sum(len(str(message.get("content", ""))) for message in conversation.get("messages", ()))
        if batch and (len(batch) == RENDER_BATCH_CONVERSATIONS or chars + size > RENDER_BATCH_CHARS):
            batches.append(batch)
            batch, chars = [], 0
        batch.append(conversation)
        chars += size
    return [*batches, batch] if batch else batches


def _render_in_child(template: str, conversations: list[dict[str, Any]]) -> list[str]:
    request = json.dumps({"template": template, "conversations": conversations})
    try:
        done = subprocess.run([sys.executable, "-m", "deskfleet.controller.chat_template"], input=request,
                              capture_output=True, text=True, encoding="utf-8", timeout=RENDER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ChatTemplateError(f"the chat template took more than {RENDER_TIMEOUT_S:.0f} s to render") from None
    try:
        answer = json.loads(done.stdout)
    except json.JSONDecodeError:  # killed: the memory cap, or a signal
        raise ChatTemplateError(f"the chat template failed while rendering (it may have needed more than "
                                f"{RENDER_MEMORY_BYTES >> 30} GiB): {done.stderr.strip()[-300:] or done.returncode}"
                                ) from None
    if "error" in answer:
        raise _error_of(answer)
    return [str(text) for text in answer["texts"]]


def _error_of(answer: dict[str, Any]) -> ChatTemplateError:
    """The error a child's answer carries, a refusal as such, with the conversation it failed on."""
    conversation = answer.get("conversation")
    return (ChatTemplateRefusal if answer.get("refused") else ChatTemplateError)(
        str(answer["error"]), conversation if isinstance(conversation, int) else None)


# The child's side

def _render_all(template: str, conversations: list[dict[str, Any]]) -> list[str]:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class TemplateRaised(Exception):
        pass

    def raise_exception(message: str) -> None:
        raise TemplateRaised(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    texts: list[str] = []
    compiled = None
    try:
        compiled = environment.from_string(template)
        for conversation in conversations:  # an error below names this one: len(texts)
            chunks, length = [], 0
            for chunk in compiled.generate(**conversation):
                length += len(chunk)
                if length > MAX_RENDERED_CHARS:
                    raise ChatTemplateError(f"the chat template renders more than {MAX_RENDERED_CHARS} characters",
                                            len(texts))
                chunks.append(chunk)
            texts.append("".join(chunks))
    except TemplateRaised as error:  # the template's own refusal, e.g. roles that do not alternate
        raise ChatTemplateRefusal(f"the chat template refused the conversation: {error}", len(texts)) from None
    except (TemplateError, ArithmeticError, TypeError, ValueError, LookupError, AttributeError,
            RecursionError) as error:  # a MemoryError goes up to main(): the cap, said as such
        if isinstance(error, ChatTemplateError):
            raise
        failed_on = len(texts) if compiled is not None else None  # one that does not compile fails on none
        raise ChatTemplateError(f"the chat template failed: {type(error).__name__}: {error}", failed_on) from None
    return texts


def main() -> int:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (RENDER_MEMORY_BYTES, RENDER_MEMORY_BYTES))
    except (ImportError, ValueError, OSError):  # Windows has no resource module: the timeout still holds
        pass
    if sys.argv[1:] != ["--serve"]:
        sys.stdout.write(json.dumps(_answer(sys.stdin.read())))
        return 0
    if hasattr(signal, "SIGINT"):  # a Ctrl-C meant for the chat never ends the renderer (see TemplateRenderer)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    for line in sys.stdin:
        answer = _answer(line)
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
        if answer.get("ended"):
            return 0
    return 0


def _answer(request_text: str) -> dict[str, Any]:
    request = json.loads(request_text)
    try:
        return {"texts": _render_all(request["template"], request["conversations"])}
    except ChatTemplateError as error:
        return {"error": str(error), "refused": isinstance(error, ChatTemplateRefusal),
                "conversation": error.conversation}
    except MemoryError:  # the child ends after answering: what the failed allocations left is not to be trusted
        return {"error": f"the chat template needed more than {RENDER_MEMORY_BYTES >> 30} GiB to render", "ended": True}


if __name__ == "__main__":
    sys.exit(main())
