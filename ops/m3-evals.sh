#!/usr/bin/env bash
# The SCD translator evaluation (BENCHMARKS.md, "SCD translators"): every transfer mode on each
# shipped expert, then the ablations on one expert (patch budget, the r_K x r_V frontier of reuse,
# scd and q4). Each run writes its JSON record and Markdown table under $OUT; ops/m3-tables.py turns
# the ablation records into the frontier tables.
#
#   ops/m3-evals.sh main sotu mail melville   # the main table per expert
#   ops/m3-evals.sh own mail                  # the same modes on the expert's own held-out text
#   ops/m3-evals.sh ablate mail               # patch budget and rank sweeps on one expert
#
# Needs target/release/scd, the model (ops/fetch-model.sh), WikiText-2 and SQuAD (data/, in the
# repository; SCD_EVAL_DATA points elsewhere) and each expert's translator
# (experts/<name>/translator, scd calibrate).
set -euo pipefail

SCD=${SCD:-target/release/scd}
MODEL=${MODEL:-.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-docs/m3}
# Prompts of 512 tokens (WikiText-2 windows; SQuAD prompts are the question's paragraph).
COMMON=(--prefix-tokens 512 --continuation-tokens 64 --greedy-tokens 32 --wikitext-windows 16)
QUESTIONS=${QUESTIONS:-100}
# Codes of reuse and scd: int8 with a scale per row (per token and code) by default; the f16
# point of the frontier shows what that costs.
CODES=${CODES:-i8-rows}

mkdir -p "$OUT"
what=${1:?usage: ops/m3-evals.sh main|own|ablate EXPERT...}
shift

run() { # name, then scd eval arguments
  local name=$1
  shift
  echo "== $name: $*" >&2
  "$SCD" eval --producer "$MODEL" "$@" --json "$OUT/$name.json" --markdown "$OUT/$name.md" >/dev/null
}

for e in "$@"; do
  pair=(--consumer-adapter "experts/$e/adapter.safetensors" --translator "experts/$e/translator")
  case $what in
    main)
      run "$e-main" "${pair[@]}" "${COMMON[@]}" --squad-questions "$QUESTIONS" \
        --methods oracle,raw,q4,droidspeak,reuse,scd --code-dtype "$CODES"
      ;;
    own)
      # The same modes on windows of the expert's own validation split (what it serves), no QA.
      corpus=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['corpus']['name'])" "experts/$e/manifest.json")
      run "$e-own" "${pair[@]}" "${COMMON[@]}" --squad-questions 0 --text "$corpus" \
        --methods oracle,raw,q4,droidspeak,reuse,scd --code-dtype "$CODES"
      ;;
    ablate)
      # Patch budget k at the translator's default ranks (k = 0 is Reuse alone).
      for k in 0 1 3 5 8; do
        run "$e-patch-k$k" "${pair[@]}" "${COMMON[@]}" --squad-questions 0 --methods scd \
          --code-dtype "$CODES" --patch-k "$k"
      done
      # The payload-vs-KL frontier of reuse and scd over K and V ranks (r_H = 128), int8 codes
      # (the main table has 96/192), and one f16 point; q4 over its group sizes (the main table
      # has 32).
      for kv in ${RANKS:-64,64 128,128 64,192 128,192 192,192}; do
        run "$e-rank-${kv/,/x}" "${pair[@]}" "${COMMON[@]}" --squad-questions 0 \
          --methods reuse,scd --ranks "$kv,128" --code-dtype "$CODES"
      done
      run "$e-rank-96x192-f16" "${pair[@]}" "${COMMON[@]}" --squad-questions 0 \
        --methods reuse,scd --ranks 96,192,128 --code-dtype f16
      # Groups divide the KV width (192 here): 32 (the main table), 64, 96, 192.
      for g in ${GROUPS:-64 96 192}; do
        run "$e-q4-g$g" "${pair[@]}" "${COMMON[@]}" --squad-questions 0 --methods raw,q4 --q4-group "$g"
      done
      ;;
    *)
      echo "unknown step $what: main, own or ablate" >&2
      exit 2
      ;;
  esac
done
