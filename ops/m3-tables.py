#!/usr/bin/env python3
"""Markdown tables of the SCD translator ablations from the records ops/m3-evals.sh wrote.

    ops/m3-tables.py docs/m3 mail > /tmp/mail-ablations.md

One row per (run, method): payload share of raw bf16, KL(oracle || method) and greedy
agreement with their bootstrap 95% intervals, sorted by payload within each method, so that
each method's rows read as its payload-vs-KL frontier.
"""
import json
import pathlib
import sys


def est(e, digits):
    return f"{e['value']:.{digits}f} [{e['low']:.{digits}f}, {e['high']:.{digits}f}]"


def rows(folder, expert, prefix):
    for path in sorted(folder.glob(f"{expert}-{prefix}*.json")):
        record = json.loads(path.read_text())
        for r in record["results"]:
            if r["method"] == "oracle":
                continue
            yield path.stem[len(expert) + 1 :], r


def table(title, items):
    print(f"**{title}**\n")
    print("| run | method | payload (share of raw bf16) | KL(oracle‖method) | greedy agreement |")
    print("| --- | --- | ---: | ---: | ---: |")
    for run, r in items:
        print(
            f"| {run} | {r['method']} | {r['payload_bytes'] / 1e3:.0f} KB ({100 * r['payload_share_of_raw']:.1f}%) "
            f"| {est(r['kl'], 4)} | {est(r['greedy_agreement'], 3)} |"
        )
    print()


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: ops/m3-tables.py RECORD_FOLDER EXPERT")
    folder, expert = pathlib.Path(sys.argv[1]), sys.argv[2]
    patch = sorted(rows(folder, expert, "patch-k"), key=lambda x: int(x[0].split("k")[-1]))
    if patch:
        table(f"{expert}: patch budget k (scd at the translator's default ranks)", patch)
    frontier = list(rows(folder, expert, "rank-")) + list(rows(folder, expert, "q4-"))
    # Every q4 run measures raw again as its baseline: the same prompts give the same raw
    # figures, so one row of raw is kept.
    raw = [x for x in frontier if x[1]["method"] == "raw"][:1]
    frontier = [x for x in frontier if x[1]["method"] != "raw"] + raw
    frontier.sort(key=lambda x: (x[1]["method"], x[1]["payload_share_of_raw"]))
    if frontier:
        table(f"{expert}: payload vs KL (reuse and scd over r_K x r_V with r_H = 128, int8 codes unless the run says f16; q4 over groups)", frontier)
    if not patch and not frontier:
        sys.exit(f"no ablation records for {expert} in {folder}")


if __name__ == "__main__":
    main()
