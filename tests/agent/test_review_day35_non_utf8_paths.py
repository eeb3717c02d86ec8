"""A model in a folder whose name is not UTF-8 (bytes Python keeps as surrogates, e.g. a Latin-1 name).

Its weights are mapped, so /proc/self/maps names the folder in its bytes: reading that file as UTF-8 failed
(UnicodeDecodeError), and with it every stage's load ("deskfleet: error: 'utf-8' codec can't decode byte
0xff"); the tokenizer was reported as "not a valid tokenizer file" because tokenizers took the path as UTF-8."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from deskfleet.agent import allocator, huge_pages
from deskfleet.controller import cli
from deskfleet.controller.tokenizer import ModelTokenizer
from tests.agent.test_huge_pages import MAPS

LATIN1_NAME = os.fsdecode(b"mod\xe8le")  # "modèle" in Latin-1


def test_maps_naming_a_file_in_latin1_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    maps = tmp_path / "maps"
    maps.write_bytes(MAPS.encode() + b"7f0004000000-7f0004100000 r--s 00000000 fe:00 99   /srv/mod\xe8le/w.bin\n"
                     + b"7f0005000000-7f0005100000 r-xp 00000000 fe:00 98   /usr/lib/libjemalloc.so.2\n")
    monkeypatch.setattr(huge_pages, "PROC_MAPS", maps)
    monkeypatch.setattr(huge_pages, "enabled", lambda: True)
    assert huge_pages.snapshot() == huge_pages.anonymous_regions(MAPS)
    assert allocator.in_use(maps) == "jemalloc"


@pytest.mark.skipif(sys.platform != "linux", reason="a file name that is not UTF-8 is a POSIX thing")
def test_generate_runs_a_model_in_a_folder_whose_name_is_not_utf8(tiny_export: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / LATIN1_NAME
    shutil.copytree(tiny_export, model)
    ModelTokenizer(model)  # was "tokenizer.json is not a valid tokenizer file"
    assert cli.main(["generate", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "3", "--json"]) == 0
    assert '"generated_tokens": 3' in capsys.readouterr().out


def test_a_tokenizer_file_that_cannot_be_read_is_named(tiny_export: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_export, model)
    read_text = Path.read_text

    def refused(self: Path, *args: object, **kwargs: object) -> str:
        if self.name == "tokenizer.json":
            raise PermissionError(13, "Permission denied", str(self))
        return read_text(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", refused)
    with pytest.raises(ValueError, match=r"tokenizer\.json cannot be read: Permission denied"):
        ModelTokenizer(model)  # a PermissionError went out of the CLI as a traceback
