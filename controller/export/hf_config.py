"""Read a Hugging Face checkpoint's config and decide whether deskfleet can export it."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from deskfleet.common.json_file import JsonFileError, read_json_object
from deskfleet.common.model_spec import MAX_SPEC_VALUE, ModelSpec

SUPPORTED_ARCHITECTURES = {"llama", "mistral", "qwen2"}
# RoPE types whose tables do not depend on the sequence length, so they can be precomputed exactly.
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}
DEFAULT_MAX_CONTEXT_CAP = 8192
MIN_MAX_CONTEXT = 2  # positions: the shortest context a prompt and its first new token fit in
ROPE_WARN_BYTES = 128 << 20  # a RoPE table past this (a context of 256k positions at head_dim 64) is warned of

log = logging.getLogger(__name__)


class UnsupportedModelError(ValueError):
    """The checkpoint uses a feature deskfleet cannot export; the message names the config field."""


@dataclass(frozen=True)
class CheckpointConfig:
    """The validated config of a checkpoint, and the transformers config object behind it."""

    spec: ModelSpec
    attention_bias: bool  # bias on q/k/v projections (Qwen2, or Llama's attention_bias)
    output_bias: bool  # bias on o_proj (Llama's attention_bias only)
    mlp_bias: bool
    rms_norm_eps: float
    hf_config: object  # transformers.PretrainedConfig


def not_a_file(path: Path) -> str | None:
    """What is at `path` where a checkpoint's file was expected and none could be read: "is a broken link (to
    ...)" (a half-copied Hugging Face cache folder holds those) or "is a folder, not a file"; None where nothing
    is there, for the caller's own "has no ..." (which read as a lie beside an `ls` that showed the name)."""
    if path.is_symlink() and not path.exists():
        return f"is a broken link (to {os.readlink(path)}): copy the file it names, not the link"
    if path.is_dir():
        return "is a folder, not a file"
    return None


def _rope_type(hf_config: object) -> str:
    parameters = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = parameters.get("rope_type", parameters.get("type", "default")) if parameters else "default"
    return str(rope_type)


# rope types whose table depends on the sequence length, which a stage's precomputed table cannot follow
LENGTH_DEPENDENT_ROPE_TYPES = {"dynamic", "longrope", "su"}


def _rope_key(raw: dict[str, object]) -> str:
    """The config.json key that holds the RoPE parameters as the file writes it: `rope_parameters` (transformers 5)
    or `rope_scaling` (earlier), for an error that names what the admin sees in the file."""
    return "rope_parameters" if isinstance(raw.get("rope_parameters"), dict) else "rope_scaling"


def read_checkpoint_config(model_dir: Path, max_context: int | None = None) -> CheckpointConfig:
    """Load config.json (and generation_config.json for eos ids) and validate it for export.

    Raises UnsupportedModelError naming the field when the model is outside what deskfleet supports.
    """
    from transformers import AutoConfig

    config_path = model_dir / "config.json"
    if not config_path.is_file():
        if (found := not_a_file(config_path)) is not None:
            raise FileNotFoundError(f"{config_path} {found}")
        raise FileNotFoundError(f"{model_dir} has no config.json: it is not a Hugging Face checkpoint folder")
    raw = _read_json_object(config_path)
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in SUPPORTED_ARCHITECTURES:  # a list is unhashable
        raise UnsupportedModelError(
            f"config field model_type={model_type!r} is not supported "
            f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
    quantization = raw.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        raise UnsupportedModelError(
            f"config field quantization_config (quant_method={method!r}): the checkpoint's weights are already "
            "quantized; export from the unquantized (f16/bf16/f32) checkpoint, deskfleet compresses it itself")
    auto_map = raw.get("auto_map")
    if auto_map:
        # transformers, told never to run it, builds the standard class of model_type instead: not necessarily the
        # model the checkpoint's code describes, so the export would pass for it without a word
        named = ", ".join(sorted(set(auto_map_code(auto_map))))
        raise UnsupportedModelError(
            f"config field auto_map names the checkpoint's own code ({named:.200}): deskfleet never runs it, and the "
            f"standard {model_type} it would export instead may not be that model; export a checkpoint made for "
            "transformers' own classes")
    _check_sizes(raw, config_path)
    try:
        # never the checkpoint's own code (an auto_map in config.json), nor transformers' prompt asking to run it
        hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except Exception as error:  # transformers' own checks raise many types (ValueError, KeyError, strict dataclasses)
        raise UnsupportedModelError(f"{config_path} is refused by transformers: {error}") from None

    hidden_act = getattr(hf_config, "hidden_act", "silu")
    if hidden_act != "silu":
        raise UnsupportedModelError(f"config field hidden_act={hidden_act!r} is not supported (only 'silu')")
    rope_type = _rope_type(hf_config)
    if rope_type not in STATIC_ROPE_TYPES:
        why = "; its table depends on the sequence length" if rope_type in LENGTH_DEPENDENT_ROPE_TYPES else ""
        raise UnsupportedModelError(
            f"config field {_rope_key(raw)}.rope_type={rope_type!r} is not supported "
            f"(supported: {', '.join(sorted(STATIC_ROPE_TYPES))}{why})")

    _check_rope_and_norm(hf_config, rope_type, _rope_key(raw))

    config_max = int(getattr(hf_config, "max_position_embeddings", DEFAULT_MAX_CONTEXT_CAP))
    if max_context is None and "max_position_embeddings" not in raw:  # transformers filled in its own default
        log.warning("%s has no max_position_embeddings: the context is %d, transformers' default for %s, which may "
                    "not be what the model was trained for; give --max-context to choose it", config_path,
                    min(config_max, DEFAULT_MAX_CONTEXT_CAP), model_type)
    if max_context is not None and not MIN_MAX_CONTEXT <= max_context <= MAX_SPEC_VALUE:
        # 1 left no room for a prompt and a reply (generate then said "shorten the prompt to at most 0 tokens"); past
        # MAX_SPEC_VALUE the manifest was written and then refused as a tampered one, naming no option
        raise ValueError(f"--max-context must be from {MIN_MAX_CONTEXT} (a prompt token and a new one) to "
                         f"{MAX_SPEC_VALUE:,}, got {max_context}")
    if max_context is None and config_max < MIN_MAX_CONTEXT:  # 1: an export in which no prompt can be answered
        raise UnsupportedModelError(f"config field max_position_embeddings={config_max} must be at least "
                                    f"{MIN_MAX_CONTEXT} (a prompt token and a new one), or give --max-context")
    context = max_context if max_context is not None else min(config_max, DEFAULT_MAX_CONTEXT_CAP)
    if context > config_max:
        log.warning("--max-context %d is past the model's max_position_embeddings (%d): positions beyond it were "
                    "never trained, so text there may degrade", context, config_max)
    sliding_window = getattr(hf_config, "sliding_window", None)
    uses_sliding = model_type == "mistral" or bool(getattr(hf_config, "use_sliding_window", False))
    if uses_sliding and sliding_window and context > sliding_window:
        raise UnsupportedModelError(
            f"config field sliding_window={sliding_window} is smaller than the max context {context}: "
            f"sliding-window attention is not supported; export with --max-context {sliding_window}")

    num_heads = int(hf_config.num_attention_heads)
    kv_heads_field = getattr(hf_config, "num_key_value_heads", None)  # absent: one KV head per head (MHA)
    num_kv_heads = num_heads if kv_heads_field is None else int(kv_heads_field)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads)
    spec = ModelSpec(
        architecture=model_type,
        num_layers=int(hf_config.num_hidden_layers),
        hidden_size=int(hf_config.hidden_size),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=int(hf_config.intermediate_size),
        vocab_size=int(hf_config.vocab_size),
        max_context=context,
        # the checkpoint's own ids, never transformers' class defaults (LlamaConfig's bos 1 and eos 2 were exported
        # for a config without them, and the warning below never came: a Llama 3 would stop on the wrong token)
        bos_token_id=_token_id(raw.get("bos_token_id")),
        eos_token_ids=_eos_token_ids(model_dir, raw),
        rope_type=rope_type,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )
    spec.validate()
    rope_bytes = 2 * context * head_dim * 4  # cos and sin, f32: rope.bin, built in memory and loaded by every stage
    if rope_bytes > ROPE_WARN_BYTES:  # --max-context 1048576 took 1.6 GB to export the 3M-weight demo draft
        log.warning("--max-context %d makes a RoPE table of %.0f MB (rope.bin, built in memory now and loaded by "
                    "every stage), and each stage reserves its KV cache for that many positions: give the context "
                    "the model will be used at", context, rope_bytes / 1e6)
    if not spec.eos_token_ids:
        log.warning("neither config.json nor generation_config.json of %s gives an eos_token_id: generate will stop "
                    "only at --max-new-tokens (chat at the chat template's end of turn)", model_dir)
    # Which projections have a bias is the architecture's, as transformers builds it: only Llama reads
    # attention_bias (q, k, v and o) and mlp_bias; Qwen2 always has q, k and v biases and no others; Mistral
    # none. A stray field in a Mistral or Qwen2 config.json is ignored by transformers, biases stored or not.
    is_llama = model_type == "llama"
    llama_bias = is_llama and bool(getattr(hf_config, "attention_bias", False))
    return CheckpointConfig(
        spec=spec,
        attention_bias=model_type == "qwen2" or llama_bias,
        output_bias=llama_bias,
        mlp_bias=is_llama and bool(getattr(hf_config, "mlp_bias", False)),
        rms_norm_eps=float(hf_config.rms_norm_eps),
        hf_config=hf_config,
    )


# The config's sizes, by its own field names: checked before transformers reads them (num_attention_heads 0 was
# refused as "integer modulo by zero", num_hidden_layers 0 as the manifest's "num_layers").
_SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size")


def _check_sizes(raw: dict[str, object], config_path: Path) -> None:
    for name in _SIZE_FIELDS:
        value = raw.get(name)
        if value is None and name in ("num_key_value_heads", "head_dim"):  # optional: MHA, hidden / heads
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SPEC_VALUE:
            raise UnsupportedModelError(f"config field {name}={value!r} in {config_path} must be a whole number "
                                        f"from 1 to {MAX_SPEC_VALUE:,}")
    heads, kv_heads = raw["num_attention_heads"], raw.get("num_key_value_heads")
    assert isinstance(heads, int)
    if isinstance(kv_heads, int) and heads % kv_heads:
        raise UnsupportedModelError(f"config field num_attention_heads={heads} is not a multiple of "
                                    f"num_key_value_heads={kv_heads} in {config_path}: each KV head serves a whole "
                                    "group of heads")


def auto_map_code(auto_map: object, only: str | None = None) -> list[str]:
    """The checkpoint code an `auto_map` names ("module.Class"), for every class or for `only` (AutoTokenizer)."""
    values = ([auto_map.get(only)] if only is not None else list(auto_map.values())) \
        if isinstance(auto_map, dict) else [auto_map]
    return [str(entry) for value in values for entry in (value if isinstance(value, list) else [value]) if entry]


def rope_theta(hf_config: object) -> object:
    """The config's rope_theta, where transformers keeps it (rope_parameters in newer releases); None: not set."""
    parameters = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if isinstance(parameters, dict):
        return parameters.get("rope_theta", getattr(hf_config, "rope_theta", None))
    return getattr(hf_config, "rope_theta", None)


def _check_rope_and_norm(hf_config: object, rope_type: str, rope_key: str = "rope_scaling") -> None:
    """UnsupportedModelError naming the field where rope_theta, a rope scaling factor or rms_norm_eps is a value no
    model has: an export went through with them and its RoPE table or norms were NaN (rope_theta 0: 63,488 of the
    table's 65,536 values), so every generate step failed on logits that were not finite."""
    parameters = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    checks: list[tuple[str, object, float]] = [("rope_theta", rope_theta(hf_config), 0.0),
                                               ("rms_norm_eps", getattr(hf_config, "rms_norm_eps", None), 0.0)]
    if rope_type != "default" and isinstance(parameters, dict):
        checks.append((f"{rope_key}.factor", parameters.get("factor"), 1.0))
    for name, value, low in checks:
        if value is None and name == "rope_theta":
            continue  # transformers' default applies
        if not isinstance(value, (int, float)) or isinstance(value, bool):  # "2" was told it "must be at least 1"
            raise UnsupportedModelError(f"config field {name}={value!r} must be a number")
        if not (math.isfinite(value) and (value >= low if low else value > 0)):
            bound = f"at least {low:g}" if low else "a finite number above 0"
            raise UnsupportedModelError(f"config field {name}={value!r} must be {bound}")


def _token_id(value: object) -> int | None:
    """A config's token id, None where it gives none (a JSON true is an int to Python, but no token id)."""
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _eos_token_ids(model_dir: Path, raw: dict[str, object]) -> tuple[int, ...]:
    """The eos ids of generation_config.json, then those of config.json (`raw`, as written)."""
    ids: list[int] = []
    generation_path = model_dir / "generation_config.json"
    sources: list[object] = [raw.get("eos_token_id")]
    # a half-copied Hugging Face cache holds a broken link there: skipped, it lost a chat model's end-of-turn id
    if (found := not_a_file(generation_path)) is not None:
        raise FileNotFoundError(f"{generation_path} {found}")
    if generation_path.is_file():
        sources.insert(0, _read_json_object(generation_path).get("eos_token_id"))
    for source in sources:
        values = source if isinstance(source, list) else [source]
        # a JSON true is an int to Python: it is no token id (it read as id 1, the BOS token)
        ids += [int(value) for value in values
                if isinstance(value, int) and not isinstance(value, bool) and int(value) not in ids]
    return tuple(ids)


def _read_json_object(path: Path) -> dict[str, object]:
    """A checkpoint's JSON file as a dict; UnsupportedModelError naming the file when it is not one."""
    try:
        return read_json_object(path)
    except JsonFileError as error:
        raise UnsupportedModelError(str(error)) from None
