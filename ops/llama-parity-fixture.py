#!/usr/bin/env python3
"""Reference logits from llama.cpp for the model-parity test (models/tests/llama_parity.rs).

Runs llama.cpp (through llama-cpp-python) over the same 1,024 tokens in two set-ups and writes
  models/tests/fixtures/llama_parity.json   provenance, the token ids, the layout of the .bin
  models/tests/fixtures/llama_parity.bin    the numbers (little-endian), as laid out in the .json

The two references:
  * "q4_1": the GGUF exactly as shipped and as users run it: llama.cpp's defaults of
    llama-cpp-python 0.3 (f16 KV cache, no flash attention). llama.cpp multiplies Q4_1 weights
    with activations quantized to 8 bits (Q8_1), which our f32 model does not do, so this
    reference differs from ours by that rounding.
  * "f32": the same weights dequantized to f32 by llama.cpp itself (llama_model_quantize to
    LLAMA_FTYPE_ALL_F32 with requantizing allowed), run with an f32 KV cache: llama.cpp's f32
    arithmetic on exactly the weights our model loads, so what is left is summation order.

For every reference and every position: the log-normaliser log Z = logsumexp(logits), the top-K
token ids and their logits (K below), f32. For the first and last row of every 256-row attention
chunk (both sides of every chunk boundary): the full logit vector, f32 for "f32" and f16 for
"q4_1" (see FULL_DTYPE). About 2.9 MB in all.

The tokens: the WikiText-2 validation prose the Rust tests use (lines longer than 200 characters,
the first 20, joined by newlines), tokenized by llama.cpp without BOS and without special-token
matching, the first 1,024 ids.

Environment: `ops/install-llama-cpp.sh` (llama-cpp-python built from source with the instruction
sets named, into .cache/llama-cpp). Run from the repository root:

  .cache/llama-cpp/bin/python ops/llama-parity-fixture.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]

The model path defaults to $SCD_MODEL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf (SCD_MODEL_DIR defaults
to .cache/models); the text to data/wikitext-2/valid.txt (or $SCD_WIKITEXT). The
versions and the command that produced the committed fixture are in its "generator" block.
"""

import hashlib
import json
import os
import platform
import sys
import tempfile
from importlib import metadata

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "models", "tests", "fixtures")
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
N_TOKENS = 1024
TOP_K = 32
CHUNK = 256  # models/src/llama.rs ATTN_CHUNK
THREADS = 2
# The full rows of "q4_1" differ from ours by 0.1 to a few logits, so f16 (a rounding of at most
# 0.008 below 16) loses nothing and halves the file; those of "f32" agree with ours to 1e-4 and
# stay f32.
FULL_DTYPE = {"q4_1": "float16", "f32": "float32"}


def full_positions():
    """Positions whose whole logit vector is stored: the first and the last row of every
    attention chunk, so both sides of every chunk boundary (255|256, 511|512, 767|768)."""
    return sorted({p for c in range(0, N_TOKENS, CHUNK) for p in (c, min(c + CHUNK, N_TOKENS) - 1)})


def model_path():
    if len(sys.argv) > 1:
        return sys.argv[1]
    d = os.environ.get("SCD_MODEL_DIR", os.path.join(ROOT, ".cache", "models"))
    return os.path.join(d, MODEL_NAME)


def prose():
    path = os.environ.get(
        "SCD_WIKITEXT", os.path.join(ROOT, "data", "wikitext-2", "valid.txt")
    )
    with open(path, encoding="utf-8") as f:
        lines = [l for l in f.read().split("\n") if len(l) > 200]
    return "\n".join(lines[:20])


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def run(llama_cpp, path, tokens, **kw):
    llm = llama_cpp.Llama(
        model_path=path,
        n_ctx=N_TOKENS,
        n_batch=N_TOKENS,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        logits_all=True,
        verbose=False,
        **kw,
    )
    llm.eval(tokens)
    scores = np.array(llm.scores[: len(tokens)], dtype=np.float32, copy=True)
    settings = {
        "n_ctx": N_TOKENS,
        "n_batch": N_TOKENS,
        "n_ubatch": llm.context_params.n_ubatch,
        "n_threads": THREADS,
        "logits_all": True,
        "type_k": int(llm.context_params.type_k),
        "type_v": int(llm.context_params.type_v),
        "flash_attn_type": int(llm.context_params.flash_attn_type),
    }
    del llm
    return scores, settings


def summarise(scores):
    x = scores.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    log_z = (m[:, 0] + np.log(np.exp(x - m).sum(axis=1))).astype(np.float64)
    # Top-K by logit, ties broken by the smaller id (a stable sort of -logit).
    order = np.argsort(-scores, axis=1, kind="stable")[:, :TOP_K].astype(np.uint32)
    top = np.take_along_axis(scores, order.astype(np.int64), axis=1).astype(np.float32)
    return log_z, order, top


def main():
    path = model_path()
    if not os.path.exists(path):
        sys.exit(f"model not found at {path}: run `make model`")
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    tokens = vocab.tokenize(prose().encode("utf-8"), add_bos=False, special=False)
    if len(tokens) < N_TOKENS:
        sys.exit(f"only {len(tokens)} tokens of text, need {N_TOKENS}")
    tokens = tokens[:N_TOKENS]
    del vocab

    refs = {}
    scores, settings = run(llama_cpp, path, tokens)
    refs["q4_1"] = (scores, settings, "the shipped Q4_1 GGUF, llama-cpp-python's default context settings")

    with tempfile.TemporaryDirectory() as tmp:
        f32_path = os.path.join(tmp, "model-f32.gguf")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
        params.allow_requantize = True
        params.nthread = THREADS
        rc = llama_cpp.llama_model_quantize(path.encode(), f32_path.encode(), params)
        if rc != 0:
            sys.exit(f"llama_model_quantize to F32 failed: {rc}")
        f32_sha = sha256(f32_path)
        scores, settings = run(
            llama_cpp, f32_path, tokens, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32
        )
        settings["weights"] = "llama_model_quantize(ftype=LLAMA_FTYPE_ALL_F32, allow_requantize=True)"
        settings["weights_sha256"] = f32_sha
        refs["f32"] = (scores, settings, "the same weights dequantized to f32 by llama.cpp, f32 KV cache")

    positions = full_positions()
    blob = bytearray()
    sections = []

    def put(name, arr):
        arr = np.ascontiguousarray(arr)
        dtype = {"f2": "f16", "f4": "f32", "f8": "f64", "u4": "u32"}[arr.dtype.str[1:]]
        sections.append({"name": name, "dtype": dtype, "shape": list(arr.shape), "offset": len(blob)})
        blob.extend(arr.astype(arr.dtype.newbyteorder("<")).tobytes())

    references = {}
    for name, (scores, settings, what) in refs.items():
        log_z, top_ids, top_logits = summarise(scores)
        put(f"{name}.log_z", log_z)
        put(f"{name}.top_ids", top_ids)
        put(f"{name}.top_logits", top_logits)
        put(f"{name}.full_logits", scores[positions].astype(FULL_DTYPE[name]))
        references[name] = {"what": what, "settings": settings, "full_logits_dtype": FULL_DTYPE[name]}

    try:
        llama_version = llama_cpp.llama_version().decode()
    except AttributeError:
        llama_version = None
    generator = {
        "command": ("python ops/llama-parity-fixture.py " + " ".join(sys.argv[1:])).strip(),
        "script": "ops/llama-parity-fixture.py",
        "install": "ops/install-llama-cpp.sh",
        "model": MODEL_NAME,
        "model_sha256": sha256(path),
        "python": platform.python_version(),
        "llama_cpp_python": metadata.version("llama_cpp_python"),
        "llama_cpp_version_reported": llama_version,
        "numpy": np.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "tokens": "WikiText-2 valid.txt: lines longer than 200 characters, the first 20 joined by '\\n', "
        "llama.cpp tokenize(add_bos=False, special=False), the first 1,024 ids",
    }
    meta = {
        "generator": generator,
        "vocab_size": int(refs["q4_1"][0].shape[1]),
        "top_k": TOP_K,
        "top_k_order": "descending logit, ties by smaller id",
        "log_z": "logsumexp of the full logit vector, computed in f64",
        "full_positions": positions,
        "references": references,
        "bin": "llama_parity.bin",
        "sections": sections,
        "tokens": tokens,
    }
    os.makedirs(FIXTURES, exist_ok=True)
    with open(os.path.join(FIXTURES, "llama_parity.bin"), "wb") as f:
        f.write(blob)
    with open(os.path.join(FIXTURES, "llama_parity.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(f"{N_TOKENS} tokens, {len(positions)} full rows, {len(blob) / 1e6:.1f} MB of numbers")


if __name__ == "__main__":
    main()
