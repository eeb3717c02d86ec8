"""Rebuild train_code_target.py's target state dict from its int4 pack (CPU).

  python unpack_int4.py --pack DIR_WITH_chunk-NNN --run RUN_DIR

writes RUN_DIR/target-00.safetensors (fp16: each int4 weight times its group's scale), which export.py then
turns into a Hugging Face folder. The int4 weights are the model: the checkpoint holds exactly their values.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import torch
from safetensors.torch import save_file


def unpack(blob: bytes) -> dict[str, torch.Tensor]:
    packed = torch.load(io.BytesIO(blob), weights_only=True)
    out = {}
    for name, p in packed.items():
        if "fp16" in p:
            out[name] = p["fp16"].contiguous()
            continue
        nib = p["nibbles"]
        q = torch.empty(nib.numel() * 2, dtype=torch.uint8)
        q[0::2], q[1::2] = nib & 0xF, nib >> 4
        rows, cols = p["shape"]
        g = (q.to(torch.int16) - 8).float().reshape(rows, cols // p["group"], p["group"])
        out[name] = (g * p["scale"].float()).reshape(rows, cols).half().contiguous()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pack", required=True, type=Path)
    ap.add_argument("--run", required=True, type=Path)
    args = ap.parse_args()
    chunks = sorted(args.pack.glob("chunk-*"))
    if not chunks:
        raise SystemExit(f"no chunk-NNN files in {args.pack}")
    shards = sorted(args.run.glob("target-*.safetensors"))
    if shards:  # export.py would read them together with the unpacked one
        raise SystemExit(f"{args.run} already holds {len(shards)} target shard(s) ({shards[0].name}, ...): "
                         "unpack into a folder that has only train_log.json (and the draft)")
    sd = unpack(b"".join(c.read_bytes() for c in chunks))
    save_file(sd, str(args.run / "target-00.safetensors"))
    print(f"{len(sd)} tensors, {sum(t.numel() for t in sd.values()):,} values -> {args.run / 'target-00.safetensors'}")


if __name__ == "__main__":
    main()
