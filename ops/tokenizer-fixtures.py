#!/usr/bin/env python3
"""Reference fixtures for the tokenizer of scd-models (models/src/tokenizer.rs).

Produces, from implementations independent of the Rust code:
  models/tests/fixtures/tokenizer_encode.json  token ids and decodings for a set of strings
  models/tests/fixtures/tokenizer_chat.json    ChatML renderings of conversations (and their ids)

Reference implementations:
  * llama.cpp's tokenizer through llama-cpp-python (vocab-only load of the GGUF) -- the primary
    reference for ids and decodings;
  * transformers' GGUF tokenizer loading (AutoTokenizer.from_pretrained(dir, gguf_file=...)) --
    cross-check; every disagreement with llama.cpp is recorded in the fixture;
  * jinja2 rendering of the GGUF's own `tokenizer.chat_template` string, cross-checked against
    transformers' apply_chat_template.

Environment used (Python 3.11.7, one virtual environment):

  python3 -m venv /tmp/tokvenv2
  /tmp/tokvenv2/bin/pip install gguf transformers jinja2
  /tmp/tokvenv2/bin/pip install torch                     # transformers' GGUF reader imports it
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
      /tmp/tokvenv2/bin/pip install llama-cpp-python      # about 7 minutes; the native build dies with SIGILL here

The versions that produced the committed fixtures are recorded in their "generator" block.

Run from the repository root:

  /tmp/tokvenv2/bin/python ops/tokenizer-fixtures.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]

The model path defaults to $SCD_MODEL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf (SCD_MODEL_DIR defaults
to .cache/models). The wikitext paragraph is read from data/wikitext-2/valid.txt (or
$SCD_WIKITEXT) and stored verbatim in the fixture, so the Rust tests do not need the data folder.
"""

import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "models", "tests", "fixtures")
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WIKITEXT_LINE = 51  # 1-based line of valid.txt: a 960-character paragraph


def model_path():
    if len(sys.argv) > 1:
        return sys.argv[1]
    d = os.environ.get("SCD_MODEL_DIR", os.path.join(ROOT, ".cache", "models"))
    return os.path.join(d, MODEL_NAME)


def wikitext_paragraph():
    path = os.environ.get(
        "SCD_WIKITEXT", os.path.join(ROOT, "data", "wikitext-2", "valid.txt")
    )
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    return lines[WIKITEXT_LINE - 1]


def cases():
    c = [
        ("empty", ""),
        ("word", "Hello"),
        ("sentence", "Hello world! How are you doing today?"),
        ("sentence_long", "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun."),
        ("leading_space", " Hello"),
        ("leading_spaces", "   Hello"),
        ("trailing_space", "Hello "),
        ("trailing_spaces", "Hello   "),
        ("multiple_spaces", "a  b   c    d"),
        ("only_spaces", "     "),
        ("single_space", " "),
        ("newline", "line one\nline two"),
        ("newlines", "para one\n\n\npara two\n"),
        ("newline_letter", "\nb"),
        ("tabs", "a\tb\t\tc"),
        ("crlf", "windows\r\nline\r\n"),
        ("mixed_whitespace", " \t \n x \n\t"),
        ("digits", "0123456789"),
        ("integers", "I have 3 apples and 42 oranges, 1000 in total."),
        ("decimals", "pi is 3.14159 and e is 2.71828; -0.5 + 1e-9"),
        ("big_number", "The population was 1,234,567,890 in 2023."),
        ("dates", "2024-01-15, 15/01/2024 and Jan. 15th, 2024 at 09:30"),
        ("money_percent", "$19.99 (-15%) or \u20ac20,00 \u00a37"),
        ("punctuation", "Wait... what?! (Really) [yes] {no} <maybe> \"quoted\" -- dash; colon: end."),
        ("symbols", "~!@#$%^&*()_+`-=|\\/?.,<>"),
        ("contractions", "It's John's car; don't, we're, they've, I'm, you'll, she'd."),
        ("contractions_upper", "IT'S DON'T WE'RE I'M"),
        ("apostrophe_space", "rock 'n' roll 'tis"),
        ("code_python", "def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))"),
        ("code_rust", "fn main() {\n\tlet v: Vec<u32> = (0..10).collect();\n\tprintln!(\"{v:?}\");\n}"),
        ("json", "{\"key\": [1, 2.5, null, true], \"k2\": \"v\"}"),
        ("url_email", "See https://example.com/path?q=1&r=two#frag or mail me@example.org"),
        ("accents", "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe se\u00f1or"),
        ("combining", "cafe\u0301 n\u0303"),
        ("cjk", "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002\ud55c\uad6d\uc5b4"),
        ("emoji", "I love \U0001f980 and \U0001f600\U0001f44d\U0001f3fd!"),
        ("emoji_zwj", "family: \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 flag: \U0001f1fa\U0001f1f8"),
        ("rtl", "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645 \u05e9\u05dc\u05d5\u05dd"),
        ("greek_cyrillic", "\u0391\u03b8\u03ae\u03bd\u03b1 \u041c\u043e\u0441\u043a\u0432\u0430"),
        ("math_unicode", "x\u00b2 + \u00bd = \u221a2 \u2248 1.414, \u2160\u2161\u2162"),
        ("numeric_symbols", "\u00bc cup, 10\u00b3 m, \u216b o'clock, \u0661\u0662\u0663 and \uff14\uff12"),
        ("special_im", "<|im_start|>user\nHi there<|im_end|>\n"),
        ("special_inline", "text<|endoftext|>more text"),
        ("special_spaces", " <|im_end|> "),
        ("special_adjacent", "<|im_start|><|im_end|><|endoftext|>"),
        ("special_partial", "<|im_start and <|im_end| and im_end|>"),
        ("special_other", "<filename>main.rs<file_sep><gh_stars>42"),
        ("lowercase_long_word", "supercalifragilisticexpialidocious"),
        ("repeated", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"),
        ("wikitext_unk", "The <unk> was @-@ built in 1 @,@ 000 days ."),
        ("wikitext_paragraph", wikitext_paragraph()),
    ]
    names = [n for n, _ in c]
    assert len(names) == len(set(names)), "duplicate case names"
    return c


CONVERSATIONS = [
    ("no_system_single", [{"role": "user", "content": "What is the capital of France?"}]),
    (
        "system_single",
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Hi!"},
        ],
    ),
    (
        "multi_turn_no_system",
        [
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "Another one, please.\nJust the number."},
        ],
    ),
    (
        "multi_turn_system",
        [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Good morning"},
            {"role": "assistant", "content": "Bonjour \u2600\ufe0f"},
            {"role": "user", "content": "  spaces  and\ttabs \u4f60\u597d "},
        ],
    ),
    ("empty_content", [{"role": "user", "content": ""}]),
    ("system_late", [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]),
]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def versions(pkgs):
    out = {}
    for p in pkgs:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    return out


def main():
    path = model_path()
    if not os.path.exists(path):
        sys.exit(f"model not found at {path}: run `make model`")

    import gguf
    import jinja2

    reader = gguf.GGUFReader(path)
    template = reader.fields["tokenizer.chat_template"].contents()

    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
    try:
        import transformers
    except ImportError:
        transformers = None
    if llama_cpp is None and transformers is None:
        sys.exit("neither llama-cpp-python nor transformers is installed (see the header)")

    llm = None
    if llama_cpp is not None:
        llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)

    hf = None
    if transformers is not None:
        # transformers wants a directory and a file name inside it.
        tmp = tempfile.mkdtemp()
        os.symlink(os.path.abspath(path), os.path.join(tmp, MODEL_NAME))
        hf = transformers.AutoTokenizer.from_pretrained(tmp, gguf_file=MODEL_NAME)
        shutil.rmtree(tmp)

    def ref_ids(text, special):
        if llm is not None:
            return llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
        return None

    def hf_ids(text, special):
        if hf is None:
            return None
        if special:
            return hf.encode(text, add_special_tokens=False)
        return hf.encode(text, add_special_tokens=False, split_special_tokens=True)

    def ref_decode(ids):
        if llm is not None:
            return llm.detokenize(ids, special=True).decode("utf-8", errors="replace")
        return hf.decode(ids, skip_special_tokens=False)

    primary = "llama.cpp (llama-cpp-python)" if llm is not None else "transformers"
    disagreements = []
    out_cases = []
    for name, text in cases():
        rec = {"name": name, "text": text}
        for key, special in (("ids", True), ("ids_plain", False)):
            a = ref_ids(text, special)
            b = hf_ids(text, special)
            if a is None:
                a = b
            elif b is not None and a != b:
                disagreements.append({"case": name, "mode": key, "llama_cpp": a, "transformers": b})
            rec[key] = a
        rec["decoded"] = ref_decode(rec["ids"])
        if hf is not None:
            hd = hf.decode(rec["ids"], skip_special_tokens=False)
            if hd != rec["decoded"]:
                disagreements.append({"case": name, "mode": "decoded", "llama_cpp": rec["decoded"], "transformers": hd})
        out_cases.append(rec)

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    tmpl = env.from_string(template)
    out_chats = []
    chat_disagreements = []
    for name, messages in CONVERSATIONS:
        for gen in (False, True):
            rendered = tmpl.render(messages=messages, add_generation_prompt=gen)
            rec = {"name": name, "messages": messages, "add_generation_prompt": gen, "rendered": rendered}
            if hf is not None:
                hr = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
                if hr != rendered:
                    chat_disagreements.append({"case": name, "add_generation_prompt": gen, "jinja2": rendered, "transformers": hr})
            rec["ids"] = ref_ids(rendered, True) if llm is not None else hf_ids(rendered, True)
            out_chats.append(rec)

    cmd = "python ops/tokenizer-fixtures.py " + " ".join(sys.argv[1:])
    generator = {
        "command": cmd.strip(),
        "script": "ops/tokenizer-fixtures.py",
        "model": MODEL_NAME,
        "python": platform.python_version(),
        "model_sha256": sha256(path),
        "packages": versions(["llama_cpp_python", "transformers", "tokenizers", "torch", "gguf", "jinja2"]),
        "primary_reference": primary,
        "ids": "llama.cpp tokenize(add_bos=False, special=True): special-token text is matched whole",
        "ids_plain": "llama.cpp tokenize(add_bos=False, special=False): special-token text is ordinary text",
        "decoded": "llama.cpp detokenize(ids, special=True), UTF-8 with replacement",
        "cross_check": "transformers AutoTokenizer.from_pretrained(dir, gguf_file=...)" if hf is not None else None,
        # What transformers built from the GGUF, to explain disagreements: its GGUF converter
        # ignores tokenizer.ggml.pre, so it lacks llama.cpp's digit isolation for "smollm".
        "cross_check_pre_tokenizer": json.loads(hf.backend_tokenizer.to_str())["pre_tokenizer"] if hf is not None else None,
    }
    os.makedirs(FIXTURES, exist_ok=True)
    with open(os.path.join(FIXTURES, "tokenizer_encode.json"), "w", encoding="utf-8") as f:
        json.dump(
            {"generator": generator, "disagreements": disagreements, "cases": out_cases},
            f, ensure_ascii=False, indent=1,
        )
        f.write("\n")
    chat_gen = dict(generator)
    chat_gen["rendered"] = "jinja2 rendering (trim_blocks, lstrip_blocks) of the GGUF's tokenizer.chat_template"
    chat_gen["ids"] = "reference tokenization of `rendered` with special-token matching"
    with open(os.path.join(FIXTURES, "tokenizer_chat.json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "generator": chat_gen,
                "chat_template": template,
                "disagreements": chat_disagreements,
                "conversations": out_chats,
            },
            f, ensure_ascii=False, indent=1,
        )
        f.write("\n")
    print(f"{len(out_cases)} cases, {len(out_chats)} chat renderings; primary reference: {primary}")
    print(f"disagreements llama.cpp vs transformers: {len(disagreements)} (ids/decoded), {len(chat_disagreements)} (chat)")
    for d in disagreements + chat_disagreements:
        print("  ", json.dumps(d, ensure_ascii=False)[:300])


if __name__ == "__main__":
    main()
