"""Where the agent keeps things, and its settings file.

Three places, kept apart (maestral's habit): settings the employee or admin edits, machine state the
agent writes (its key, certificate, fleet CA), and the shard cache (large, disposable). By default they
are the platform's dirs for app "deskfleet" (platformdirs); `--data-dir D` puts all three under D
(D/settings, D/state, D/cache), which is what tests and portable installs use.

The settings file is versioned JSON. `load_settings` rejects a bad file with a SettingsError that names
the file and the field, and never rewrites it; `save_settings` writes a temp file and renames it over
the old one, so a crash mid-write leaves the old file whole. A value the agent would trip over later is
a bad file too: every number finite (no NaN or Infinity) and in the range the status and the planner
take, and `device` in OpenVINO's syntax (`device_targets`). So is a field written twice: json would keep
the last without a word, and the admin who added the second may be reading the first. A UTF-8 BOM is
skipped: Windows PowerShell 5.1's `Set-Content -Encoding UTF8` and older Notepad write one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import platformdirs

from deskfleet.common.atomic_file import write_atomic
from deskfleet.common.availability import GIB, AvailabilityPolicy
from deskfleet.common.devices import device_targets
from deskfleet.common.wire import ProtocolError, parse_address, with_default_port

log = logging.getLogger(__name__)

APP_NAME = "deskfleet"
SETTINGS_FORMAT = 1
SETTINGS_FILE = "agent-settings.json"
DEFAULT_AGENT_PORT = 7431
DEFAULT_CACHE_LIMIT_BYTES = 50 * GIB
MAX_SPEED_GB_PER_S = 1e5  # a pinned speed is below this, as StatusReport.weight_gb_per_s must be


class SettingsError(ValueError):
    """The settings file is unreadable or malformed; the message names the file and what is wrong."""


class _RepeatedFieldError(ValueError):
    """An object in the settings holds a field twice (args[0]: its name); from_json names the file."""


@dataclass(frozen=True)
class AgentPaths:
    """The agent's three dirs. Call `create()` before writing into them."""

    settings_dir: Path
    state_dir: Path
    cache_dir: Path

    @classmethod
    def resolve(cls, data_dir: Path | None = None) -> AgentPaths:
        """The dirs under `data_dir` when given (the `--data-dir` option), else the platform's."""
        if data_dir is not None:
            try:
                root = data_dir.expanduser().resolve()
            except RuntimeError:  # Python 3.11's pathlib: a traceback at every command (3.13 raises OSError ELOOP)
                raise SettingsError(f"the agent's data dir {data_dir} goes round a loop of symbolic links: give "
                                    "--data-dir a folder") from None
            if root.exists() and not root.is_dir():  # every command said "[Errno 20] Not a directory" of a file in it
                raise SettingsError(f"the agent's data dir {root} is a file, not a folder: give --data-dir a folder")
            return cls(root / "settings", root / "state", root / "cache")
        return cls(
            Path(platformdirs.user_config_dir(APP_NAME, appauthor=False)),
            Path(platformdirs.user_state_dir(APP_NAME, appauthor=False)),
            Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False)),
        )

    @property
    def settings_file(self) -> Path:
        return self.settings_dir / SETTINGS_FILE

    @property
    def shard_dir(self) -> Path:
        """The shard cache's root (give it to ShardCache)."""
        return self.cache_dir / "shards"

    def create(self) -> None:
        """Make the dirs; state (keys) and cache (the models' weights, which may be confidential: a security walk
        found every local user could read them) readable by the owner only. A cache folder made before, open to
        others, is closed (on POSIX: Windows keeps it in the user's profile by default)."""
        self.settings_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if os.name != "nt" and (mode := stat.S_IMODE(self.cache_dir.stat().st_mode)) & 0o077:
            try:
                self.cache_dir.chmod(0o700)
                log.info("the shard cache folder %s was open to other users (mode %03o): made it 0700", self.cache_dir,
                         mode)
            except OSError as error:  # another user's folder: the agent still runs, the weights readable as before
                log.warning("the shard cache folder %s is open to other users (mode %03o) and cannot be closed (%s): "
                            "they can read the models this PC hosts", self.cache_dir, mode, error.strerror or error)


@dataclass(frozen=True)
class Thresholds:
    """The limits past which the agent says it is unavailable (see AvailabilityPolicy)."""

    require_ac_power: bool = True
    min_battery_percent: float | None = 50.0
    max_temperature_c: float | None = 90.0
    min_free_memory_bytes: int | None = 2 * GIB
    max_cpu_load: float | None = None
    max_igpu_busy: float | None = None  # see AvailabilityPolicy: it counts a GPU stage of this PC too
    release_stages_after_s: float | None = 30.0  # on battery or too hot this long while serving: stages given up


@dataclass(frozen=True)
class AgentSettings:
    """What the employee or the admin chose. Construct with keywords; every field has a default."""

    listen_address: str = f"0.0.0.0:{DEFAULT_AGENT_PORT}"
    device: str = "CPU"  # OpenVINO device for stages: "CPU", "GPU", "NPU", "AUTO"...
    thresholds: Thresholds = field(default_factory=Thresholds)
    paused: bool = False
    cache_limit_bytes: int = DEFAULT_CACHE_LIMIT_BYTES
    # The planner's speed for this PC, in weight GB/s; None: measured by agent/speed_probe.py. An admin
    # pins it where a measurement would mislead (PCs sharing a host, as in tests and benchmarks).
    speed_gb_per_s: float | None = None

    def policy(self) -> AvailabilityPolicy:
        """The availability policy these settings describe (raises ValueError on an out-of-range limit)."""
        return AvailabilityPolicy(paused=self.paused, **asdict(self.thresholds))

    def to_json(self) -> str:
        body = {"format_version": SETTINGS_FORMAT, **asdict(self)}
        return json.dumps(body, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "settings") -> AgentSettings:
        """Parse and check; SettingsError naming `source` and the field on anything wrong."""
        try:
            body = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_refuse_repeated_fields)
        except _RepeatedFieldError as error:
            raise SettingsError(f"{source} has the field {error.args[0]!r} twice; keep the one you mean") from None
        except ValueError as error:  # JSONDecodeError, NaN/Infinity, an integer of too many digits
            raise SettingsError(f"{source} is not valid JSON: {error}") from error
        except RecursionError:
            raise SettingsError(f"{source} is not valid JSON: nested too deeply") from None
        if not isinstance(body, dict):
            raise SettingsError(f"{source} must hold a JSON object")
        version = body.pop("format_version", SETTINGS_FORMAT)  # a file an admin wrote by hand may leave it out
        if type(version) is not int or version != SETTINGS_FORMAT:
            raise SettingsError(f"{source} has format_version {version!r}; this agent reads {SETTINGS_FORMAT}")
        thresholds = Thresholds(**_checked(Thresholds, body.pop("thresholds", {}), f"{source}: thresholds"))
        settings = cls(thresholds=thresholds, **_checked(cls, body, source, skip=("thresholds",)))
        try:
            settings.policy()
        except ValueError as error:  # every limit the policy checks is a field of `thresholds`
            raise SettingsError(f"{source}: thresholds.{error}") from error
        if settings.cache_limit_bytes <= 0:
            raise SettingsError(f"{source}: cache_limit_bytes must be positive")
        if settings.speed_gb_per_s is not None and not 0 < settings.speed_gb_per_s < MAX_SPEED_GB_PER_S:
            raise SettingsError(f"{source}: speed_gb_per_s must be positive and below {MAX_SPEED_GB_PER_S:g}, "
                                f"got {settings.speed_gb_per_s}")
        _check_address(settings.listen_address, source)  # a host alone takes the agent's usual port, as --listen does
        settings = replace(settings, listen_address=with_default_port(settings.listen_address, DEFAULT_AGENT_PORT))
        try:
            device_targets(settings.device)
        except ValueError as error:
            raise SettingsError(f"{source}: device: {error}") from error
        return settings


# Public functions

def load_settings(path: Path) -> AgentSettings:
    """The settings in `path`, or the defaults when the file does not exist yet. Never writes."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return AgentSettings()
    except OSError as error:
        raise SettingsError(f"cannot read settings file {path}: {error.strerror or error}") from error
    # UTF-8, with or without the BOM some Windows tools write (json refuses it), or UTF-16 with its BOM, which
    # Windows PowerShell 5.1's `>` and Out-File write (UTF-32's BOM starts as UTF-16 LE's: looked for first)
    if data.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        encoding = "UTF-32"
    elif data.startswith((b"\xff\xfe", b"\xfe\xff")):
        encoding = "UTF-16"
    elif b"\x00" in data:  # no JSON text holds a NUL
        raise SettingsError(f"settings file {path} holds NUL bytes, so it is not UTF-8 text (UTF-16 without a byte "
                            "order mark?): save it as UTF-8")
    else:
        encoding = "UTF-8"
    try:
        text = data.decode("utf-8-sig" if encoding == "UTF-8" else encoding.lower())
    except UnicodeDecodeError as error:
        raise SettingsError(f"settings file {path} is not {encoding} text ({error.reason} at byte {error.start}): "
                            "save it as UTF-8") from error
    if not text.strip():
        raise SettingsError(f"settings file {path} is empty: write a JSON object in it ({{}} for the defaults), or "
                            "delete it")
    return AgentSettings.from_json(text, source=f"settings file {path}")


def misnamed_settings_files(settings_dir: Path) -> list[Path]:
    """The files beside the settings file that look meant to be it (`agent_settings.json`, `Agent-Settings.json`,
    `agent-settings.json.txt` as Notepad saves it): the agent reads none of them, so an admin's settings there
    silently did not apply (the default listen address, no pause). [] where the folder cannot be read."""
    try:
        entries = [entry for entry in settings_dir.iterdir() if entry.name != SETTINGS_FILE]
    except OSError:
        return []
    def looks_meant(name: str) -> bool:
        folded = name.casefold().replace("_", "-").replace(" ", "-")
        return ("setting" in folded and folded.endswith((".json", ".txt", ".jsn", ".js"))) or folded == "agent-settings"
    return sorted(entry for entry in entries if looks_meant(entry.name))


def save_settings(path: Path, settings: AgentSettings) -> None:
    """Write `settings` to `path` atomically: a temp file in the same dir, fsynced, renamed over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, settings.to_json().encode("utf-8"))


# Private functions


_TYPES: dict[str, tuple[type, ...]] = {
    "bool": (bool,), "str": (str,), "int": (int,), "float": (int, float),
    "float | None": (int, float, type(None)), "int | None": (int, type(None)),
}
# what each type is called in an error: a settings file's author reads JSON, not Python ("must be float | None")
_JSON_NAMES = {"bool": "true or false", "str": "a string in quotes", "int": "a whole number",
               "float": "a number", "float | None": "a number, or null for none",
               "int | None": "a whole number, or null for none"}


def _checked(kind: type, body: Any, source: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """`body`'s fields for the dataclass `kind`, each type-checked; unknown fields are errors."""
    if not isinstance(body, dict):
        raise SettingsError(f"{source} must be a JSON object")
    known = {item.name: str(item.type) for item in fields(kind) if item.name not in skip}
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise SettingsError(f"{source} has unknown field(s) {', '.join(unknown)}")
    checked = dict(body)
    for name, value in body.items():
        allowed = _TYPES[known[name]]
        is_bool = isinstance(value, bool)
        if int in allowed and float not in allowed and isinstance(value, float) and value.is_integer() \
                and abs(value) < 2 ** 63:
            checked[name] = value = int(value)  # 5e10 bytes, as a person may write a size: JSON reads it as a float
        if not isinstance(value, allowed) or (is_bool and bool not in allowed):
            too_large = " (too large)" if isinstance(value, float) and value.is_integer() else ""
            raise SettingsError(f"{source}: field {name!r} must be {_JSON_NAMES[known[name]]}, got "
                                f"{json.dumps(value, ensure_ascii=False)}{too_large}")
        if isinstance(value, float) and not math.isfinite(value):  # 1e400 reads as inf
            raise SettingsError(f"{source}: field {name!r} must be a finite number, got {value!r}")
    return checked


def _refuse_constant(name: str) -> Any:
    """json's hook for NaN, Infinity and -Infinity, which Python reads but JSON does not allow."""
    raise ValueError(f"{name} is not a JSON number")


def _refuse_repeated_fields(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's hook for each object, given its fields in file order: a field written twice is refused."""
    seen: set[str] = set()
    for name, _ in pairs:
        if name in seen:
            raise _RepeatedFieldError(name)
        seen.add(name)
    return dict(pairs)


def _check_address(address: str, source: str) -> None:
    try:
        parse_address(address, default_port=DEFAULT_AGENT_PORT)
    except ProtocolError as error:
        raise SettingsError(f"{source}: listen_address: {error}") from error
