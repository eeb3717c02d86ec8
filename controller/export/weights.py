"""Lazy access to a checkpoint's safetensors weights, one tensor at a time.

Export walks the model layer by layer, so a 70B checkpoint never needs to fit in memory at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import TracebackType

import torch
from safetensors import safe_open


class CheckpointWeights:
    """Tensors of a (possibly sharded) safetensors checkpoint by name, converted to float32."""

    def __init__(self, model_dir: Path) -> None:
        index_path = model_dir / "model.safetensors.index.json"
        if index_path.is_file():
            weight_map: dict[str, str] = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            shard_names = sorted(set(weight_map.values()))
        elif (model_dir / "model.safetensors").is_file():
            shard_names = ["model.safetensors"]
            weight_map = {}
        else:
            raise FileNotFoundError(
                f"{model_dir} has no model.safetensors or model.safetensors.index.json "
                "(only safetensors checkpoints are supported)")
        self._handles = {name: safe_open(str(model_dir / name), framework="pt") for name in shard_names}
        if not weight_map:
            handle = self._handles["model.safetensors"]
            weight_map = {key: "model.safetensors" for key in handle.keys()}
        self._weight_map = weight_map

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def get(self, name: str) -> torch.Tensor:
        shard = self._weight_map.get(name)
        if shard is None:
            raise KeyError(f"the checkpoint has no tensor {name!r}")
        return self._handles[shard].get_tensor(name).to(torch.float32)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> CheckpointWeights:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
