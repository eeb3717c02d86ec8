"""The model spec and export manifest: what an exported model folder contains.

An export folder holds one IR per decoder layer plus `embed`, `head` and `rope` (the RoPE table and the
attention-bias prologue every stage runs once), the tokenizer files, and `manifest.json`. The manifest is
the only file a reader trusts: it names every other file with its sha256 and size, so an agent can verify
what it was sent before it compiles anything.

Pure code: json and hashlib only.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1


class ManifestError(ValueError):
    """The manifest or a file it names is missing, malformed or does not match its checksum."""


class NewerManifestError(ManifestError):
    """The manifest is of a format a later deskfleet writes: the fix is an upgrade, not a new export."""


class ExportMismatchError(ManifestError):
    """The export's IR files, each matching its checksum, hold other sizes than its manifest says (the manifest
    edited, or files of two exports mixed): a fault of the export, not of a copy of its files. An agent must not
    take it for a damaged shard (drop its files, have them sent again), nor a failover for a PC that failed."""


class WeightFormat(str, Enum):
    INT4 = "int4"
    F16 = "f16"
    F32 = "f32"


MAX_SPEC_VALUE = 1 << 24  # larger than any real model's layers, widths, vocabulary or context (16M)


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer, as far as the runtime needs to know it."""

    architecture: str  # "llama", "mistral" or "qwen2"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_type: str
    tie_word_embeddings: bool

    @property
    def layer_parameters(self) -> int:
        """Weights one decoder layer multiplies per token: q, k, v, o and the gated MLP (biases left out)."""
        queries = self.num_heads * self.head_dim
        keys = self.num_kv_heads * self.head_dim
        return self.hidden_size * (2 * queries + 2 * keys) + 3 * self.hidden_size * self.intermediate_size

    @property
    def head_parameters(self) -> int:
        """Weights the vocabulary projection multiplies per token."""
        return self.vocab_size * self.hidden_size

    def kv_bytes_per_token_per_layer(self, bytes_per_element: int = 4) -> int:
        """KV-cache bytes one token costs in one layer (keys and values)."""
        return 2 * self.num_kv_heads * self.head_dim * bytes_per_element

    def validate(self) -> None:
        """Raise ManifestError naming the first field that cannot describe a real model."""
        positive = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                    "intermediate_size", "vocab_size", "max_context")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ManifestError(f"model spec field {name!r} must be a whole number, got {value!r:.40}")
            if value <= 0:
                raise ManifestError(f"model spec field {name!r} must be positive, got {value}")
            if value > MAX_SPEC_VALUE:  # no model has a billion layers or heads: a tampered manifest
                raise ManifestError(f"model spec field {name!r} is {value}, past any real model's")
        for name in ("architecture", "rope_type"):
            if not isinstance(getattr(self, name), str):
                raise ManifestError(f"model spec field {name!r} must be text, got {getattr(self, name)!r:.40}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ManifestError(f"tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r:.40}")
        if not isinstance(self.eos_token_ids, tuple) or not all(
                isinstance(token, int) and not isinstance(token, bool) for token in self.eos_token_ids):
            raise ManifestError(f"eos_token_ids must be a list of token ids, got {self.eos_token_ids!r:.40}")
        if self.num_heads % self.num_kv_heads:
            raise ManifestError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})")
        for token in self.eos_token_ids:
            if not 0 <= token < self.vocab_size:
                raise ManifestError(f"eos token id {token} is outside the vocabulary (size {self.vocab_size})")
        # None: the model has no BOS token. An id past the vocabulary would reach the embedding as an
        # out-of-range index when a prompt starts with it (the bench prompts do).
        bos = self.bos_token_id
        if bos is not None:
            if not isinstance(bos, int) or isinstance(bos, bool):
                raise ManifestError(f"bos_token_id must be a token id or null, got {bos!r:.40}")
            if not 0 <= bos < self.vocab_size:
                raise ManifestError(f"bos token id {bos} is outside the vocabulary (size {self.vocab_size})")


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    """Everything an export folder holds. IR names are stems: `layer_003` means layer_003.xml/.bin."""

    model_name: str
    spec: ModelSpec
    weight_format: WeightFormat
    files: dict[str, FileEntry]
    tokenizer_files: tuple[str, ...]
    layer_bytes: tuple[int, ...]  # weight bytes (.bin) of each decoder layer
    embed_bytes: int
    head_bytes: int
    format_version: int = MANIFEST_FORMAT
    extra: dict[str, str] = field(default_factory=dict)

    # IR stems, by role.
    @staticmethod
    def layer_ir(index: int) -> str:
        return f"layer_{index:03d}"

    EMBED_IR = "embed"
    HEAD_IR = "head"
    ROPE_IR = "rope"

    def ir_files(self, stem: str) -> tuple[str, str]:
        return f"{stem}.xml", f"{stem}.bin"

    def stage_ir_stems(self, start: int, stop: int) -> list[str]:
        """The IR stems a stage holding layers [start, stop) needs, in graph order."""
        if not 0 <= start < stop <= self.spec.num_layers:
            raise ManifestError(
                f"layers [{start}:{stop}] are outside the model's {self.spec.num_layers} layers")
        stems = [self.ROPE_IR]
        if start == 0:
            stems.append(self.EMBED_IR)
        stems += [self.layer_ir(i) for i in range(start, stop)]
        if stop == self.spec.num_layers:
            stems.append(self.HEAD_IR)
        return stems

    # Serialization
    def to_json(self) -> str:
        body = asdict(self)
        body["weight_format"] = self.weight_format.value
        return json.dumps(body, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            body = json.loads(text)
            if not isinstance(body, dict):
                raise ManifestError(f"a manifest is a JSON object, not {type(body).__name__}")
            version = body.get("format_version")
            if isinstance(version, int) and not isinstance(version, bool) and version > MANIFEST_FORMAT:
                raise NewerManifestError(f"the export was made by a newer deskfleet (manifest format_version "
                                         f"{version}; this deskfleet reads {MANIFEST_FORMAT}): upgrade deskfleet here, "
                                         "or export the model again with this one")
            if version != MANIFEST_FORMAT:
                raise ManifestError("the manifest has no format_version" if version is None else
                                    f"manifest format_version {version!r} is not {MANIFEST_FORMAT}")
            spec_body = dict(body["spec"])
            spec_body["eos_token_ids"] = tuple(spec_body["eos_token_ids"])
            spec = ModelSpec(**spec_body)
            manifest = cls(
                model_name=str(body["model_name"]),
                spec=spec,
                weight_format=WeightFormat(body["weight_format"]),
                files={name: _file_entry(name, entry) for name, entry in body["files"].items()},
                tokenizer_files=tuple(_text(f"tokenizer_files[{index}]", name)
                                      for index, name in enumerate(body["tokenizer_files"])),
                layer_bytes=tuple(_byte_count(f"layer_bytes[{index}]", size)
                                  for index, size in enumerate(body["layer_bytes"])),
                embed_bytes=_byte_count("embed_bytes", body["embed_bytes"]),
                head_bytes=_byte_count("head_bytes", body["head_bytes"]),
                extra=dict(body.get("extra", {})),
            )
            spec.validate()
        except ManifestError:
            raise
        except KeyError as error:
            raise ManifestError(f"malformed manifest: it has no {error.args[0]!r:.100}") from None
        except json.JSONDecodeError as error:
            raise ManifestError(f"malformed manifest: not JSON ({error})") from None
        except (TypeError, ValueError, AttributeError, RecursionError) as error:
            raise ManifestError(f"malformed manifest: {error!s:.200}") from None
        if len(manifest.layer_bytes) != spec.num_layers:
            raise ManifestError(
                f"manifest lists {len(manifest.layer_bytes)} layer sizes for {spec.num_layers} layers")
        _check_layer_files(manifest)
        # the planner reads the sizes, the agents fetch the files: they must say the same (export writes both)
        sizes = {**{f"{cls.layer_ir(index)}.bin": size for index, size in enumerate(manifest.layer_bytes)},
                 f"{cls.EMBED_IR}.bin": manifest.embed_bytes, f"{cls.HEAD_IR}.bin": manifest.head_bytes}
        for name, size in sizes.items():
            entry = manifest.files.get(name)
            if entry is None or entry.size != size:
                listed = "not listed" if entry is None else f"listed at {entry.size} bytes"
                raise ManifestError(f"the manifest sizes {name} at {size} bytes for planning, but its file is {listed}")
        return manifest


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_LAYER_FILE = re.compile(r"layer_[0-9]+\.(xml|bin)")
LAYER_FILES_SHOWN = 4


def _check_layer_files(manifest: Manifest) -> None:
    """ManifestError unless the decoder-layer files the manifest lists are its num_layers layers' own: each
    layer's .bin (the planner sizes it), each layer's .xml where it lists any layer's (an export lists them
    all), and no file of a layer the model does not have. A manifest whose num_layers and layer_bytes were
    lowered still listed the dropped layers' files, and generate ran the shorter model without a word."""
    layers = manifest.spec.num_layers
    listed = {name for name in manifest.files if _LAYER_FILE.fullmatch(name)}
    kinds = (".bin", ".xml") if any(name.endswith(".xml") for name in listed) else (".bin",)
    wanted = {f"{Manifest.layer_ir(index)}{kind}" for index in range(layers) for kind in kinds}
    span = Manifest.layer_ir(0) + (f" to {Manifest.layer_ir(layers - 1)}" if layers > 1 else " only")
    for names, problem in ((listed - wanted, "lists {}, files of no layer of the model"),
                           (wanted - listed, "does not list {}, files of the model's layers")):
        if names:
            shown = sorted(names)[:LAYER_FILES_SHOWN]
            more = f" and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
            raise ManifestError(f"spec.num_layers is {layers} ({span}), but the manifest "
                                f"{problem.format(', '.join(shown) + more)}: it was edited")


def _byte_count(what: str, value: object) -> int:
    """`value` when it is a whole number of bytes (0 or more), else ManifestError naming `what`."""
    if type(value) is not int or value < 0:
        raise ManifestError(f"manifest {what} must be a whole number of bytes, got {value!r:.40}")
    return value


def _text(what: str, value: object) -> str:
    if not isinstance(value, str):
        raise ManifestError(f"manifest {what} must be text, got {value!r:.40}")
    return value


def _file_entry(name: str, entry: object) -> FileEntry:
    """A listed file's entry: its sha256 as 64 lowercase hex characters and its size in bytes."""
    if not isinstance(entry, dict) or set(entry) != {"sha256", "size"}:
        raise ManifestError(f"manifest entry of {name} must hold exactly sha256 and size, got {entry!r:.60}")
    sha256 = entry["sha256"]
    if not isinstance(sha256, str) or _SHA256_HEX.fullmatch(sha256) is None:
        raise ManifestError(f"manifest sha256 of {name} must be 64 lowercase hex characters, got {sha256!r:.70}")
    return FileEntry(sha256, _byte_count(f"size of {name}", entry["size"]))


def model_file(model_dir: Path, name: str) -> Path:
    """`model_dir / name` when it is a plain file of the folder: ManifestError when it is missing, a symbolic
    link, or not inside the folder (a model folder from elsewhere must not make deskfleet read, show or send
    a file it links to, such as /etc/passwd or a key)."""
    path = model_dir / name
    if path.is_symlink():
        raise ManifestError(f"{path} is a symbolic link: a model folder holds its files itself")
    if not path.is_file():
        raise ManifestError(f"{path} is missing")
    if not path.resolve().is_relative_to(model_dir.resolve()):
        raise ManifestError(f"{path} is not inside {model_dir}")
    return path


def sha256_of(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def load_manifest(model_dir: Path) -> Manifest:
    """Read `model_dir/manifest.json`, with a clear error when the folder is not an export."""
    path = model_dir / MANIFEST_NAME
    if not model_dir.exists():
        raise ManifestError(f"{model_dir} does not exist")
    if not model_dir.is_dir():
        raise ManifestError(f"{model_dir} is not a folder")
    if not path.is_file():
        raise ManifestError(
            f"{model_dir} has no {MANIFEST_NAME}: it is not a deskfleet export (run `deskfleet export` first)")
    try:
        return Manifest.from_json(path.read_text(encoding="utf-8"))
    except NewerManifestError as error:  # its fix is said: an upgrade, first
        raise NewerManifestError(f"{path}: {error}") from None
    except ManifestError as error:  # a truncated or edited file: named, with the fix
        raise ManifestError(f"{path}: {error} (export the model again)") from None
    except UnicodeDecodeError as error:
        raise ManifestError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start}): export the model "
                            "again") from None


def incomplete_export(path: Path) -> str:
    """What to say of a file an export's manifest names and its folder lacks."""
    return (f"{path} is missing, though the export's manifest.json names it: the export is incomplete (export the "
            "model again, or copy the file back)")


def check_sizes(model_dir: Path, manifest: Manifest) -> None:
    """Every file the manifest lists is there with its size (no hashing: cheap enough for every deploy, which sends
    and hashes only the files a PC lacks, so a folder missing a layer deployed fine to PCs that held it)."""
    for name in sorted(manifest.files):
        path = model_dir / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise ManifestError(incomplete_export(path)) from None
        if size != manifest.files[name].size:
            raise ManifestError(f"{path} has {size} bytes, the manifest says {manifest.files[name].size}: export "
                                "the model again")


def verify_files(model_dir: Path, manifest: Manifest, names: list[str] | None = None) -> None:
    """Check that each named file (default: all) exists with the size and sha256 the manifest says."""
    for name in names if names is not None else sorted(manifest.files):
        entry = manifest.files.get(name)
        if entry is None:
            raise ManifestError(f"{name} is not listed in the manifest of {model_dir}")
        if not (model_dir / name).exists() and not (model_dir / name).is_symlink():
            raise ManifestError(incomplete_export(model_dir / name))  # "is missing" alone gave no fix
        path = model_file(model_dir, name)
        size = path.stat().st_size
        if size != entry.size:
            raise ManifestError(f"{path} has {size} bytes, the manifest says {entry.size}: export the model again")
        digest = sha256_of(path)
        if digest != entry.sha256:
            raise ManifestError(f"{path} is corrupted: sha256 {digest[:12]}…, the manifest says {entry.sha256[:12]}…: "
                                "export the model again")


class TensorNames:
    """Input and output tensor names of the export units and of a fused stage.

    Layer tensors carry the layer index: fused stages need every KV tensor name unique, or MakeStateful
    pairs only some of them.
    """

    INPUT_IDS = "input_ids"
    HIDDEN_STATES = "hidden_states"  # a middle or last stage's input
    STAGE_HIDDEN_OUT = "stage_hidden_out"  # a first or middle stage's output (must differ from the input)
    ATTENTION_MASK = "attention_mask"
    POSITION_IDS = "position_ids"
    BEAM_IDX = "beam_idx"
    COS = "rope_cos"
    SIN = "rope_sin"
    ATTENTION_BIAS = "attention_bias"
    EMBED_OUT = "embed.hidden_out"
    HEAD_IN = "head.hidden_in"
    LOGITS_POSITIONS = "logits_positions"  # last stage: which of the T positions get logits, [B, N]
    LOGITS = "logits"
    NEXT_TOKENS = "next_tokens"

    @staticmethod
    def layer_hidden_in(index: int) -> str:
        return f"layer_{index:03d}.hidden_in"

    @staticmethod
    def layer_hidden_out(index: int) -> str:
        return f"layer_{index:03d}.hidden_out"

    @staticmethod
    def past(kind: str, index: int) -> str:
        return f"past_{kind}.{index:03d}"

    @staticmethod
    def present(kind: str, index: int) -> str:
        return f"present_{kind}.{index:03d}"
