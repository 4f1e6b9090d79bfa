#!/usr/bin/env python3
"""llama.cpp's side of `scd bench model`: prefill and decode timings of a GGUF through
llama-cpp-python, under the same protocol as the Rust implementations in the same run.

The bench (src/cmd/bench_model.rs) runs this script with the Python of the llama.cpp environment
(ops/install-llama-cpp.sh) and writes one JSON request to its standard input:

  {"model": PATH, "threads": 2, "warmup": W, "reps": R,
   "prefill": [[token ids], ...], "decode_prompts": [[token ids], ...], "decode_warmup": W2,
   "decode_steps": N}

and reads one JSON object from its standard output:

  {"installed": true, "llama_cpp_python": VERSION, "llama_cpp": VERSION, "settings": {...},
   "prefill": [{"tokens": T, "seconds": [s, ...]}, ...],   # the R timed runs, after W untimed
   "decode": [{"after": T, "steps": N, "seconds": s}, ...]}  # per decode prompt: N timed greedy
                                                              # steps after W2 untimed

or {"installed": false, "reason": ...} with exit status 3 when llama_cpp cannot be imported.

Protocol, the same as the Rust side's: a prefill starts from an empty KV cache and computes the
last position's logits only; decode prefills each decode prompt, runs W2 untimed greedy steps, then
times N greedy steps (each feeds the argmax of the previous step's logits). llama.cpp runs with
llama-cpp-python's default context settings (f16 KV cache, micro-batches of 512) and the thread
count given.
"""

import json
import sys
import time
from importlib import metadata


def main():
    try:
        import llama_cpp
        import numpy as np
    except ImportError as e:
        json.dump({"installed": False, "reason": f"{e} (python: {sys.executable})"}, sys.stdout)
        sys.exit(3)

    req = json.load(sys.stdin)
    longest = max([len(t) for t in req["prefill"]] + [len(t) for t in req["decode_prompts"]])
    n_ctx = longest + req["decode_warmup"] + req["decode_steps"] + 1
    llm = llama_cpp.Llama(
        model_path=req["model"],
        n_ctx=n_ctx,
        n_batch=longest,
        n_threads=req["threads"],
        n_threads_batch=req["threads"],
        logits_all=False,
        verbose=False,
    )
    n_vocab = llm.n_vocab()

    def last_argmax():
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
        return int(np.argmax(logits))

    def prefill(tokens):
        llm.reset()
        t = time.perf_counter()
        llm.eval(tokens)
        last_argmax()  # the Rust side's prefill ends with the argmax too
        return time.perf_counter() - t

    prefill_rows = []
    for tokens in req["prefill"]:
        for _ in range(req["warmup"]):
            prefill(tokens)
        prefill_rows.append({"tokens": len(tokens), "seconds": [prefill(tokens) for _ in range(req["reps"])]})

    decode_rows = []
    for prompt in req["decode_prompts"]:
        prefill(prompt)
        nxt = last_argmax()
        for _ in range(req["decode_warmup"]):
            llm.eval([nxt])
            nxt = last_argmax()
        t = time.perf_counter()
        for _ in range(req["decode_steps"]):
            llm.eval([nxt])
            nxt = last_argmax()
        decode_s = time.perf_counter() - t
        decode_rows.append({"after": len(prompt), "steps": req["decode_steps"], "seconds": decode_s})

    try:
        llama_version = llama_cpp.llama_version().decode()
    except AttributeError:
        llama_version = None
    out = {
        "installed": True,
        "llama_cpp_python": metadata.version("llama_cpp_python"),
        "llama_cpp": llama_version,
        "settings": {
            "n_ctx": n_ctx,
            "n_batch": longest,
            "n_ubatch": llm.context_params.n_ubatch,
            "n_threads": req["threads"],
            "type_k": int(llm.context_params.type_k),
            "type_v": int(llm.context_params.type_v),
            "flash_attn_type": int(llm.context_params.flash_attn_type),
        },
        "prefill": prefill_rows,
        "decode": decode_rows,
    }
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
