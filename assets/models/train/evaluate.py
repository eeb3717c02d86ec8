"""Reproduce the model card's quality figures on CPU (deterministic; ~10 minutes on 2 idle cores).

  python assets/models/train/evaluate.py [--models assets/models] [--json out.json] [--markdown out.md]

1. Held-out perplexity of both models: the held-out modules (prepare.HELDOUT) of this interpreter's standard
   library, each file wrapped as <|begin|> text <|end|>, concatenated, cut into non-overlapping 1024-token
   windows (exactly as train.py does). Also reported as bits per UTF-8 byte.
2. Greedy completions of 10 held-out prompts: one function per held-out module, prompt = its (dedented)
   signature and docstring, 80 new tokens.
3. Draft acceptance, greedy speculative decoding at K = 2, 4, 6: on 32 held-out function prompts the target's
   greedy continuation (64 tokens) is the output; at each verification the draft proposes K tokens greedily
   from the accepted text, the target accepts the longest matching prefix and adds one token of its own.
   Reported: mean tokens accepted per verification, and that divided by K (acceptance rate).

The figures in README.md were made with CPython 3.11.7's standard library; another Python version gives
other held-out files (the script says so when the file hashes differ from corpus_manifest.json).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import random
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from prepare import HELDOUT, collect  # noqa: E402

SEQ = 1024


def load(models: Path, draft_dir: Path | None = None):
    from transformers import AutoTokenizer, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(models / "target")
    target = LlamaForCausalLM.from_pretrained(models / "target", dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(draft_dir or models / "draft", dtype=torch.float32).eval()
    return tok, target, draft


def heldout_files(stdlib: Path):
    files = [(rel, text) for rel, split, text in collect(stdlib) if split == "heldout"]
    manifest = json.loads((HERE / "corpus_manifest.json").read_text())
    expected = {f: sha for f, split, _, sha in manifest["files"] if split == "heldout"}
    got = {rel: hashlib.sha256(text.encode()).hexdigest()[:16] for rel, text in files}
    same = got == expected
    if not same:
        print(f"NOTE: held-out files differ from the manifest (Python {manifest['summary']['python']}); "
              "figures will not match README.md exactly", file=sys.stderr)
    return files, same


@torch.no_grad()
def perplexity(model, stream: list[int], nbytes: int) -> dict:
    ids = torch.tensor(stream)
    tot, n, i = 0.0, 0, 0
    while i < len(ids) - 1:
        w = ids[i:i + SEQ + 1]
        logits = model(w[None, :-1]).logits[0]
        tot += F.cross_entropy(logits, w[1:], reduction="sum").item()
        n += len(w) - 1
        i += SEQ
    return {"tokens": n, "loss": round(tot / n, 4), "ppl": round(math.exp(tot / n), 3),
            "bits_per_byte": round(tot / math.log(2) / nbytes, 4)}


def function_prompts(files) -> dict[str, list[str]]:
    """Per module: dedented 'def ...:' + docstring of every function/method with a docstring and a body."""
    out: dict[str, list[str]] = {}
    for rel, text in files:
        mod = rel.split("/")[0].removesuffix(".py")
        lines = text.splitlines(keepends=True)
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body
            if len(body) < 2 or ast.get_docstring(node) is None:
                continue
            start, end = node.lineno - 1, body[0].end_lineno
            if end - start > 8:
                continue
            out.setdefault(mod, []).append(textwrap.dedent("".join(lines[start:end])))
    return out


@torch.no_grad()
def greedy(model, ids: list[int], n: int, eos: int | None) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(ids):].tolist()


@torch.no_grad()
def draft_propose(draft, ids: list[int], k: int) -> list[int]:
    out = draft(torch.tensor([ids]), use_cache=True)
    past, toks = out.past_key_values, [int(out.logits[0, -1].argmax())]
    for _ in range(k - 1):
        out = draft(torch.tensor([[toks[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        toks.append(int(out.logits[0, -1].argmax()))
    return toks


def acceptance(target, draft, prompts: list[list[int]], ks=(2, 4, 6), new=64, eos=2) -> dict:
    refs = [greedy(target, p, new, eos) for p in prompts]
    res = {}
    for k in ks:
        acc = ver = 0
        for p, ref in zip(prompts, refs):
            i = 0
            while i + k <= len(ref):
                prop = draft_propose(draft, p + ref[:i], k)
                a = 0
                while a < k and prop[a] == ref[i + a]:
                    a += 1
                acc, ver, i = acc + a, ver + 1, i + a + 1
        res[str(k)] = {"verifications": ver, "mean_accepted": round(acc / ver, 3), "rate": round(acc / ver / k, 3)}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=HERE.parent)
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--n-accept", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft", type=Path, default=None, help="another draft folder to measure")
    ap.add_argument("--parts", default="ppl,completions,acceptance")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    tok, target, draft = load(args.models, args.draft)
    parts = args.parts.split(",")
    bos, eos = tok.bos_token_id, tok.eos_token_id
    files, same = heldout_files(args.stdlib)
    res: dict = {"python": sys.version.split()[0], "heldout_files": [f for f, _ in files],
                 "heldout_matches_manifest": same}

    stream, nbytes = [], 0
    for _, text in files:
        stream += [bos, *tok(text, add_special_tokens=False)["input_ids"], eos]
        nbytes += len(text.encode())
    if "ppl" in parts:
        res["perplexity"] = {name: perplexity(m, stream, nbytes) for name, m in (("target", target), ("draft", draft))}
        print(json.dumps(res["perplexity"]), f"[{time.time() - t0:.0f}s]", flush=True)

    by_mod = function_prompts(files)
    rng = random.Random(3)
    shown = [(mod, rng.choice(by_mod[mod])) for mod in HELDOUT if by_mod.get(mod)][:10]
    for mod in HELDOUT:  # a module without a usable function (colorsys) is made up by a second pick
        rest = [p for p in by_mod.get(mod, []) if (mod, p) not in shown]
        if len(shown) < 10 and rest:
            shown.append((mod, rng.choice(rest)))
    res["completions"] = []
    for mod, prompt in (shown if "completions" in parts else []):
        ids = tok(prompt)["input_ids"]  # adds <|begin|>
        out = greedy(target, ids, 80, eos)
        res["completions"].append({"module": mod, "prompt": prompt,
                                   "completion": tok.decode(out, skip_special_tokens=False)})
    print(f"completions done [{time.time() - t0:.0f}s]", flush=True)

    pool = [p for mod in HELDOUT for p in by_mod.get(mod, [])]
    picks = random.Random(4).sample(pool, min(args.n_accept, len(pool)))
    if "acceptance" in parts:
        res["acceptance"] = acceptance(target, draft, [tok(p)["input_ids"] for p in picks], eos=eos)
        res["acceptance_prompts"] = len(picks)
        print(json.dumps(res["acceptance"]), f"[{time.time() - t0:.0f}s]", flush=True)

    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    if args.markdown:
        md = []
        for c in res["completions"]:
            body = c["prompt"] + c["completion"]
            md.append(f"**{c['module']}**\n\n```python\n{body.rstrip()}\n```\n")
        args.markdown.write_text("\n".join(md))


if __name__ == "__main__":
    main()
