"""Up-front checks of the benchmarks' arguments, naming the CLI option, so that a bad one fails before any
model is compiled or any variant has run (not in a runner process, nor after the rounds)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from deskfleet.common.atomic_file import cannot_make_file_in, regular_file_target

GENAI_IMPORT_TIMEOUT_S = 120.0  # openvino and its GenAI library load in 1-3 s; a cold disk takes longer


# Users (streams) a one-PC bench runs at once, at most: `bench serve --users 100000` grew its API clients' process to
# 360 MB in 27 s and never ended, `bench admission --running 100000` asked for ~9 GB of KV cache; a PC's engine
# runs 8 rows a micro-batch by default
MAX_BENCH_USERS = 256


def check_at_least(minimum: int, **options: int) -> None:
    """ValueError naming the first option below `minimum`; keyword names are the options' (new_tokens is
    --new-tokens)."""
    for name, value in options.items():
        if value < minimum:
            raise ValueError(f"{_option(name)} must be {minimum} or more, got {value}")


def check_each_at_least(minimum: int, option: str, values: Iterable[int]) -> None:
    """ValueError naming `option` when one of its values is below `minimum`."""
    values = list(values)
    bad = [value for value in values if value < minimum]
    if bad:
        raise ValueError(f"{option} values must be {minimum} or more, got {values}")


def check_genai_inputs(genai_model: Path | None, genai_python: Path | None) -> None:
    """The GenAI model folder exists, the GenAI python can be started (a path or a command on PATH) and imports
    openvino_genai (this process's python when none is given): else the GenAI rows failed only after
    deskfleet's had run, with the runner's traceback. A --genai-python without a --genai-model is refused, not
    ignored."""
    if genai_model is not None and not Path(genai_model).is_dir():
        what = "not a folder" if Path(genai_model).exists() else "no such folder"
        raise FileNotFoundError(f"--genai-model {genai_model}: {what} (an optimum-intel export)")
    if genai_python is not None and shutil.which(str(genai_python)) is None:
        raise FileNotFoundError(f"--genai-python {genai_python}: not an executable file (the python of the "
                                f"GenAI venv, e.g. made by scripts/genai_venv.sh)")
    if genai_model is None:
        if genai_python is not None:
            raise ValueError(f"--genai-python {genai_python} needs --genai-model (the model GenAI runs)")
        return
    python = str(genai_python) if genai_python is not None else sys.executable
    try:
        imported = subprocess.run([python, "-c", "import openvino_genai"], capture_output=True, text=True,
                                  timeout=GENAI_IMPORT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ValueError(f"{python} could not import openvino_genai: {error}") from None
    if imported.returncode != 0:
        last = (imported.stderr.strip().splitlines() or ["no message"])[-1]
        given = f"--genai-python {genai_python}" if genai_python is not None else f"this python ({python})"
        raise ValueError(f"{given} cannot import openvino_genai ({last}): give the python of the GenAI venv "
                         "(scripts/genai_venv.sh makes one) with --genai-python")


def check_output_file(option: str, path: Path | None) -> None:
    """`path` can be written whole (common/atomic_file.write_atomic): a regular file or none yet (a link: its
    target), in an existing folder where a file can be made (a path under /proc failed only once the benchmark had
    run: os.access says yes to root everywhere)."""
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"{option} {path} is a folder: give a file name")
    try:
        target = regular_file_target(path)
    except OSError as error:
        raise ValueError(f"{option} {path}: {error}: give a file name") from None
    parent = target.parent
    if not parent.is_dir():
        raise FileNotFoundError(f"{option} {path}: the folder {parent} does not exist")
    if (why := cannot_make_file_in(parent)) is not None:
        raise ValueError(f"{option} {path}: no file can be made in the folder {parent} ({why})")
    if (stream := _standard_stream_at(target)) is not None:
        raise ValueError(f"{option} {path} is this command's {stream}, which the report would replace (a file is "
                         f"written whole, under a new name, then renamed over the old): give a file of its own")


def _standard_stream_at(path: Path) -> str | None:
    """"standard output" or "standard error" where `path` is the file that stream writes to (`/proc/self/fd/1`, or
    the file the shell redirected it to): the JSON report on stdout went to the old file, which the rename
    unlinked, and was lost. None otherwise (a terminal or a pipe is never a regular file's target)."""
    try:
        written = os.stat(path)
    except OSError:
        return None  # not made yet: no stream writes there
    for descriptor, name in ((1, "standard output"), (2, "standard error")):
        try:
            stream = os.fstat(descriptor)
        except OSError:  # closed
            continue
        if (stream.st_dev, stream.st_ino) == (written.st_dev, written.st_ino):
            return name
    return None


def check_output_files(**paths: Path | None) -> None:
    """check_output_file for each option (`json_out=...`), and no two naming one file: the last written replaced
    the other's report without a word."""
    seen: dict[Path, str] = {}
    for name, path in paths.items():
        check_output_file(_option(name), path)
        if path is None:
            continue
        key = Path(os.path.realpath(path))
        if key in seen:
            raise ValueError(f"{seen[key]} and {_option(name)} name one file, {path}: give each its own")
        seen[key] = _option(name)


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")
