"""Second stage of the draft: fine-tune it on the target's own greedy continuations (CPU, ~15 minutes).

Speculative decoding accepts a draft token when it equals the target's greedy token, on text the target
itself is writing. So after distillation on the corpus (train.py), the draft is fine-tuned on exactly that:
prompts from TRAINING modules only (dedented function signature + docstring, as in evaluation, never from
held-out or validation modules), continued greedily by the target; the draft learns the target's tokens on
the continuation positions (cross-entropy against the target's argmax = its greedy token).

  python finetune_draft.py --models assets/models --out-log assets/models/train/finetune_log.json [--device cuda]

Overwrites assets/models/draft/model.safetensors (fp16) in place.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import sys
import sysconfig
import textwrap
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
CUTS = (16, 24, 32, 48, 64)
sys.path.insert(0, str(HERE))
from prepare import collect  # noqa: E402


def train_prompts(stdlib: Path, max_lines: int = 8) -> list[str]:
    out = []
    for rel, split, text in collect(stdlib):
        if split != "train_lib":
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(node.body) >= 2 \
                    and ast.get_docstring(node) is not None:
                start, end = node.lineno - 1, node.body[0].end_lineno
                if end - start <= max_lines:
                    out.append(textwrap.dedent("".join(lines[start:end])))
    return out


@torch.no_grad()
def generate(target, tok, prompts, new, batch, log, seconds=1e9, max_seqs=10**9):
    """Greedy continuations. Each prompt is cut to the longest of CUTS tokens it reaches, so that prompts of
    one length can be batched without padding (the continuation then finishes the docstring and the body)."""
    buckets = defaultdict(list)
    for p in prompts:
        ids = tok(p)["input_ids"]
        fit = [c for c in CUTS if c <= len(ids)]
        if fit:
            buckets[fit[-1]].append(ids[:fit[-1]])
    total = sum(map(len, buckets.values()))
    seqs, t0 = [], time.time()
    for n in sorted(buckets, reverse=True):  # longest prompts (most context) first
        group = buckets[n]
        for i in range(0, len(group), batch):
            x = torch.tensor(group[i:i + batch], device=target.device)
            y = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            seqs += [(n, row) for row in y.tolist()]
            log(f"generated {len(seqs)}/{total} ({time.time() - t0:.0f}s)")
            if time.time() - t0 > seconds or len(seqs) >= max_seqs:
                return seqs[:max_seqs]
    return seqs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=HERE.parent)
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--n-prompts", type=int, default=1536)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--gen-batch", type=int, default=48)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen-seconds", type=float, default=1e9, help="stop generating after this long")
    ap.add_argument("--max-seqs", type=int, default=192,
                    help="stop after this many continuations (the shipped draft: 192, i.e. 4 batches of 48)")
    ap.add_argument("--out-log", type=Path, default=HERE / "finetune_log.json")
    ap.add_argument("--device", default="cpu", help="torch device for generation and training (cpu, cuda)")
    args = ap.parse_args()
    from transformers import AutoTokenizer, LlamaForCausalLM
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t0 = time.time()

    def log(m):
        print(f"[{time.time() - t0:6.0f}s] {m}", flush=True)

    tok = AutoTokenizer.from_pretrained(args.models / "target")
    target = LlamaForCausalLM.from_pretrained(args.models / "target", dtype=torch.float32).to(args.device).eval()
    draft = LlamaForCausalLM.from_pretrained(args.models / "draft", dtype=torch.float32).to(args.device)
    prompts = train_prompts(args.stdlib)
    rng = random.Random(args.seed)
    rng.shuffle(prompts)
    prompts = prompts[:args.n_prompts]
    log(f"{len(prompts)} training prompts")
    seqs = generate(target, tok, prompts, args.new_tokens, args.gen_batch, log, args.gen_seconds, args.max_seqs)
    log(f"{len(seqs)} continuations")

    # Examples: input = whole sequence; labels = continuation tokens up to and including the first EOS.
    pad = tok.pad_token_id
    examples = []
    for n, row in seqs:
        labels = [-100] * n + row[n:]
        if tok.eos_token_id in row[n:]:
            cut = n + row[n:].index(tok.eos_token_id) + 1
            row, labels = row[:cut], labels[:cut]
        examples.append((row, labels))
    n_tokens = sum(sum(lab != -100 for lab in labels) for _, labels in examples)
    log(f"{n_tokens} supervised tokens")

    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps = args.epochs * math.ceil(len(examples) / args.batch)
    draft.train()
    step, curve = 0, []
    for ep in range(args.epochs):
        rng.shuffle(examples)
        for i in range(0, len(examples), args.batch):
            chunk = examples[i:i + args.batch]
            width = max(len(r) for r, _ in chunk)
            x = torch.tensor([r + [pad] * (width - len(r)) for r, _ in chunk], device=args.device)
            y = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in chunk], device=args.device)
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in chunk], device=args.device)
            lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / steps))
            for g in opt.param_groups:
                g["lr"] = lr
            logits = draft(x, attention_mask=mask).logits[:, :-1]
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y[:, 1:].reshape(-1), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 25 == 0 or step == steps:
                curve.append((step, round(loss.item(), 4)))
                log(f"epoch {ep} step {step}/{steps} loss {loss.item():.4f}")
    draft.eval()
    from safetensors.torch import save_file
    sd = {k: v.detach().to(torch.float16).cpu().contiguous() for k, v in draft.state_dict().items()
          if k != "lm_head.weight"}  # tied to model.embed_tokens.weight, as in the exported file
    save_file(sd, str(args.models / "draft" / "model.safetensors"), metadata={"format": "pt"})
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out_log.write_text(json.dumps({"settings": settings, "prompts": len(prompts), "continuations": len(seqs),
                                        "supervised_tokens": n_tokens, "steps": steps, "curve": curve,
                                        "seconds": round(time.time() - t0)}, indent=1) + "\n")
    log("saved draft")


if __name__ == "__main__":
    main()
