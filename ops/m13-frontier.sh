#!/bin/bash
# The quality-bytes frontier on held-out WikiText-2, per expert: raw, q4 and q2, and reuse, scd
# and kvtc (raw KV transform-coded in the base's own basis, the like-for-like baseline) at the
# rates the translator's rate table says give 6-20% of raw's bytes (scd translators rates,
# scd translators kvtc), and droidspeak (raw KV, a few layer blocks recomputed: a point near
# raw's bytes) on the same windows in a record of its own. Writes
# docs/m13/<expert>-frontier.{json,md,svg,png} and docs/m13/<expert>-droidspeak.{json,md}. Usage:
#   ops/m13-frontier.sh mail-rope mail sotu melville
cd "$(dirname "$0")/.."
M=.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
steps_for() {
  python3 - "$1" "$2" <<'PY'
import json, math, sys
t = json.load(open(f"experts/{sys.argv[1]}/translator/translator.json"))["rate_table"]
pts = sorted((p["bytes_share"][0], math.log(p["step"])) for p in t["points"] if p["mode"] == sys.argv[2])
out = []
for share in [0.06, 0.08, 0.10, 0.115, 0.15, 0.20]:
    for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
        if b0 <= share <= b1:
            f = (share - b0) / (b1 - b0) if b1 > b0 else 0
            out.append("%.3f" % math.exp(s0 + f * (s1 - s0)))
            break
print(",".join(out))
PY
}
for e in "$@"; do
  steps=$(steps_for "$e" scd)
  kvtc=$(steps_for "$e" kvtc)
  echo "== $e steps scd $steps kvtc $kvtc $(date)"
  target/release/scd eval --producer $M --consumer-adapter experts/$e/adapter.safetensors \
    --translator experts/$e/translator --methods raw,q4,q2,kvtc,reuse,scd --code-dtype tc \
    --tc-steps "$steps" --kvtc-steps "$kvtc" \
    --prefix-tokens 512 --continuation-tokens 64 --greedy-tokens 16 --wikitext-windows 8 --squad-questions 0 \
    --json docs/m13/$e-frontier.json --markdown docs/m13/$e-frontier.md 2>&1 | grep "^| "
  target/release/scd eval --producer $M --consumer-adapter experts/$e/adapter.safetensors \
    --translator experts/$e/translator --methods raw,droidspeak \
    --prefix-tokens 512 --continuation-tokens 64 --greedy-tokens 16 --wikitext-windows 8 --squad-questions 0 \
    --json docs/m13/$e-droidspeak.json --markdown docs/m13/$e-droidspeak.md 2>&1 | grep "^| "
  target/release/scd eval plot --json docs/m13/$e-frontier.json --json docs/m13/$e-droidspeak.json \
    --out docs/m13/$e-frontier --title $e
done
date
