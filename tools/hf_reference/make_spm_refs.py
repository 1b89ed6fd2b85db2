#!/usr/bin/python3
"""Reference SentencePiece tokenizer.model for the C++ reader (model/sentencepiece_model.h).

Trains a small BPE SentencePiece model with the options Llama-2 and Mistral ship (byte fallback,
identity normalization, add_dummy_prefix, whitespace runs kept) and one user-defined symbol, and
records how SentencePiece itself encodes and decodes a set of varied texts. Texts spelling a
control or user-defined piece ("<s>", "<|tool|>") are left out: Hugging Face's converted
tokenizers (what vLLM serves such a checkpoint with, and we follow) cut those out of the text as
added tokens and prepend the dummy "▁" to each piece around them, where SentencePiece reads a
control piece as plain text and prepends once. Needs Debian's python3-sentencepiece.

  /usr/bin/python3 tools/hf_reference/make_spm_refs.py OUT_DIR
writes OUT_DIR/tokenizer.model and OUT_DIR/references.json.
"""
import io
import json
import os
import random
import sys

import sentencepiece as spm


def corpus(seed):
    rng = random.Random(seed)
    words = ("the quick brown fox jumps over lazy dog attention cache decode prefill token "
             "serving latency budget sparse dense host memory page layer head query key value "
             "naïve café résumé Zürich São Paulo Kraków Ελληνικά русский текст 日本語 中文 한국어 "
             "don't it's we're they've I'm you'll he'd <|tool|>").split()
    for _ in range(6000):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(3, 14)))
        if rng.random() < 0.3:
            line += " " + str(rng.randint(0, 10 ** rng.randint(1, 9)))
        yield line


TEXTS = [
    "Hello, world!", "the quick brown fox jumps over the lazy dog",
    "  leading spaces and trailing   ", "tabs\tand\nnewlines\r\nand\n\n\nruns",
    "numbers 1234567890 3.14159 -42 1e10 007", "naïve café résumé — Zürich «quoted» “curly”",
    "Ελληνικά русский текст 日本語の文章 中文句子 한국어 문장",
    "emoji 🙂🚀 👩‍💻 family 👨‍👩‍👧‍👦 flag 🇩🇪 skin 👍🏽", "don't it's we're they've I'm you'll he'd",
    "def f(x):\n    return x * 2  # comment\n", "mixed CASE Words and MORE words",
    "unknown words zyxwvut qqqq ẞ ǅ ﬁ", "decomposed e\u0301 vs composed é", "", " ", "\n",
    "a" * 300, "!!!???...,,,;;;:::", "\u2581already marked", "\U0001F916 robot \U00010348",
]


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=corpus(1), model_writer=model, model_type="bpe", vocab_size=700,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, character_coverage=0.9995, user_defined_symbols=["<|tool|>"],
        minloglevel=2)
    with open(os.path.join(out, "tokenizer.model"), "wb") as f:
        f.write(model.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    cases = []
    for text in TEXTS:
        ids = sp.encode(text)
        cases.append({"text": text, "ids": ids, "decoded": sp.decode(ids)})
    with open(os.path.join(out, "references.json"), "w", encoding="utf-8") as f:
        json.dump({"sentencepiece_version": spm.__version__, "cases": cases}, f,
                  ensure_ascii=False, indent=1)
    print("pieces", sp.get_piece_size(), "cases", len(cases))


if __name__ == "__main__":
    main()
