"""Build the corpus, train the shared tokenizer and pre-tokenize the data (CPU, ~1 minute).

Corpus: the Python standard library (PSF license) of the interpreter running this script.
The shipped models were built with CPython 3.11.7 (see settings.json).

Outputs
  <out>/tokenizer/        tokenizer.json, tokenizer_config.json, special_tokens_map.json
  <out>/data/*.npy        uint16 token streams: train_lib, train_test, valid, heldout
  <out>/data/manifest.json  every file used, its split and its sha256

Usage: python prepare.py --out .scratch
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 8192

# Special tokens, in id order (ids 0..5).
PAD, BOS, EOS = "<|pad|>", "<|begin|>", "<|end|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS]

# Every turn ends with <|end|>, which is also the EOS token: a reply ends when the model emits EOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# Held-out TEST modules (never trained on, never used for model selection): reported perplexity,
# completion prompts and draft acceptance all come from these. Their own unit tests are excluded too.
HELDOUT = ["textwrap", "fractions", "shlex", "graphlib", "colorsys", "calendar",
           "ipaddress", "difflib", "statistics", "json"]
# VALIDATION modules (never trained on), used only to watch the loss during training.
VALID = ["pprint", "sched", "queue", "reprlib", "fnmatch", "netrc", "getopt", "glob", "cmd", "shelve",
         "gettext", "bdb"]

# Not code, or not Python 3, or machine-generated tables.
EXCLUDE_PREFIXES = ("site-packages/", "lib2to3/tests/data/", "test/badsyntax", "test/bad_coding",
                    "pydoc_data/", "_sysconfigdata", "config-", "test/tokenizedata/",
                    "test/test_lib2to3/data/", "idlelib/idle_test/example")


def split_of(rel: str) -> str:
    parts = rel.split("/")
    top = parts[0][:-3] if parts[0].endswith(".py") else parts[0]
    if top == "test" and len(parts) > 1:
        name = parts[1][:-3] if parts[1].endswith(".py") else parts[1]
        for group, mods in (("heldout", HELDOUT), ("valid", VALID)):
            if any(name == f"test_{m}" for m in mods):
                return "excluded_" + group  # unit tests of held-out / valid modules: unused
        return "train_test"
    if top in HELDOUT:
        return "heldout"
    if top in VALID:
        return "valid"
    return "train_test" if "/test" in rel or "idle_test" in rel else "train_lib"


def collect(stdlib: Path) -> list[tuple[str, str, str]]:
    out = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).as_posix()
        if rel.startswith(EXCLUDE_PREFIXES) or "__pycache__" in rel:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if rel.startswith("encodings/") and "decoding_table" in text:
            continue  # charmap tables
        if not text.strip():
            continue
        out.append((rel, split_of(rel), text))
    return out


def build_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # cl100k-style split (handles indentation runs and punctuation well for code), then byte-level.
    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def write_tokenizer(tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                       "rstrip": False, "single_word": False, "special": True}
             for t in SPECIAL_TOKENS}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "add_bos_token": True, "add_eos_token": False,
        "additional_special_tokens": ROLE_TOKENS,
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    stm = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
           "additional_special_tokens": ROLE_TOKENS}
    (out / "special_tokens_map.json").write_text(json.dumps(stm, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".scratch")
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
    args = ap.parse_args()
    out = Path(args.out)
    files = collect(Path(args.stdlib))
    train_texts = [t for _, s, t in files if s.startswith("train")]
    tok = build_tokenizer(train_texts)
    write_tokenizer(tok, out / "tokenizer")
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)

    streams: dict[str, list[int]] = {"train_lib": [], "train_test": [], "valid": [], "heldout": []}
    manifest = []
    encs = tok.encode_batch([t for _, _, t in files], add_special_tokens=False)
    for (rel, split, text), enc in zip(files, encs):
        manifest.append({"file": rel, "split": split, "bytes": len(text.encode()),
                         "tokens": len(enc.ids),
                         "sha256": hashlib.sha256(text.encode()).hexdigest()})
        if split in streams:
            streams[split].extend([bos, *enc.ids, eos])
    (out / "data").mkdir(parents=True, exist_ok=True)
    summary = {"python": sys.version.split()[0], "stdlib": args.stdlib, "vocab_size": tok.get_vocab_size(),
               "special_ids": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}, "splits": {}}
    for name, ids in streams.items():
        np.save(out / "data" / f"{name}.npy", np.asarray(ids, dtype=np.uint16))
        nbytes = sum(m["bytes"] for m in manifest if m["split"] == name)
        summary["splits"][name] = {"files": sum(m["split"] == name for m in manifest),
                                   "bytes": nbytes, "tokens": len(ids)}
    summary["bytes_per_token_train"] = (
        sum(summary["splits"][s]["bytes"] for s in ("train_lib", "train_test"))
        / sum(summary["splits"][s]["tokens"] for s in ("train_lib", "train_test")))
    (out / "data" / "manifest.json").write_text(json.dumps({"summary": summary, "files": manifest}, indent=1))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
