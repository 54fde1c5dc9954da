#!/usr/bin/env python3
"""tokenizer_diff: lamina's tokenizer against Hugging Face `tokenizers` on random text.

    python3 tools/tokenizer_diff.py -m VOCAB.gguf [-n 1000] [--seed 1] [--lamina build/lamina]

Builds a byte-level BPE tokenizer for the `tokenizers` package from the GGUF's own vocabulary,
merges and token types (no normalizer, as llama.cpp has none; the pre-tokenizer regex of the
file's tokenizer.ggml.pre: qwen2 or qwen35, docs/model-spec.md 7.3), checks it on the llama.cpp
test vectors beside the file (VOCAB.gguf.inp / .out) where they exist, then tokenizes N random
strings (words, contractions, digits, whitespace runs, many scripts, combining marks, emoji,
code) with `lamina tokenize --ids` and with it, and prints every difference. Exit status 1 when
any differs. Needs `pip install tokenizers`; a development check, not part of `make test`.
"""
import argparse
import json
import os
import random
import struct
import subprocess
import sys
import tempfile

REGEX = {
    "qwen2": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    "qwen35": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
}
SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
GGUF_STRING, GGUF_ARRAY = 8, 9


def read_kvs(path):
    """The key-value pairs of a GGUF file (version 2 or 3), as a dict."""
    with open(path, "rb") as f:
        b = f.read()

    def take(o, fmt):
        return struct.unpack_from("<" + fmt, b, o)[0], o + struct.calcsize(fmt)

    def string(o):
        n, o = take(o, "Q")
        return b[o:o + n].decode("utf-8", "replace"), o + n

    def value(o, t):
        if t == GGUF_STRING:
            return string(o)
        if t == GGUF_ARRAY:
            et, o = take(o, "I")
            n, o = take(o, "Q")
            out = []
            for _ in range(n):
                v, o = value(o, et)
                out.append(v)
            return out, o
        return take(o, SCALAR[t])

    if b[:4] != b"GGUF":
        sys.exit(f"{path}: not a GGUF file")
    o = 8
    _, o = take(o, "Q")  # tensors
    n_kv, o = take(o, "Q")
    kvs = {}
    for _ in range(n_kv):
        k, o = string(o)
        t, o = take(o, "I")
        kvs[k], o = value(o, t)
    return kvs


def hf_tokenizer(kvs):
    from tokenizers import Tokenizer

    pre = kvs.get("tokenizer.ggml.pre", "qwen2")
    if pre not in REGEX:
        sys.exit(f"tokenizer.ggml.pre '{pre}': this check knows {', '.join(REGEX)}")
    toks, types = kvs["tokenizer.ggml.tokens"], kvs["tokenizer.ggml.token_type"]
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": types[i] == 3}
             for i, t in enumerate(toks) if types[i] != 1]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "post_processor": None, "decoder": byte_level,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": REGEX[pre]}, "behavior": "Isolated",
             "invert": False}, byte_level]},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(toks) if types[i] == 1},
                  "merges": kvs["tokenizer.ggml.merges"]},
    }
    return Tokenizer.from_str(json.dumps(spec)), pre


PIECES = [
    "the", "The", " the", "Hello", "world", "I'm", "you'RE", "it's", "we'll", "he'd", "'S", "'ve",
    "123", "4567890", "3.14", "1,000", "0x1F", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n",
    "\n ", "\t\n", " ", "  \n\n  ", "!", "?!", "...", "\u2014", "\u00ab", "\"", "(", ")", "{", "}",
    "[]", "<", ">", "</", "/>", "#", "@", "$", "%", "^&*", "_", "__init__", "::", "->", "==",
    "caf\u00e9", "cafe\u0301", "na\u00efve", "stra\u00dfe", "\u01c5", "\ufb01", "\u216b", "\u00bd",
    "\u0663", "\u096a", "\u65e5\u672c\u8a9e", "\u4e2d\u6587", "\ud55c\uad6d\uc5b4",
    "\u3053\u3093\u306b\u3061\u306f", "\u041f\u0440\u0438\u0432\u0435\u0442",
    "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac", "\u05e2\u05d1\u05e8\u05d9\u05ea",
    "\u0627\u0644\u0639\u0631\u0628\u064a\u0629", "\u0939\u093f\u0928\u094d\u0926\u0940",
    "\u0ba4\u0bae\u0bbf\u0bb4\u0bcd", "\u0e44\u0e17\u0e22", "\U0001f600", "\U0001f44d\U0001f3fd",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467", "\U0001f1eb\U0001f1f7", "\u2764\ufe0f",
    "\u200b", "\ufeff", "\u00a0", "\u2028", "\u3000", "def f(x):", "    return x", "import os",
    "#include <stdio.h>", "int main(void) {", "x+=1;", "http://example.com/a?b=c&d=e",
    "\u0130", "\u0131", "\u0300", "a\u0308", "e\u0301\u0301", "\u3131", "\u1100", "\uac00",
    "\x01", "\x7f", "\x1b[0m", "\\n", "\\", "`", "~", "|",
]


def random_text(rnd):
    s = ""
    for _ in range(rnd.randint(1, 12)):
        r = rnd.random()
        if r < 0.7:
            s += rnd.choice(PIECES)
        elif r < 0.8:
            s += chr(rnd.randint(0x20, 0x7E))
        elif r < 0.9:
            s += chr(rnd.choice([rnd.randint(0xA0, 0x2FFF), rnd.randint(0x3000, 0x9FFF),
                                 rnd.randint(0xAC00, 0xD7A3), rnd.randint(0x1F300, 0x1FAFF)]))
        else:
            s += rnd.choice([" ", "\n", "\t", "  "])
    return s


def lamina_ids(lamina, model, text, tmp):
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    r = subprocess.run([lamina, "tokenize", "-m", model, "-f", tmp, "--ids"], capture_output=True)
    lines = r.stdout.decode().strip().splitlines()
    if r.returncode or not lines:
        return f"exit {r.returncode}: {r.stderr.decode().strip()[-200:]}"
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lamina", default="build/lamina")
    a = ap.parse_args()
    tk, pre = hf_tokenizer(read_kvs(a.model))
    if os.path.exists(a.model + ".inp") and os.path.exists(a.model + ".out"):
        with open(a.model + ".inp", encoding="utf-8") as f:
            inp = f.read().split("\n__ggml_vocab_test__\n")
        with open(a.model + ".out") as f:
            out = f.read().strip("\n").split("\n")
        same = sum(tk.encode(s, add_special_tokens=False).ids == [int(x) for x in o.split()]
                   for s, o in zip(inp, out))
        print(f"reference tokenizer ({pre}) on llama.cpp's vectors: {same} of {len(out)}")
        if same != len(out):
            sys.exit("the reference does not reproduce llama.cpp's vectors: not comparing")
    rnd = random.Random(a.seed)
    tested = diffs = 0
    with tempfile.TemporaryDirectory() as d:
        tmp = os.path.join(d, "text.txt")
        for _ in range(a.n):
            text = random_text(rnd)
            if "<|" in text:  # special tokens: parsed by lamina, not compared here
                continue
            got = lamina_ids(a.lamina, a.model, text, tmp)
            want = tk.encode(text, add_special_tokens=False).ids
            tested += 1
            if got != want:
                diffs += 1
                print(f"DIFF {text!r}\n  lamina {got}\n  hf     {want}")
    print(f"{tested} random strings ({pre} pre-tokenizer, seed {a.seed}): {diffs} differ")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
