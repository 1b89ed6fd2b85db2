"""Reference tokenizers for the C++ tokenizer.json loader (issue 16), made with HF `tokenizers`.

Trains two small byte-level BPE tokenizers with the pre-tokenizers and special tokens that
Llama-3 and Qwen2.5 ship, and one SentencePiece-style BPE with byte fallback saved in the two
layouts such checkpoints ship (Mistral v0.3's Metaspace pre-tokenizer; Llama-2 / Mistral v0.1's
Prepend + Replace normalizer), saves their tokenizer.json, and records how HF encodes and decodes
a set of varied texts (Unicode, emoji, numbers, whitespace runs, code, special tokens inside
text). The C++ tokenizer must reproduce every id sequence and every decoded string exactly.
Runs wherever `tokenizers` is installed (the lent GPU machine's python3); no GPU needed.

  python3 tools/hf_reference/make_tokenizer_refs.py OUT_DIR
writes OUT_DIR/{llama3,qwen2,mistral3,llama2}/tokenizer.json and .../references.json.
"""
import json
import os
import random
import sys

import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus(seed):
    rng = random.Random(seed)
    words = ("the quick brown fox jumps over lazy dog attention cache decode prefill token "
             "serving latency budget sparse dense host memory page layer head query key value "
             "naïve café résumé Zürich São Paulo Kraków Ελληνικά русский текст 日本語 中文 한국어 "
             "emoji 🙂 🚀 👩‍💻 🇩🇪 don't it's we're they've I'm you'll he'd").split()
    lines = []
    for _ in range(4000):
        n = rng.randint(3, 14)
        line = " ".join(rng.choice(words) for _ in range(n))
        if rng.random() < 0.3:
            line += " " + str(rng.randint(0, 10 ** rng.randint(1, 9)))
        if rng.random() < 0.2:
            line = "    " + line + "\n\tdef f(x):\n        return x * 2  # comment"
        lines.append(line)
    return lines


def build(pattern, specials, nfc):
    tok = Tokenizer(models.BPE(byte_fallback=False, ignore_merges=False))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(1), trainer=trainer)
    return tok


SP_SPECIALS = ["<unk>", "<s>", "</s>"]
MARK = "\u2581"


def build_sentencepiece():
    """One SentencePiece-style vocabulary in its two tokenizer.json layouts."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=MARK, prepend_scheme="always",
                                                 split=True)
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=SP_SPECIALS, show_progress=False)
    tok.train_from_iterator(corpus(2), trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    next_id = max(vocab.values()) + 1
    for b in range(256):  # SentencePiece's byte pieces, which byte fallback falls back to
        name = "<0x%02X>" % b
        if name not in vocab:
            vocab[name] = next_id
            next_id += 1
    decoder = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": MARK}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    metaspace = dict(spec["pre_tokenizer"], prepend_scheme="first", split=False)
    legacy = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": MARK},
        {"type": "Replace", "pattern": {"String": " "}, "content": MARK}]}
    layouts = {"mistral3": dict(spec, normalizer=None, pre_tokenizer=metaspace, decoder=decoder),
               "llama2": dict(spec, normalizer=legacy, pre_tokenizer=None, decoder=decoder)}
    return {name: Tokenizer.from_str(json.dumps(s)) for name, s in layouts.items()}


TEXTS = [
    "Hello, world!",
    "the quick brown fox jumps over the lazy dog",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\r\nand\n\n\nruns",
    "numbers 1234567890 3.14159 -42 1e10 007",
    "naïve café résumé — Zürich «quoted» “curly”",
    "Ελληνικά русский текст 日本語の文章 中文句子 한국어 문장",
    "emoji 🙂🚀 👩‍💻 family 👨‍👩‍👧‍👦 flag 🇩🇪 skin 👍🏽",
    "don't it's we're they've I'm you'll he'd DON'T IT'S",
    "def f(x):\n    return x * 2  # comment\n",
    "<|begin_of_text|>system prompt<|eot_id|>",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|end_of_text|>",
    "unknown words zyxwvut qqqq ẞ ǅ ﬁ",
    "decomposed e\u0301 vs composed é",
    "",
    " ",
    "\n",
    "a" * 300,
    "!!!???...,,,;;;:::",
]


# What SentencePiece-style layouts do differently: the prepended mark, text holding the mark,
# added tokens inside text (each piece is normalized on its own), characters only byte fallback
# can spell.
SP_TEXTS = TEXTS + [
    " space first", MARK + "already marked", "<s>hello</s> world <unk>", "hello<s>world",
    "\u0000 nul and \u007f del", "\U0001F916 robot \U00010348", "\ufb01 ligature \u00bd",
]


def references(tok, texts=TEXTS):
    out = []
    for text in texts:
        enc = tok.encode(text, add_special_tokens=False)
        ids = enc.ids
        out.append({
            "text": text,
            "ids": ids,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
        })
    return out


def main():
    out = sys.argv[1]
    for name, pattern, specials, nfc in (("llama3", LLAMA3_PATTERN, LLAMA3_SPECIALS, False),
                                         ("qwen2", QWEN2_PATTERN, QWEN2_SPECIALS, True)):
        tok = build(pattern, specials, nfc)
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        tok.save(os.path.join(d, "tokenizer.json"))
        with open(os.path.join(d, "references.json"), "w", encoding="utf-8") as f:
            json.dump({"tokenizers_version": tokenizers.__version__, "cases": references(tok)}, f,
                      ensure_ascii=False, indent=1)
        print(name, "vocab", tok.get_vocab_size(), "cases", len(TEXTS))
    for name, tok in build_sentencepiece().items():
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        tok.save(os.path.join(d, "tokenizer.json"))
        with open(os.path.join(d, "references.json"), "w", encoding="utf-8") as f:
            json.dump({"tokenizers_version": tokenizers.__version__,
                       "cases": references(tok, SP_TEXTS)}, f, ensure_ascii=False, indent=1)
        print(name, "vocab", tok.get_vocab_size(), "cases", len(SP_TEXTS))


if __name__ == "__main__":
    main()
