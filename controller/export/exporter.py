"""`deskfleet export`: a Hugging Face checkpoint -> one OpenVINO IR per layer plus embed, head and rope.

The export is plan-independent: any split of the layers into stages is fused from these files on the
agents. Weights are compressed with ONE policy for every decoder layer (INT4 on every MatMul, the
down_proj included), so every plan computes the same model; a per-stage default of NNCF would keep each
stage's last MatMul at 8 bits and make the weights depend on where the split falls.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import jinja2
import openvino as ov
import torch

from deskfleet.common.console import ctrl_c_held
from deskfleet.common.json_file import JsonFileError, read_json_object
from deskfleet.common.model_spec import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    TensorNames,
    WeightFormat,
    sha256_of,
)

from .hf_config import CheckpointConfig, auto_map_code, not_a_file, read_checkpoint_config
from .modules import DecoderLayer, Embed, Head, RopeAndMask
from .output_folder import (
    ExportError,
    FinishedExportKept,
    check_no_running_export,
    check_output,
    ending_signals_clean_up,
    flush_to_disk,
    held,
    is_empty_folder,
    make_staging_folder,
    missing_parents,
    move_into_place,
    remove_empty_folders,
    remove_stale_folders,
)
from .output_folder import ExportInterrupted as ExportInterrupted  # raised through export_checkpoint
from .rope import rope_tables
from .weights import CheckpointWeights

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int, str], None]


# Public methods

def export_checkpoint(model_dir: Path, out_dir: Path, weight_format: WeightFormat = WeightFormat.INT4,
                      max_context: int | None = None, overwrite: bool = False,
                      progress: ProgressCallback | None = None) -> Manifest:
    """Export `model_dir` into `out_dir` and return the manifest written there.

    Writes into a hidden sibling folder and renames it into place at the end, so an interrupted export
    never leaves `out_dir` looking complete; SIGTERM and SIGHUP remove that folder before they end the
    process, and what a killed export left unfinished there goes with the next export to `out_dir`. An existing
    `out_dir` is replaced only with `overwrite`, checked again at the end: a folder made there while the
    export ran is never replaced without it; the finished export is then kept beside it and the
    ExportError says where.
    """
    model_dir = Path(model_dir)
    try:
        # Absolute and normalised: the staging folder's name is derived from out_dir's, and "-o ." has none
        # (nor can "." be renamed onto).
        out_dir = Path(os.path.abspath(out_dir))
    except FileNotFoundError:  # a relative path, from a working directory that was removed (an export swapped)
        raise ExportError(f"cannot tell where {out_dir} is: the working directory no longer exists (cd into "
                          "it again)") from None
    if not model_dir.is_dir():
        raise ExportError(_not_a_checkpoint_folder(model_dir))
    for what, path in (("checkpoint folder", model_dir.absolute()), ("output folder", out_dir)):
        try:
            str(path).encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8, kept by Python as lone surrogates
            # transformers and tokenizers take paths as UTF-8 text: the tokenizer would fail, after every layer
            shown = str(path).encode("utf-8", "backslashreplace").decode("utf-8")
            raise ExportError(f"the {what} {shown} has a name that is not UTF-8 text (bytes of another encoding): "
                              "the tokenizer cannot be read or written there; rename it, or choose another") from None
    if (model_dir / MANIFEST_NAME).is_file():
        raise ExportError(f"{model_dir} is already a deskfleet export (it holds {MANIFEST_NAME}): give the Hugging "
                          "Face checkpoint folder it was exported from")
    # an empty folder the user made for the export is filled, not refused ("already exists; pass --overwrite"); it
    # is replaced as --overwrite replaces one, so that one filled meanwhile is left as it is, the export kept beside
    overwrite = overwrite or is_empty_folder(out_dir)
    check_output(model_dir, out_dir, overwrite)
    check_no_running_export(out_dir)
    config = read_checkpoint_config(model_dir, max_context)
    tokenizer = _load_tokenizer(model_dir)
    if len(tokenizer) > config.spec.vocab_size:  # e.g. a special token added without resizing the model
        log.warning("the tokenizer of %s has %d tokens, more than the model's vocabulary of %d: prompts holding "
                    "the extra ones will be refused", model_dir, len(tokenizer), config.spec.vocab_size)
    with CheckpointWeights(model_dir) as weights:
        weights.check(config)  # every tensor there, of the config's shapes: refused before hours of export
    with ending_signals_clean_up() as stop_if_signalled:
        remove_stale_folders(out_dir)
        made = missing_parents(out_dir)  # `-o new/a/b/out`: an export that fails leaves no empty new/a/b
        try:
            staging = make_staging_folder(out_dir, overwrite)
        except ExportError:
            remove_empty_folders(made)
            raise
        def report(done: int, total: int, name: str) -> None:
            stop_if_signalled()
            if progress is not None:
                progress(done, total, name)

        with held(staging):
            try:
                check_no_running_export(out_dir)  # again, now that this one's folder is held: one began meanwhile
                manifest = _export_into(model_dir, staging, config, weight_format, tokenizer, report)
                try:
                    flush_to_disk(staging)
                except OSError as error:  # ENOSPC or EIO from a data write the file system had put off
                    raise _write_error("the files", staging, error) from error
                move_into_place(model_dir, staging, out_dir, overwrite)
            except FinishedExportKept:
                raise  # hours of work, named in the message: the user may still move it into place
            except BaseException:
                # A second Ctrl-C waits for the end of this (a third stops it): cut short, it would leave half an
                # export behind the "no unfinished export is left behind" that the first one's line then says
                with ctrl_c_held():
                    shutil.rmtree(staging, ignore_errors=True)
                    remove_empty_folders(made)
                raise
    log.info("exported %s (%d layers, %s) to %s", model_dir.name, config.spec.num_layers,
             weight_format.value, out_dir)
    return manifest


def model_name_of(model_dir: Path) -> str:
    """The model's name for its manifest (and so its deployments' model id): the checkpoint folder's name, or the
    model's where the folder is a Hugging Face cache snapshot (models--ORG--NAME/snapshots/COMMIT), whose own name
    is a commit hash (exported as "0123456789abcdef...", a fleet's model listed by it)."""
    resolved = model_dir.resolve()
    repository = resolved.parent.parent.name
    if resolved.parent.name == "snapshots" and repository.startswith("models--") and repository.count("--") >= 2:
        return repository.rsplit("--", 1)[1]
    return resolved.name


# Private methods

def _not_a_checkpoint_folder(model_dir: Path) -> str:
    """Why `model_dir`, no folder, cannot be exported. A Hugging Face model name given as MODEL_DIR (`deskfleet export
    meta-llama/Llama-3.1-8B`) was told it "is not a folder", as if something were there: export downloads nothing."""
    if model_dir.is_symlink() and not model_dir.exists():
        return f"{model_dir} is a broken link (to {os.readlink(model_dir)}): give the checkpoint folder it should name"
    if os.path.lexists(model_dir):
        return f"{model_dir} is not a folder: give the Hugging Face checkpoint folder (the one holding config.json)"
    parts = model_dir.parts
    looks_like_a_name = len(parts) == 2 and not model_dir.is_absolute() and not {".", ".."} & set(parts)
    name = model_dir.as_posix() if looks_like_a_name else "ORG/MODEL"
    return (f"{model_dir} does not exist: export takes a Hugging Face model folder already downloaded to this PC "
            f"(config.json, safetensors, tokenizer), and downloads nothing itself; download it first, e.g. "
            f"`hf download {name} --local-dir models/{model_dir.name if looks_like_a_name else 'MODEL'}`, and give "
            "that folder")


def _export_into(model_dir: Path, staging: Path, config: CheckpointConfig, weight_format: WeightFormat,
                 tokenizer: PreTrainedTokenizerBase, progress: ProgressCallback | None) -> Manifest:
    spec = config.spec
    total = spec.num_layers + 4  # rope, embed, layers, head, tokenizer
    step = 0

    def report(name: str) -> None:
        nonlocal step
        step += 1
        if progress is not None:
            progress(step, total, name)

    torch.manual_seed(0)
    with CheckpointWeights(model_dir) as weights:
        cos, sin = rope_tables(config)
        rope = _convert(RopeAndMask(cos, sin), _rope_example(spec.max_context), [[-1, -1], [-1, -1]],
                        [TensorNames.POSITION_IDS, TensorNames.ATTENTION_MASK],
                        [TensorNames.COS, TensorNames.SIN, TensorNames.ATTENTION_BIAS])
        # The RoPE table stays f32 and out of weight compression (NNCF would take it for an embedding).
        _write_ir(rope, staging / f"{Manifest.ROPE_IR}.xml", compress_to_fp16=False)
        report(Manifest.ROPE_IR)

        embed = _convert(Embed(weights.get("model.embed_tokens.weight")),
                         (torch.zeros(1, 2, dtype=torch.int64),), [[-1, -1]],
                         [TensorNames.INPUT_IDS], [TensorNames.EMBED_OUT])
        _save(embed, staging / f"{Manifest.EMBED_IR}.xml", weight_format, is_decoder_layer=False)
        report(Manifest.EMBED_IR)

        hidden, kv_heads, head_dim = spec.hidden_size, spec.num_kv_heads, spec.head_dim
        layer_shapes = [[-1, -1, hidden], [-1, 1, -1, -1], [-1, -1, head_dim], [-1, -1, head_dim],
                        [-1, kv_heads, -1, head_dim], [-1, kv_heads, -1, head_dim]]
        for index in range(spec.num_layers):
            layer = _convert(DecoderLayer(config, weights, index), _layer_example(config), layer_shapes,
                             [TensorNames.layer_hidden_in(index), TensorNames.ATTENTION_BIAS,
                              TensorNames.COS, TensorNames.SIN,
                              TensorNames.past("key", index), TensorNames.past("value", index)],
                             [TensorNames.layer_hidden_out(index),
                              TensorNames.present("key", index), TensorNames.present("value", index)])
            _save(layer, staging / f"{Manifest.layer_ir(index)}.xml", weight_format, is_decoder_layer=True)
            report(Manifest.layer_ir(index))

        head = _convert(Head(config, weights), (torch.zeros(1, 2, spec.hidden_size),), [[-1, -1, hidden]],
                        [TensorNames.HEAD_IN],
                        [TensorNames.LOGITS, TensorNames.NEXT_TOKENS])
        _save(head, staging / f"{Manifest.HEAD_IR}.xml", weight_format, is_decoder_layer=False)
        report(Manifest.HEAD_IR)

    tokenizer_files = _save_tokenizer(model_dir, tokenizer, staging)
    report("tokenizer")
    files = {path.name: FileEntry(sha256=sha256_of(path), size=path.stat().st_size)
             for path in sorted(staging.iterdir()) if path.name != MANIFEST_NAME}
    manifest = Manifest(
        model_name=model_name_of(model_dir),
        spec=spec,
        weight_format=weight_format,
        files=files,
        tokenizer_files=tokenizer_files,
        layer_bytes=tuple(files[f"{Manifest.layer_ir(i)}.bin"].size for i in range(spec.num_layers)),
        embed_bytes=files[f"{Manifest.EMBED_IR}.bin"].size,
        head_bytes=files[f"{Manifest.HEAD_IR}.bin"].size,
    )
    try:
        (staging / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
    except OSError as error:
        raise _write_error(MANIFEST_NAME, staging, error) from error
    return manifest


def _rope_example(max_context: int) -> tuple[torch.Tensor, ...]:
    positions = torch.tensor([[3, 4]], dtype=torch.int64) % max_context
    return positions, torch.ones(1, 5, dtype=torch.int64)


def _layer_example(config: CheckpointConfig) -> tuple[torch.Tensor, ...]:
    spec = config.spec
    batch, tokens, past = 1, 2, 3
    return (
        torch.zeros(batch, tokens, spec.hidden_size),
        torch.zeros(batch, 1, tokens, past + tokens),
        torch.ones(batch, tokens, spec.head_dim),
        torch.zeros(batch, tokens, spec.head_dim),
        torch.zeros(batch, spec.num_kv_heads, past, spec.head_dim),
        torch.zeros(batch, spec.num_kv_heads, past, spec.head_dim),
    )


def _convert(module: torch.nn.Module, example: tuple[torch.Tensor, ...], shapes: list[list[int]],
             input_names: list[str], output_names: list[str]) -> ov.Model:
    """Trace `module` with the given input shapes (-1 = dynamic) and name its inputs and outputs."""
    module.eval()
    with torch.no_grad(), _root_logger_kept():
        model = ov.convert_model(module, example_input=example,
                                 input=[ov.PartialShape(shape) for shape in shapes])
    for port, name in zip(model.inputs, input_names, strict=True):
        port.get_tensor().set_names({name})
        port.get_node().set_friendly_name(name)
    for port, name in zip(model.outputs, output_names, strict=True):
        port.get_tensor().set_names({name})
    return model


@contextlib.contextmanager
def _root_logger_kept() -> Iterator[None]:
    """Put the root logger back as it was, however convert_model ends. OpenVINO's converter sets the root logger's
    level to ERROR while it runs and restores it only when it returns: a SIGTERM or Ctrl-C during a conversion
    left it at ERROR, and the export's "stopped by SIGTERM; no unfinished export is left behind" was never shown."""
    root = logging.getLogger()
    level, filters, handlers = root.level, list(root.filters), list(root.handlers)
    try:
        yield
    finally:
        root.setLevel(level)
        root.filters[:], root.handlers[:] = filters, handlers


def _save(model: ov.Model, path: Path, weight_format: WeightFormat, is_decoder_layer: bool) -> None:
    if weight_format is WeightFormat.INT4:
        model = _compress_int4(model, is_decoder_layer)
    _write_ir(model, path, compress_to_fp16=weight_format is WeightFormat.F16)


def _write_ir(model: ov.Model, path: Path, compress_to_fp16: bool) -> None:
    """ov.save_model, with an error that says which file could not be written and how much room was left:
    OpenVINO's own, for a full disk, is "basic_ios::clear: iostream error"."""
    try:
        ov.save_model(model, path, compress_to_fp16=compress_to_fp16)
    except RuntimeError as error:
        raise _write_error(f"{path.stem}.xml/.bin", path.parent, error) from error


def _write_error(what: str, staging: Path, error: BaseException) -> ExportError:
    """The error for a file of the export that could not be written: which, why, and the room left."""
    try:
        free = f"{shutil.disk_usage(staging).free / 1e6:.1f} MB"
    except OSError:
        free = "an unknown amount"
    # the staging folder is removed by the time the message is read: name the folder it is in
    return ExportError(f"cannot write {what} of the export: {_one_line(error)} ({free} free in {staging.parent}; "
                       "is the disk full?)")


def _compress_int4(model: ov.Model, is_decoder_layer: bool) -> ov.Model:
    import nncf

    nncf.set_log_level(logging.ERROR)  # its per-IR tables would drown the export's own progress lines

    # Its progress bar ("Applying Weight Compression", one per IR) is no log line: rich writes it to whatever
    # sys.stdout is, where `deskfleet export` prints only its result. Its log handler keeps the real stdout.
    with contextlib.redirect_stdout(io.StringIO()), _numpy_compression():
        if not is_decoder_layer:
            # embed and head: 8-bit per channel, the usual backup precision for the vocabulary matrices.
            return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
        return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_ASYM, ratio=1.0,
                                     group_size=_group_size(model), all_layers=True)


@contextlib.contextmanager
def _numpy_compression() -> Iterator[None]:
    """NNCF's weight lowering in numpy instead of its "optimized" path, which compiles small models with
    ov.compile_model: a Core of its own each (50 on the 170M model), which OpenVINO's CPU plugin makes unsafe to
    release out of order, as NNCF's cache does (see agent/openvino_core.py: a Ctrl-C, which the export handles,
    then hit an unmapped signal stack). The exported bytes are the same either way (170M model, every file
    compared), and numpy was no slower (14.3 s against 15.8 s for the whole export)."""
    name = "NNCF_DISABLE_OPTIMIZED_COMPRESSION"
    before = os.environ.get(name)
    os.environ[name] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _group_size(model: ov.Model) -> int:
    """The largest of 128/64/32 that divides every MatMul's input channels; -1 (per channel) otherwise."""
    channels = set()
    for op in model.get_ops():
        if op.get_type_name() == "MatMul":
            weight = op.input_value(1).get_partial_shape()
            if weight.rank.is_static and weight[-1].is_static:
                channels.add(weight[-1].get_length())
    for size in (128, 64, 32):
        if all(count % size == 0 for count in channels):
            return size
    _warn_per_channel(frozenset(channels))
    return -1


@functools.cache  # every layer has the same widths: once per export, not once per layer
def _warn_per_channel(channels: frozenset[int]) -> None:
    log.warning("no INT4 group size of 128, 64 or 32 divides every input width of a decoder layer (%s): its "
                "weights are compressed per output channel, which loses more accuracy; --weights f16 avoids that",
                ", ".join(map(str, sorted(channels))))


def _load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    _refuse_tokenizer_code(model_dir)
    try:
        # trust_remote_code=False, not transformers' default None: with None, a tokenizer_config.json whose
        # auto_map names a .py file of the folder makes transformers ask on the terminal whether to run it,
        # and a "y" (typed, or waiting on a piped stdin) runs the checkpoint's code in this process.
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except Exception as error:  # OSError, ValueError, and tokenizers' bare Exception for a corrupt file
        if "trust_remote_code" in str(error):
            raise ExportError(
                f"the tokenizer of {model_dir} is custom code (tokenizer_config.json's auto_map names a Python file "
                "of the folder): deskfleet runs no code from a checkpoint; export a checkpoint whose tokenizer is a "
                "standard one with a tokenizer.json") from None
        if (unreadable := _unreadable_tokenizer_file(model_dir)) is not None:
            raise ExportError(f"cannot load the tokenizer of {model_dir}: {unreadable}") from error
        if not (model_dir / "tokenizer.json").is_file():
            raise ExportError(f"cannot load the tokenizer of {model_dir}: {_without_tokenizer_json(model_dir)}") \
                from error
        raise ExportError(f"cannot load the tokenizer of {model_dir}: {_one_line(error)}") from error
    # LlamaTokenizer, Qwen2Tokenizer and GPT2Tokenizer load from a tokenizer_config.json alone, as an empty
    # vocabulary of 4 tokens that encodes any text to no ids: a checkpoint copied without its tokenizer files
    files = sorted({str(name) for name in tokenizer.vocab_files_names.values()})
    if files and not any((model_dir / name).is_file() for name in files):
        raise ExportError(f"cannot load the tokenizer of {model_dir}: it has none of the files its "
                          f"{type(tokenizer).__name__} reads ({', '.join(files)}), only its settings: copy the "
                          "model's tokenizer files into it")
    if not tokenizer.is_fast:
        raise ExportError(f"the tokenizer of {model_dir} has no fast (tokenizer.json) form")
    return tokenizer


def _refuse_tokenizer_code(model_dir: Path) -> None:
    """ExportError where tokenizer_config.json's auto_map names the checkpoint's own tokenizer code, as
    read_checkpoint_config refuses config.json's: transformers, told never to run it, loads a standard tokenizer
    class instead where tokenizer_class names one, which may not split text as that code does; it exported
    without a word (refused only where tokenizer_class named the custom class)."""
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():  # a link to a file is read (a Hugging Face cache snapshot is all links)
        return
    try:
        auto_map = read_json_object(path).get("auto_map")
    except JsonFileError:
        return  # the load below names the file
    if named := auto_map_code(auto_map, only="AutoTokenizer"):
        raise ExportError(
            f"the tokenizer of {model_dir} is custom code (tokenizer_config.json's auto_map names "
            f"{', '.join(named)[:200]}): deskfleet runs no code from a checkpoint, and the standard tokenizer it "
            "would load instead may not split text as that code does; export a checkpoint whose tokenizer is a "
            "standard one with a tokenizer.json (where the model's tokenizer.json is known to split text as that "
            "code does, remove auto_map from a copy of tokenizer_config.json)")


def _unreadable_tokenizer_file(model_dir: Path) -> str | None:
    """Which of the tokenizer's JSON files stopped its load, and why, or None where each is absent or reads. The
    load's own errors named no file ("EOF while parsing a string at line 27 column 8" for a tokenizer.json cut
    short, "Expecting property name enclosed in double quotes" for a bad tokenizer_config.json), and a
    tokenizer.json that is a folder or a broken link was said to be missing."""
    for name in ("tokenizer_config.json", "tokenizer.json"):
        path = model_dir / name
        if (found := not_a_file(path)) is not None:
            return f"{path} {found}"
        try:
            read_json_object(path)
        except FileNotFoundError:
            continue
        except JsonFileError as error:  # names the file
            return f"{error}: fix it, or copy it from the model again (a download or copy cut short leaves it so)"
    return None


def _without_tokenizer_json(model_dir: Path) -> str:
    """Why a folder with no tokenizer.json has no tokenizer, and what to do (transformers' own error blames
    tiktoken for a SentencePiece file it could not convert)."""
    import importlib.util
    import re

    model_file = model_dir / "tokenizer.model"
    if not model_file.is_file():
        return "it has no tokenizer.json (nor a tokenizer.model): copy the model's tokenizer files into it"
    with model_file.open("rb") as stream:
        first_line = stream.readline(200)
    # tiktoken's file is text, a base64 token and its rank a line; SentencePiece's is a binary protobuf
    kind, package = (("tiktoken", "tiktoken") if re.fullmatch(rb"[A-Za-z0-9+/=]+ [0-9]+\r?\n?", first_line)
                     else ("SentencePiece", "sentencepiece"))
    if importlib.util.find_spec(package) is None:
        return (f"it has no tokenizer.json, and converting its tokenizer.model ({kind}) needs the {package} package: "
                f"pip install {package}{' protobuf' if package == 'sentencepiece' else ''}, or put the model's "
                "tokenizer.json beside it")
    return (f"it has no tokenizer.json, and its tokenizer.model ({kind}) could not be converted to one: put the "
            "model's tokenizer.json beside it")


def _warn_dropped_chat_templates(model_dir: Path, names: list[str]) -> None:
    """Say which of a tokenizer's named chat templates the export leaves out: all but "default"."""
    dropped = ", ".join(name for name in names if name != "default")
    if "default" not in names:
        log.warning("the tokenizer of %s has named chat templates (%s) but none named \"default\", the only one an "
                    "export keeps: the export has no chat template, so `generate --chat` and `chat` will refuse it; "
                    "to chat with one of them, make it the \"default\" one (its name in tokenizer_config.json's "
                    "list, or the file chat_template.jinja) and export again",
                    model_dir, dropped)
    elif dropped:
        log.warning("the tokenizer of %s has named chat templates: the export keeps only \"default\" (the one "
                    "`generate --chat` and `chat` render) and leaves out %s", model_dir, dropped)


def _warn_unparsable_chat_template(model_dir: Path, template: object) -> None:
    """Warn where the chat template kept is no Jinja template at all (a syntax error): it exported without a word,
    and only `generate --chat`, `chat` or a chat request to `serve` failed on it, later. The export goes on: plain
    completion does not use the template."""
    if not isinstance(template, str):
        return
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as error:
        log.warning("the chat template of %s is not a valid Jinja template (%s, line %s): `generate --chat`, `chat` "
                    "and chat requests to `serve` will refuse it; fix chat_template.jinja (or the chat_template of "
                    "tokenizer_config.json) and export again, or use plain completion", model_dir, error.message,
                    error.lineno)


def _one_line(error: BaseException) -> str:
    """An error's message on one line (transformers' span several, with blank ones between)."""
    return " ".join(str(error).split())


def _save_tokenizer(model_dir: Path, tokenizer: PreTrainedTokenizerBase, staging: Path) -> tuple[str, ...]:
    templates = tokenizer.chat_template
    if isinstance(templates, dict):
        # Named templates (a list in tokenizer_config.json, or additional_chat_templates/*.jinja): transformers
        # saves all but "default" into a subfolder, which no export holds (every file is listed and hashed).
        # Chat renders only the default, so only it is kept, as chat_template.jinja. What is dropped is a
        # warning, not an info line: with no "default" the export has no chat template at all, and only
        # `generate --chat`, later, said so ("has no chat template").
        _warn_dropped_chat_templates(model_dir, [str(name) for name in templates])
        tokenizer.chat_template = templates.get("default")
    _warn_unparsable_chat_template(model_dir, tokenizer.chat_template)
    before = {path.name for path in staging.iterdir()}
    try:
        tokenizer.save_pretrained(staging)
    except Exception as error:  # OSError, and tokenizers' bare Exception ("No space left on device (os error 28)")
        raise _write_error("the tokenizer files", staging, error) from error
    written = sorted({path.name for path in staging.iterdir()} - before)
    if "tokenizer.json" not in written:
        raise ExportError(f"the tokenizer of {model_dir} has no fast (tokenizer.json) form")
    for name in ("generation_config.json", "config.json"):
        if (model_dir / name).is_file():
            try:
                shutil.copyfile(model_dir / name, staging / name)
            except OSError as error:
                raise _write_error(name, staging, error) from error
            written.append(name)
    return tuple(sorted(written))
