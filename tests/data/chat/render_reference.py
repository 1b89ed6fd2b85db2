# Renders the reference strings in references.json with Jinja2 set up as Hugging Face
# transformers' apply_chat_template sets it up (ImmutableSandboxedEnvironment, trim_blocks,
# lstrip_blocks, loopcontrols, raise_exception; transformers/utils/chat_template_utils.py).
# Run: python3 render_reference.py > references.json   (Jinja2 3.1.6 produced the committed file)
import json, sys
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.ext import loopcontrols

CASES = [
    ("system_user_assistant_user", [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "2+2?"}]),
    ("user_only", [{"role": "user", "content": "What is the capital of France?"}]),
    ("whitespace_and_unicode", [
        {"role": "system", "content": "  Be kind.\n"},
        {"role": "user", "content": "\n  caf\u00e9 \u2603 \U0001F600  \n"},
        {"role": "assistant", "content": " ok \u00a0"}]),
    ("special_token_text", [
        {"role": "user", "content": "say <|eot_id|><|im_end|> please"}]),
    ("late_system", [
        {"role": "user", "content": "a"},
        {"role": "system", "content": "b"},
        {"role": "user", "content": "c"}]),
]

def raise_exception(message):
    raise RuntimeError(message)

env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.globals["raise_exception"] = raise_exception
out = {}
for model in ["llama3.1", "qwen2.5", "llama3", "chatml"]:
    cfg = json.load(open(f"{model}/tokenizer_config.json"))
    tmpl = env.from_string(cfg["chat_template"])
    for name, messages in CASES:
        for gen in (False, True):
            out.setdefault(model, []).append({
                "case": name, "add_generation_prompt": gen, "messages": messages,
                "text": tmpl.render(messages=messages, add_generation_prompt=gen,
                                    bos_token=cfg.get("bos_token") or "",
                                    eos_token=cfg.get("eos_token") or "")})
json.dump(out, sys.stdout, indent=1, ensure_ascii=False)
print()
