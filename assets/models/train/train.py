"""Train the target model, then distil the draft model from it (one GPU, bf16 autocast).

Reads the uint16 token streams written by prepare.py and writes, under --out:
  target-NN.safetensors, draft-NN.safetensors   fp16 state dicts (transformers LlamaForCausalLM names)
  train_log.json                                  settings, step counts, loss curves, quick metrics

Step counts: pass --target-steps/--draft-steps to reproduce a run exactly; if left out, each phase
measures its step time after compilation and fits its steps into --target-seconds/--draft-seconds
(the numbers actually used are recorded in train_log.json).

Usage: python train.py --data .scratch/data --out OUTDIR
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import Llama, LlamaShape  # noqa: E402

TARGET = LlamaShape(hidden_size=384, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
                    intermediate_size=1024)
DRAFT = LlamaShape(hidden_size=192, num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=1,
                   intermediate_size=512)

T0 = time.time()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
LOG: dict = {}


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


class Data:
    def __init__(self, root: Path, device, seq: int, p_lib: float):
        ld = lambda n: torch.from_numpy(np.load(root / f"{n}.npy").astype(np.int64)).to(device)  # noqa: E731
        self.lib, self.test = ld("train_lib"), ld("train_test")
        self.valid, self.heldout = ld("valid"), ld("heldout")
        self.seq, self.p_lib, self.device = seq, p_lib, device

    def batch(self, bsz: int, gen: torch.Generator):
        n_lib = round(bsz * self.p_lib)
        rows = []
        for src, n in ((self.lib, n_lib), (self.test, bsz - n_lib)):
            starts = torch.randint(0, len(src) - self.seq - 1, (n,), generator=gen, device="cpu").to(self.device)
            rows.append(src[starts[:, None] + torch.arange(self.seq + 1, device=self.device)])
        x = torch.cat(rows)
        return x[:, :-1], x[:, 1:]

    def windows(self, stream):
        """Non-overlapping windows of seq+1 tokens (the last partial one included), for evaluation."""
        out, i = [], 0
        while i < len(stream) - 1:
            out.append(stream[i:i + self.seq + 1])
            i += self.seq
        return out


@torch.no_grad()
def eval_loss(model, data: Data, stream) -> float:
    model.eval()
    tot, n = 0.0, 0
    for w in data.windows(stream):
        with torch.autocast(DEV, dtype=torch.bfloat16):
            logits = model(w[None, :-1])
        tot += F.cross_entropy(logits.float()[0], w[1:], reduction="sum").item()
        n += len(w) - 1
    model.train()
    return tot / n


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    prog = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * prog)))


def train_phase(name, shape, data, args, seconds, steps, peak_lr, teacher=None, dropout=0.0):
    torch.manual_seed(args.seed + (0 if teacher is None else 1))
    gen = torch.Generator().manual_seed(args.seed + (10 if teacher is None else 11))
    model = Llama(shape, dropout).to(DEV)
    log(f"{name}: {model.num_params():,} parameters, dropout {dropout}, shape {shape.dict()}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.95), eps=1e-8, fused=DEV == "cuda")
    fwd = model
    if not args.no_compile:
        try:
            fwd = torch.compile(model)
        except Exception as e:  # pragma: no cover
            log(f"compile failed, eager: {e!r}")
    tfwd = teacher
    if teacher is not None and not args.no_compile:
        tfwd = torch.compile(teacher)

    def step_loss(x, y):
        with torch.autocast(DEV, dtype=torch.bfloat16):
            logits = fwd(x).float()
            ce = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
            if teacher is None:
                return ce, ce
            with torch.no_grad():
                tlogits = tfwd(x).float()
            lp_s = F.log_softmax(logits, -1)
            lp_t = F.log_softmax(tlogits, -1)
            kl = (lp_t.exp() * (lp_t - lp_s)).sum(-1).mean()
            return args.kd_alpha * kl + (1 - args.kd_alpha) * ce, ce

    curve, valid_curve = [], []
    best = (float("inf"), None, -1)
    total = steps or 10**9
    t_start = time.time()
    step, ema = 0, None
    t_measure = None
    while step < total:
        lr = lr_at(step, total if steps or step > 30 else 10**9, peak_lr, args.warmup, args.lr_floor)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = data.batch(args.batch, gen)
        if step == 0:
            try:
                loss, ce = step_loss(x, y)
            except Exception as e:  # compiler trouble: fall back to eager, same maths
                log(f"{name}: compiled step failed ({e!r:.300}); running eager")
                fwd, tfwd = model, teacher
                loss, ce = step_loss(x, y)
        else:
            loss, ce = step_loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 10:
            sync()
            t_measure = time.time()
        if step == 30 and not steps:
            sync()
            per = (time.time() - t_measure) / 20
            left = seconds - (time.time() - t_start)
            n_evals = 12
            total = 30 + int(left / (per * 1.04) - n_evals * 0.5 / per)
            log(f"{name}: {per * 1000:.1f} ms/step ({args.batch * args.seq / per / 1e6:.2f} M tok/s); "
                f"fitting {total} steps into {seconds}s")
            LOG[f"{name}_ms_per_step"] = per * 1000
        if step % 25 == 0 or step == total:
            v = ce.item()
            ema = v if ema is None else 0.9 * ema + 0.1 * v
            curve.append((step, round(v, 4), round(loss.item(), 4)))
        if total < 10**9 and (step % (args.eval_every or max(1, total // 12)) == 0 or step == total):
            vl = eval_loss(model, data, data.valid)
            ema = ce.item() if ema is None else ema
            valid_curve.append((step, round(vl, 4)))
            log(f"{name} step {step}/{total} lr {lr:.2e} train_ce {ema:.3f} valid {vl:.3f} ppl {math.exp(vl):.2f}")
            if vl < best[0]:
                best = (vl, {k: v.detach().clone() for k, v in model.state_dict().items()}, step)
    train_s = time.time() - t_start
    log(f"{name}: done {step} steps in {train_s:.0f}s; best valid {best[0]:.4f} at step {best[2]}")
    model.load_state_dict(best[1])
    model.eval()
    LOG[name] = {"params": model.num_params(), "shape": shape.dict(), "steps": step, "peak_lr": peak_lr,
                 "dropout": dropout,
                 "train_seconds": round(train_s, 1), "tokens_seen": step * args.batch * args.seq,
                 "chosen_step": best[2], "valid_loss": round(best[0], 4),
                 "heldout_loss": round(eval_loss(model, data, data.heldout), 4),
                 "curve_step_ce_loss": curve, "valid_curve": valid_curve}
    LOG[name]["heldout_ppl"] = round(math.exp(LOG[name]["heldout_loss"]), 3)
    log(f"{name}: heldout loss {LOG[name]['heldout_loss']} ppl {LOG[name]['heldout_ppl']}")
    return model


def save_fp16(model, out: Path, name: str, shard_bytes: int = 14_000_000) -> None:
    from safetensors.torch import save_file
    sd = {k: v.detach().to(torch.float16).cpu().contiguous() for k, v in model.state_dict().items()}
    assert all(torch.isfinite(v).all() for v in sd.values())
    shards, cur, size = [], {}, 0
    for k, v in sd.items():
        if cur and size + v.numel() * 2 > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = v
        size += v.numel() * 2
    shards.append(cur)
    for i, s in enumerate(shards):
        save_file(s, str(out / f"{name}-{i:02d}.safetensors"))
    log(f"saved {name}: {len(shards)} shard(s)")


@torch.no_grad()
def quick_acceptance(target, draft, data: Data, n_prompts=16, ctx=192, new=64, ks=(2, 4, 6), seed=0):
    """Greedy speculative decoding, exact: the output is the target's greedy text; count accepted drafts."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data.heldout) - ctx - 1, (n_prompts,), generator=gen)
    res = {}

    def greedy_next(m, seq):
        with torch.autocast(DEV, dtype=torch.bfloat16):
            return m(seq[None])[0, -1].float().argmax().item()

    for k in ks:
        acc, ver = 0, 0
        for s in starts.tolist():
            seq = data.heldout[s:s + ctx].clone()
            produced = 0
            while produced < new:
                prop = seq
                for _ in range(k):
                    prop = torch.cat([prop, torch.tensor([greedy_next(draft, prop)], device=seq.device)])
                with torch.autocast(DEV, dtype=torch.bfloat16):
                    tl = target(prop[None])[0, len(seq) - 1:].float().argmax(-1)
                drafted = prop[len(seq):]
                a = 0
                while a < k and drafted[a].item() == tl[a].item():
                    a += 1
                acc += a
                ver += 1
                seq = torch.cat([seq, drafted[:a], tl[a:a + 1]])
                produced += a + 1
        res[k] = {"mean_accepted": round(acc / ver, 3), "rate": round(acc / ver / k, 3)}
    return res


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=".scratch/data")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--p-lib", type=float, default=0.4, help="share of each batch drawn from non-test modules")
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--lr-floor", type=float, default=0.05)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--kd-alpha", type=float, default=0.9, help="draft loss = a*KL(target||draft) + (1-a)*CE")
    ap.add_argument("--target-seconds", type=float, default=270)
    ap.add_argument("--draft-seconds", type=float, default=170)
    ap.add_argument("--target-steps", type=int, default=0)
    ap.add_argument("--draft-steps", type=int, default=3200)
    ap.add_argument("--target-variants", default="0.1:1000,0.2:1600",
                    help="dropout:steps,...; each is trained, the lowest validation loss is kept")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--small", action="store_true", help="tiny smoke test shapes")
    return ap


def main() -> None:
    args = parser().parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    LOG["args"] = vars(args)
    LOG["env"] = {"torch": torch.__version__, "python": sys.version.split()[0],
                  "gpu": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu"}
    tshape, dshape = TARGET, DRAFT
    if args.small:
        tshape = LlamaShape(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=128)
        dshape = LlamaShape(hidden_size=32, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                            intermediate_size=64)
    data = Data(Path(args.data), DEV, args.seq, args.p_lib)

    def dump():
        (out / "train_log.json").write_text(json.dumps(LOG, indent=1))

    LOG["data_tokens"] = {n: int(len(getattr(data, n))) for n in ("lib", "test", "valid", "heldout")}


    target, best = None, float("inf")
    for i, spec in enumerate(args.target_variants.split(",")):
        dropout, steps = float(spec.split(":")[0]), int(spec.split(":")[1])
        cand = train_phase(f"target_v{i}", tshape, data, args, args.target_seconds, steps, args.target_lr,
                           dropout=dropout)
        dump()
        if LOG[f"target_v{i}"]["valid_loss"] < best:
            best, target, LOG["target"] = LOG[f"target_v{i}"]["valid_loss"], cand, LOG[f"target_v{i}"]
            LOG["target_chosen_variant"] = i
        else:
            del cand
    log(f"chosen target variant {LOG['target_chosen_variant']}")
    save_fp16(target, out, "target")
    dump()
    for p in target.parameters():
        p.requires_grad_(False)
    draft = train_phase("draft", dshape, data, args, args.draft_seconds, args.draft_steps, args.draft_lr,
                        teacher=target)
    save_fp16(draft, out, "draft")
    dump()
    LOG["quick_acceptance_bf16"] = quick_acceptance(target, draft, data)
    log(f"acceptance: {LOG['quick_acceptance_bf16']}")
    dump()
    log("all done")


if __name__ == "__main__":
    main()
