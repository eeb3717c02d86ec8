#!/bin/bash
# Run S19 on the lent machine: install, train the 279M code target (200 s), export, fine-tune the draft,
# export it, then the code-target bench (2 and 3 PCs, 2 rounds) with this checkout (SWITCH_MARGIN 0.05, "a") and
# the same with SWITCH_MARGIN 0.15 ("b", installed as the "old" wheel) in the order a, b, b, a.
# Started with setsid from the repo root copy (carrying .whl, .whl2 and .devrun19: scratch.tar.xz, this script and
# s18-device-collect.sh with s19 for s18 as wait19.sh); works in /tmp/s19 so a later call's re-sent tree cannot disturb it. Writes /tmp/s19/STATUS at the end.
set -u
export PYTHONUNBUFFERED=1
W=/tmp/s19; mkdir -p $W/out
t0=$SECONDS
ts() { echo "=== [$(date +%T)] +$((SECONDS-t0))s $*"; }
fail() { ts "FAILED: $*"; echo "FAILED $*" > $W/STATUS; exit 1; }
ts install; nproc; nvidia-smi -L; python3 --version
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || fail pip
tar -xJf .whl2/openvino.tar.xz -C /tmp/site || fail openvino-tar
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-old .whl2/old/*.whl || fail pip-old
export PYTHONPATH=/tmp/site
python3 -c 'import openvino as ov, nncf, deskfleet, deskfleet.controller.cli, cryptography, zeroconf, websockets, uvloop, jinja2, psutil, platformdirs; print("ov", ov.__version__, "nncf", nncf.__version__, ov.Core().available_devices)' || fail imports
mkdir -p $W/assets && cp -r assets/models $W/assets/ || fail copy-assets
tar -xJf .devrun19/scratch.tar.xz -C $W || fail untar
cd $W
cmp .scratch/tokenizer/tokenizer.json assets/models/draft/tokenizer.json || fail tokenizer-differs
ts train
python3 assets/models/train/train_code_target.py --data .scratch/data --out run-code --draft-seconds 0 --target-seconds 200 > out/train-stdout.log 2>&1 || { tail -30 out/train-stdout.log; fail train; }
tail -5 out/train-stdout.log
cp run-code/train_log.json out/s19-train-log.json
python3 -c 'import json,math; t=json.load(open("run-code/train_log.json"))["target"]; print("steps", t["steps"], "train_s", t["train_seconds"], "chosen", t["chosen_step"], "valid", t["valid_loss"], "heldout", t["heldout_loss"], "ppl %.2f" % math.exp(t["heldout_loss"]))'
ts export target
python3 assets/models/train/export.py --run run-code --tokenizer .scratch/tokenizer --dest code-models --names target || fail export-hf
python3 -m deskfleet.controller.cli export code-models/target -o code-target-int4 --weights int4 || fail export-target
ts finetune
cp -r assets/models/draft code-models/draft || fail copy-draft
python3 assets/models/train/finetune_draft.py --models code-models --max-seqs 384 --device cuda --out-log out/s19-finetune-log.json > out/finetune-stdout.log 2>&1 || { tail -30 out/finetune-stdout.log; fail finetune; }
tail -3 out/finetune-stdout.log
python3 -m deskfleet.controller.cli export code-models/draft -o code-draft-int4 --weights int4 || fail export-draft
du -sh code-target-int4 code-draft-int4
CODE="--demo-target code-target-int4 --demo-draft code-draft-int4 --kv-cache f32 --pcs 3 --controller-cores 2 --threads-per-pc 2 --rounds 2 --new-tokens 64 --drafters spec --fixed-k 3 5 8 --no-wan"
for run in code-a1 code-b1 code-b2 code-a2; do
  ts $run bench
  case $run in *-b*) path=/tmp/site-old:/tmp/site;; *) path=/tmp/site;; esac
  PYTHONPATH=$path python3 -c 'import deskfleet.common.speculative as s; print("SWITCH_MARGIN", s.SWITCH_MARGIN)'
  PYTHONPATH=$path python3 -m deskfleet.controller.cli bench fleet $CODE --json-out out/s19-$run.json --markdown-out out/s19-$run.md > out/s19-$run.log 2>&1
  echo "$run bench rc $?"
done
ts done
echo DONE > $W/STATUS
