"""Train a larger code target (~280 M) on the demo corpus, distil a draft from it, score drafts (one GPU).

The shipped demo target (15.7 M) decodes in ~2 ms a token on a CPU, so every call of it is mostly the
plugin's fixed cost and speculative decoding has little to save. This target is big enough that a decode
step is weight reads and arithmetic (tens of ms on two cores), like the models deskfleet is for; it uses
the demo corpus, splits and tokenizer, so the same held-out prompts measure it. It is a benchmark model,
not shipped (too large for the repository): README says how to rebuild it.

Writes, under --out:
  target-NN.safetensors, draft-NN.safetensors   fp16 state dicts (transformers LlamaForCausalLM names;
                                                  no draft with --draft-seconds 0)
  train_log.json                                  settings, curves, and acceptance of each draft scored
  pack/chunk-NNN                                  the target's state dict as int4 (group --pack-group,
                                                  fp16 scales) in 15 MiB pieces, for a transfer that
                                                  limits bytes; unpack_int4.py rebuilds fp16 from them

Usage: python train_code_target.py --data .scratch/data --out OUTDIR [--score-draft DIR ...]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train  # noqa: E402
from model import Llama, LlamaShape  # noqa: E402

CODE_TARGET = LlamaShape(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
                         intermediate_size=2816)
CHUNK_BYTES = 15 * 2**20
MIN_DRAFT_SECONDS = 30  # a draft phase shorter than this may fit no validation pass (see main)


def load_hf_folder(folder: Path) -> Llama:
    """A shipped model folder (config.json + model.safetensors) as train/model.py's Llama, in eval mode."""
    cfg = json.loads((folder / "config.json").read_text())
    shape = LlamaShape(hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_hidden_layers"],
                       num_attention_heads=cfg["num_attention_heads"],
                       num_key_value_heads=cfg["num_key_value_heads"], intermediate_size=cfg["intermediate_size"],
                       vocab_size=cfg["vocab_size"], max_position_embeddings=cfg["max_position_embeddings"])
    model = Llama(shape, 0.0)
    model.load_state_dict({k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()})
    return model.to(train.DEV).eval()


def pack_int4(model: Llama, group: int) -> bytes:
    """Symmetric round-to-nearest int4 per group of `group` inputs for the layers' matrices; fp16 for the
    (tied) embedding and the norms."""
    packed: dict[str, dict] = {}
    for name, w in model.state_dict().items():
        w = w.detach().float().cpu()
        if w.dim() < 2 or w.shape[-1] % group or name.endswith("embed_tokens.weight"):  # embed = tied head
            packed[name] = {"fp16": w.half()}
            continue
        g = w.reshape(w.shape[0], -1, group)
        scale = (g.abs().amax(-1, keepdim=True) / 7.0).clamp_min(1e-8)
        q = torch.clamp(torch.round(g / scale), -8, 7).to(torch.int8) + 8  # 0..15
        flat = q.reshape(-1).to(torch.uint8)
        packed[name] = {"nibbles": (flat[0::2] | (flat[1::2] << 4)).contiguous(), "scale": scale.half(),
                        "shape": list(w.shape), "group": group}
    buf = io.BytesIO()
    torch.save(packed, buf)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=".scratch/data")
    ap.add_argument("--out", required=True)
    ap.add_argument("--target-seconds", type=float, default=420)
    ap.add_argument("--target-lr", type=float, default=8e-4)
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--draft-seconds", type=float, default=150, help="0: no distilled draft, only the target")
    ap.add_argument("--score-draft", action="append", default=[], help="a model folder to score as a draft")
    ap.add_argument("--pack-group", type=int, default=32)
    ap.add_argument("--small", action="store_true", help="tiny smoke-test shapes and times")
    args, rest = ap.parse_known_args()
    # A phase measures its step time over its first 30 steps, then fits its steps and validations into the rest:
    # a few seconds leave it no validation, so no step to keep, and the run crashed after the target's minutes.
    if args.draft_seconds != 0 and not args.draft_seconds >= MIN_DRAFT_SECONDS:
        ap.error(f"--draft-seconds must be 0 (no draft) or at least {MIN_DRAFT_SECONDS:g}, not {args.draft_seconds:g}")
    # the phases read train.py's settings (batch, seq, warm-up, weight decay, ...): its defaults, or `rest`
    targs = train.parser().parse_args(rest)
    targs.out, targs.data = args.out, args.data
    out = Path(args.out)
    (out / "pack").mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    shape, dshape = CODE_TARGET, train.DRAFT
    if args.small:
        shape = LlamaShape(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           intermediate_size=128)
        dshape = LlamaShape(hidden_size=32, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                            intermediate_size=64)
    log = train.LOG
    log["args"] = {**vars(args), "train_defaults": vars(targs)}
    log["env"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if train.DEV == "cuda" else "cpu"}
    data = train.Data(Path(args.data), train.DEV, targs.seq, targs.p_lib)

    def dump() -> None:
        (out / "train_log.json").write_text(json.dumps(log, indent=1))

    target = train.train_phase("target", shape, data, targs, args.target_seconds, 0, args.target_lr,
                               dropout=args.dropout)
    train.save_fp16(target, out, "target")
    blob = pack_int4(target, args.pack_group)
    for i in range(0, len(blob), CHUNK_BYTES):
        (out / "pack" / f"chunk-{i // CHUNK_BYTES:03d}").write_bytes(blob[i:i + CHUNK_BYTES])
    log["pack"] = {"bytes": len(blob), "chunks": -(-len(blob) // CHUNK_BYTES), "group": args.pack_group}
    dump()
    (out / "PACKED").write_text("ok")
    for p in target.parameters():
        p.requires_grad_(False)
    scores = {}
    if args.draft_seconds > 0:
        draft = train.train_phase("draft", dshape, data, targs, args.draft_seconds, 0, targs.draft_lr,
                                  teacher=target)
        train.save_fp16(draft, out, "draft")
        dump()
        scores["distilled draft"] = train.quick_acceptance(target, draft, data)
    for folder in args.score_draft:
        scores[folder] = train.quick_acceptance(target, load_hf_folder(Path(folder)), data)
    log["quick_acceptance_bf16"] = scores
    train.log(f"acceptance: {json.dumps(scores)}")
    dump()
    (out / "DONE").write_text("ok")
    train.log("all done")


if __name__ == "__main__":
    main()
