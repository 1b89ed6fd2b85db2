"""Format checks of tasks.py against docs/TASKS.md (plain python3, no torch): python3 test_tasks.py"""
import random
import re
import sys
import os

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tasks  # noqa: E402

SYL = "[bdfgklmnprstvz][aeiou]"
KEY = "(?:%s){4}" % SYL
NUM = "[1-9][0-9]{6}"
VAL = "[1-9][0-9]{4}"
VAR = "[a-z]{5}"
TAGW = "(?:%s){2,3}" % SYL
WORD = "(?:%s){1,3}" % SYL
RAND_SENT = r"[BDFGKLMNPRSTVZ][aeiou](?:%s){0,2}(?: %s){3,9}\." % (SYL, WORD)

QUESTION = {
    "niah_single": r"What is the special magic number for (%s)\? The special magic number for \1 is " % KEY,
    "niah_multikey": r"What is the special magic number for (%s)\? The special magic number for \1 is " % KEY,
    "niah_multivalue": r"What are all the special magic numbers for (%s)\? The special magic numbers for \1 are " % KEY,
    "niah_multiquery": r"What are the special magic numbers for (%s) and (%s)\? The special magic numbers for \1 and \2 are " % (KEY, KEY),
    "vt": r"Which variables hold the value (%s)\? The variables that hold \1 are " % VAL,
    "aggregate": r"List every (%s) tag\. The \1 tags are " % KEY,
    "passage": r"Repeat passage (%s)\. Passage \1 begins: " % KEY,
}
ANSWER = {
    "niah_single": NUM, "niah_multikey": NUM, "niah_multivalue": "%s(?:, %s){3}" % (NUM, NUM),
    "niah_multiquery": "%s, %s" % (NUM, NUM), "vt": "%s, %s, %s" % (VAR, VAR, VAR), "aggregate": "%s(?:, %s){1,5}" % (TAGW, TAGW),
    "passage": "[a-z .]{256}",  # v2: lowercase
}
ITEM = [r"The special magic number for %s is %s\." % (KEY, NUM),
        r"VAR %s = (?:%s|VAR %s)\." % (VAR, VAL, VAR),
        r"The %s tag is %s\." % (KEY, TAGW),
        r"Passage %s begins: .{256} Passage %s ends\." % (KEY, KEY)]
FIXED = set(tasks.FIXED_SENTENCES)


def split_haystack(hay):
    """Tokenise the haystack into sentences/items (passages first, they contain '.')."""
    out = []
    i = 0
    while i < len(hay):
        m = re.compile(r"Passage (%s) begins: " % KEY).match(hay, i)
        if m:
            end = hay.index(" Passage %s ends." % m.group(1), i)
            j = end + len(" Passage %s ends." % m.group(1))
            out.append(hay[i:j])
        else:
            j = hay.index(".", i) + 1
            out.append(hay[i:j])
        i = j
        if i < len(hay):
            assert hay[i] == " ", repr(hay[i - 20:i + 20])
            i += 1
    return out


def check_sample(s):
    t, L = s["task"], s["length"]
    hay, q = s["prompt"].split("\n\n")
    assert 0.9 * L <= 1 + len(s["prompt"]) <= L
    assert re.fullmatch(QUESTION[t], q), (t, q)
    assert re.fullmatch(ANSWER[t], s["answer"]), (t, s["answer"])
    sents = split_haystack(hay)
    items = [x for x in sents if x not in FIXED and not re.fullmatch(RAND_SENT, x)]
    for x in items:
        assert any(re.fullmatch(p, x) for p in ITEM), (t, x)
    keys = re.findall(r"(?:for|The|Passage) (%s)" % KEY, " ".join(items))
    if t in ("niah_single", "niah_multikey", "niah_multiquery"):
        assert len(items) == (1 if t == "niah_single" else 4) and len(set(keys)) == len(items)
        nums = dict(re.match(r"The special magic number for (\S+) is (\d+)\.", x).groups() for x in items)
        asked = re.findall(KEY, q)
        if t == "niah_multiquery":
            ka, kb = asked[0], asked[1]
            order = [re.search(KEY, x).group(0) for x in items]
            assert order.index(ka) < order.index(kb)
            assert s["answer"] == nums[ka] + ", " + nums[kb]
        else:
            assert s["answer"] == nums[asked[0]]
    elif t == "niah_multivalue":
        assert len(items) == 4 and len(set(keys)) == 1
        assert s["answer"] == ", ".join(re.findall(NUM, " ".join(items)))
        assert len(set(s["answer"].split(", "))) == 4
    elif t == "vt":
        assert len(items) == 5
        env = {}
        for x in items:
            a, b = re.match(r"VAR (\S+) = (.+)\.", x).groups()
            env[a] = env[b[4:]] if b.startswith("VAR ") else b
        v = re.search(VAL, q).group(0)
        # every variable holding v, in haystack order (= chain order): 3 of the 5
        holders = [re.match(r"VAR (\S+)", x).group(1) for x in items]
        holders = [a for a in holders if env[a] == v]
        assert s["answer"] == ", ".join(holders) and len(holders) == 3
    elif t == "aggregate":
        k = re.search(KEY, q).group(0)
        mine = [re.search("is (%s)" % TAGW, x).group(1) for x in items if " %s " % k in x]
        other = [x for x in items if " %s " % k not in x]
        assert 2 <= len(mine) <= 6 and len(other) == 3
        assert len(set(re.findall(r"is (\w+)\.", " ".join(items)))) == len(items)
        assert s["answer"] == ", ".join(mine)
    elif t == "passage":
        k = re.search(KEY, q).group(0)
        assert len(items) == 2
        mine = [x for x in items if x.startswith("Passage %s " % k)][0]
        assert mine == "Passage %s begins: %s Passage %s ends." % (k, s["answer"], k)
        assert len(s["answer"]) == 256
    return len(items)


def main():
    n = 0
    for L in (1024, 4096, 16384):
        for t in tasks.TASKS:
            for seed in range(1000000, 1000000 + (30 if L < 16384 else 5)):
                s = tasks.make_eval_sample(t, L, seed)
                check_sample(s)
                assert s == tasks.make_eval_sample(t, L, seed)  # deterministic
                n += 1
    # training sequences: within length, answers at spans, every query answered
    for L in (257, 1025, 4097, 17409):
        for seed in range(20):
            text, spans = tasks.make_train_sequence(random.Random(seed), L)
            assert 1 + len(text) <= L
            hay, qs = text.split("\n\n")
            lines = qs.split("\n")[:-1]
            assert len(lines) == len(spans) >= 1
            for (a, b, lab), line in zip(spans, lines):
                assert text[b - 1] == "\n"
                assert line.endswith(text[a:b - 1])
            assert (text, spans) == tasks.make_train_sequence(random.Random(seed), L)
    assert tasks.score("1234567", [ord(c) for c in "1234567\n"])
    assert tasks.score("1234567", [ord(c) for c in "1234567"] + [tasks.EOS])
    assert not tasks.score("1234567", [ord(c) for c in "12345678\n"])
    lo, hi = tasks.wilson(40, 50)
    assert abs(lo - 0.6696) < 1e-3 and abs(hi - 0.8875) < 1e-3, (lo, hi)
    print("%d eval samples and 80 training sequences checked" % n)
    print("1 passed, 0 failed")


if __name__ == "__main__":
    main()
