"""Long-context task generators (v1), following docs/TASKS.md exactly.

Pure Python (no numpy), deterministic given a seed. Two entry points:

* ``make_eval_sample(task, length, seed)`` -> dict(prompt=str, answer=str, ...): one task's items
  (and its distractors) and one question; ``prompt`` is the text after BOS (BOS itself is not a
  character: token id 256 precedes the prompt), ending right after the answer prefix.
  ``1 + len(prompt)`` (the context length in tokens, BOS included) lies in [0.9 L, L].
* ``make_train_sequence(rng, length)`` -> (text, spans): a training document (after BOS) that
  mixes the items of several tasks in one haystack and asks all of them afterwards; ``spans`` are
  (start, end) character ranges of the supervised answers, each including its terminating "\\n".
  ``1 + len(text) <= length``.

Text is ASCII: token id = byte value; BOS = 256, EOS = 257, PAD = 258 (vocab padded to 264).
Training uses seeds < 1,000,000, evaluation seeds >= 1,000,000 (see ``eval_rng``).
"""
import random

BOS, EOS, PAD = 256, 257, 258
VOCAB = 264

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
SYLLABLES = [c + v for c in CONSONANTS for v in VOWELS]  # 70
LOWER = "abcdefghijklmnopqrstuvwxyz"

FIXED_SENTENCES = [
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
    "The river flows to the sea.",
    "A small bird sings in the tree.",
    "The old road winds through the hills.",
]

TASKS = ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "aggregate",
         "passage"]


# ---------------------------------------------------------------------------------------------
# Words
# ---------------------------------------------------------------------------------------------
def filler_word(rng):
    """1-3 syllables (uniform)."""
    return "".join(rng.choices(SYLLABLES, k=rng.randint(1, 3)))


def tag_word(rng):
    """Aggregate tag value: a filler word of 2-3 syllables (uniform)."""
    return "".join(rng.choices(SYLLABLES, k=rng.randint(2, 3)))


def key_word(rng):
    """4 syllables, uniform per syllable."""
    return "".join(rng.choices(SYLLABLES, k=4))


def var_name(rng):
    """5 lowercase letters (TASKS.md v2: v1's capitals confounded vt with the capital-copy failure)."""
    return "".join(rng.choices(LOWER, k=5))


def number7(rng):
    return str(rng.randint(1000000, 9999999))


def value5(rng):
    return str(rng.randint(10000, 99999))


class Uniq:
    """Draws distinct values from a generator function within one sample."""

    def __init__(self, rng):
        self.rng = rng
        self.used = set()

    def __call__(self, fn):
        while True:
            w = fn(self.rng)
            if w not in self.used:
                self.used.add(w)
                return w


def random_sentence(rng):
    words = [filler_word(rng) for _ in range(rng.randint(4, 10))]
    words[0] = words[0][0].upper() + words[0][1:]
    return " ".join(words) + "."


def filler_sentence(rng):
    if rng.random() < 0.5:
        return rng.choice(FIXED_SENTENCES)
    return random_sentence(rng)


def passage_text(rng, n=256):
    """Random filler sentences (random kind only, lowercased: TASKS.md v2) joined by spaces until
    >= n chars, cut to n."""
    parts = []
    total = -1
    while total < n:
        s = random_sentence(rng).lower()
        parts.append(s)
        total += 1 + len(s)
    return " ".join(parts)[:n]


# ---------------------------------------------------------------------------------------------
# Haystack assembly
# ---------------------------------------------------------------------------------------------
def build_haystack(rng, groups, budget):
    """Filler sentences until adding the next one would make the haystack longer than ``budget``
    characters (the items counted in, each with its joining space), then the items inserted at
    uniformly random sentence boundaries.

    ``groups``: list of lists of item sentences; each group keeps its internal order (positions are
    drawn independently per item, then sorted within the group); distinct groups are independent.
    Returns (haystack, order) where order[i][j] is the rank of group i item j in the haystack
    (a global index over all items, in haystack order).
    """
    items_len = sum(len(s) + 1 for g in groups for s in g)
    sentences = []
    cur = items_len - 1  # length of " ".join(all items)
    while True:
        s = filler_sentence(rng)
        add = len(s) + (1 if cur > 0 else 0)
        if cur + add > budget:
            break
        sentences.append(s)
        cur += add
    nb = len(sentences) + 1  # boundaries 0..len(sentences)
    placed = []  # (boundary, tiebreak, group, idx)
    for gi, g in enumerate(groups):
        pos = sorted(rng.randrange(nb) for _ in g)
        for j, p in enumerate(pos):
            placed.append((p, rng.random(), gi, j))
    # Items at the same boundary: a group's items keep their order (the tiebreak is re-sorted so
    # that within one group at one boundary the earlier index comes first).
    placed.sort(key=lambda t: (t[0], t[1]))
    # enforce in-group order among ties
    by_group = {}
    for k, t in enumerate(placed):
        by_group.setdefault(t[2], []).append(k)
    fixed = list(placed)
    for gi, slots in by_group.items():
        members = sorted((placed[k] for k in slots), key=lambda t: t[3])
        for k, m in zip(slots, members):
            fixed[k] = m
    placed = fixed
    out = []
    order = [[None] * len(g) for g in groups]
    pi = 0
    rank = 0
    for b in range(nb):
        while pi < len(placed) and placed[pi][0] == b:
            _, _, gi, j = placed[pi]
            out.append(groups[gi][j])
            order[gi][j] = rank
            rank += 1
            pi += 1
        if b < len(sentences):
            out.append(sentences[b])
    return " ".join(out), order


def needle(k, n):
    return "The special magic number for %s is %s." % (k, n)


def q_single(k):
    return ("What is the special magic number for %s? The special magic number for %s is " % (k, k))


def q_multivalue(k):
    return ("What are all the special magic numbers for %s? The special magic numbers for %s are "
            % (k, k))


def q_multiquery(ka, kb):
    return ("What are the special magic numbers for %s and %s? The special magic numbers for %s and"
            " %s are " % (ka, kb, ka, kb))


def q_vt(v):
    """RULER's form (TASKS.md v2): name every variable that holds v, in chain order."""
    return "Which variables hold the value %s? The variables that hold %s are " % (v, v)


def q_aggregate(k):
    return "List every %s tag. The %s tags are " % (k, k)


def q_passage(k):
    return "Repeat passage %s. Passage %s begins: " % (k, k)


def passage_item(k, text):
    return "Passage %s begins: %s Passage %s ends." % (k, text, k)


# ---------------------------------------------------------------------------------------------
# Units: one task's items + its questions. Each returns (groups, queries) where queries is a list
# of callables order -> (question_with_prefix, answer) (the answer may depend on haystack order).
# ---------------------------------------------------------------------------------------------
def unit_needles(rng, u, count, ask="all"):
    keys = [u(key_word) for _ in range(count)]
    nums = [u(number7) for _ in range(count)]
    groups = [[needle(k, n)] for k, n in zip(keys, nums)]
    base = len(groups)

    def single(i):
        return lambda order: (q_single(keys[i]), nums[i])

    def multi(i, j):
        def f(order):
            a, b = (i, j) if order[i][0] < order[j][0] else (j, i)
            return (q_multiquery(keys[a], keys[b]), nums[a] + ", " + nums[b])
        return f

    queries = []
    if ask == "all":
        queries = [single(i) for i in range(count)]
        if count >= 2 and rng.random() < 0.75:
            i, j = rng.sample(range(count), 2)
            queries.append(multi(i, j))
    elif ask == "one":
        queries = [single(rng.randrange(count))]
    elif ask == "two":
        i, j = rng.sample(range(count), 2)
        queries = [multi(i, j)]
    return groups, queries, base


def unit_multivalue(rng, u, count=4):
    k = u(key_word)
    nums = [u(number7) for _ in range(count)]
    groups = [[needle(k, n) for n in nums]]  # one ordered group: haystack order n1..n4
    return groups, [lambda order: (q_multivalue(k), ", ".join(nums))]


def unit_vt(rng, u, ask_distractor=False):
    xs = [u(var_name) for _ in range(3)]
    ys = [u(var_name) for _ in range(2)]
    v = u(value5)
    w = u(value5)
    chain = ["VAR %s = %s." % (xs[0], v), "VAR %s = VAR %s." % (xs[1], xs[0]),
             "VAR %s = VAR %s." % (xs[2], xs[1])]
    dist = ["VAR %s = %s." % (ys[0], w), "VAR %s = VAR %s." % (ys[1], ys[0])]
    queries = [lambda order: (q_vt(v), ", ".join(xs))]
    if ask_distractor:
        queries.append(lambda order: (q_vt(w), ", ".join(ys)))
    return [chain, dist], queries


def unit_aggregate(rng, u, m=None, ask_distractor=False):
    if m is None:
        m = rng.randint(2, 6)
    k = u(key_word)
    k2 = u(key_word)
    ws = [u(tag_word) for _ in range(m)]
    ds = [u(tag_word) for _ in range(3)]
    groups = [["The %s tag is %s." % (k, w) for w in ws], ["The %s tag is %s." % (k2, w) for w in ds]]
    queries = [lambda order: (q_aggregate(k), ", ".join(ws))]
    if ask_distractor:
        queries.append(lambda order: (q_aggregate(k2), ", ".join(ds)))
    return groups, queries


def unit_passage(rng, u, n=256, distractor=True, n_dist=256, ask_distractor=False):
    k = u(key_word)
    text = passage_text(rng, n)
    groups = [[passage_item(k, text)]]
    queries = [lambda order: (q_passage(k), text)]
    if distractor:
        k2 = u(key_word)
        t2 = passage_text(rng, n_dist)
        groups.append([passage_item(k2, t2)])
        if ask_distractor:
            queries.append(lambda order: (q_passage(k2), t2))
    return groups, queries


# ---------------------------------------------------------------------------------------------
# Evaluation samples (one task, one question)
# ---------------------------------------------------------------------------------------------
def eval_rng(task, length, seed):
    assert seed >= 1000000, "evaluation seeds are >= 1,000,000"
    return random.Random("%s:%d:%d" % (task, length, seed))


def make_eval_sample(task, length, seed):
    rng = eval_rng(task, length, seed)
    u = Uniq(rng)
    if task == "niah_single":
        groups, queries, _ = unit_needles(rng, u, 1, ask="one")
    elif task == "niah_multikey":
        groups, queries, _ = unit_needles(rng, u, 4, ask="one")
    elif task == "niah_multiquery":
        groups, queries, _ = unit_needles(rng, u, 4, ask="two")
    elif task == "niah_multivalue":
        groups, queries = unit_multivalue(rng, u, 4)
    elif task == "vt":
        groups, queries = unit_vt(rng, u)
    elif task == "aggregate":
        groups, queries = unit_aggregate(rng, u)
    elif task == "passage":
        groups, queries = unit_passage(rng, u)
    else:
        raise ValueError(task)
    # The question cannot depend on order before the haystack exists, but its length does not:
    # build with a placeholder order to measure, then rebuild. (Question length is independent of
    # haystack order for every task: keys of a pair swap places, lengths stay.)
    dummy = [[i * 100 + j for j in range(len(g))] for i, g in enumerate(groups)]
    q0, _ = queries[0](dummy)
    # prompt tokens = 1 (BOS) + haystack + 2 ("\n\n") + len(question+prefix) <= length
    budget = length - 1 - 2 - len(q0)
    hay, order = build_haystack(rng, groups, budget)
    q, a = queries[0](order)
    assert len(q) == len(q0)
    prompt = hay + "\n\n" + q
    n_tok = 1 + len(prompt)
    assert 0.9 * length <= n_tok <= length, (task, n_tok, length)
    return {"task": task, "length": length, "seed": seed, "prompt": prompt, "answer": a,
            "n_tokens": n_tok}


# ---------------------------------------------------------------------------------------------
# Training sequences (several tasks mixed, all asked, dense supervision)
# ---------------------------------------------------------------------------------------------
def make_train_sequence(rng, length, focus=False):
    """Returns (text, spans); BOS precedes text; 1 + len(text) <= length.

    Units are drawn in random order and kept while the items plus all query lines fit in
    ``length - 1 - 2 - slack`` characters; the rest of the budget is filler.

    ``focus`` (phase F, run 3 on): a second vt chain, aggregate key and passage join the draw,
    so that the tasks that still failed after run 2 (vt, aggregate, passage capitals) get
    about twice the supervision per token.
    """
    u = Uniq(rng)
    short = length < 1024
    cands = []
    # single needles (1-4, each asked; plus a two-key question when >= 2)
    cands.append(lambda: unit_needles(rng, u, rng.randint(1, 4), ask="all")[:2])
    cands.append(lambda: unit_multivalue(rng, u, 4 if not short else rng.randint(2, 4)))
    cands.append(lambda: unit_vt(rng, u, ask_distractor=rng.random() < 0.5))
    cands.append(lambda: unit_aggregate(rng, u, ask_distractor=rng.random() < 0.5))
    if short:
        cands.append(lambda: unit_passage(rng, u, n=rng.randint(16, 64), distractor=rng.random() < 0.5,
                                          n_dist=rng.randint(16, 64)))
    elif length <= 1100:
        n = rng.choice([rng.randint(32, 256), 256])
        cands.append(lambda: unit_passage(rng, u, n=n, distractor=True, n_dist=rng.randint(32, 256)))
    else:
        cands.append(lambda: unit_passage(rng, u, n=256, distractor=True,
                                          ask_distractor=rng.random() < 0.25))
    if focus:
        cands.append(lambda: unit_vt(rng, u, ask_distractor=rng.random() < 0.5))
        cands.append(lambda: unit_aggregate(rng, u, ask_distractor=rng.random() < 0.5))
        if length > 1100:
            cands.append(lambda: unit_passage(rng, u, n=256, distractor=False))
        elif not short:
            cands.append(lambda: unit_passage(rng, u, n=rng.randint(64, 256), distractor=False))
    rng.shuffle(cands)
    slack = max(16, length // 16)  # keep at least this much filler
    limit = length - 1 - 2 - slack
    groups, queries = [], []
    used = 0
    dummy_len = None
    for c in cands:
        g, q = c()
        dummy = [[i * 100 + j for j in range(len(x))] for i, x in enumerate(g)]
        size = sum(len(s) + 1 for x in g for s in x)
        size += sum(len(qq) + len(aa) + 1 for qq, aa in (f(dummy) for f in q))
        if used + size <= limit:
            base = len(groups)
            groups.extend(g)
            # rebind the query to this unit's slice of the global order
            for f in q:
                queries.append((f, base, len(g)))
            used += size
    if not queries:  # always ask something: a single needle
        g, q, _ = unit_needles(rng, u, 1, ask="all")
        groups.extend(g)
        queries.append((q[0], 0, 1))
        used += sum(len(s) + 1 for x in g for s in x) + 120
    qa_len = used - sum(len(s) + 1 for x in groups for s in x)
    budget = length - 1 - 2 - qa_len
    hay, order = build_haystack(rng, groups, budget)
    rng.shuffle(queries)
    parts = [hay, "\n\n"]
    pos = len(hay) + 2
    spans = []
    for f, base, n in queries:
        q, a = f(order[base:base + n])
        parts.append(q)
        pos += len(q)
        parts.append(a + "\n")
        spans.append((pos, pos + len(a) + 1, query_label(q)))
        pos += len(a) + 1
    text = "".join(parts)
    assert 1 + len(text) <= length, (len(text), length)
    return text, spans


TRAIN_LABELS = ["needle", "multiquery", "multivalue", "vt", "aggregate", "passage"]


def query_label(q):
    for prefix, lab in (("What is the special", 0), ("What are the special", 1),
                        ("What are all the special", 2), ("Which variables hold", 3),
                        ("List every", 4), ("Repeat passage", 5)):
        if q.startswith(prefix):
            return lab
    raise ValueError(q)


def encode_train(text, spans, length):
    """Tokens (BOS + bytes, PAD to ``length``) and per-token class: 0 = not a target (BOS, PAD),
    1 = LM token, 2 + label = answer token of a query of that label (TRAIN_LABELS). The class of
    position t is the class of token t as a prediction target."""
    b = text.encode("ascii")
    toks = bytes([0]) + b + bytes(length - 1 - len(b))
    cls = bytearray([0]) + bytearray([1]) * len(b) + bytearray(length - 1 - len(b))
    for s, e, lab in spans:
        cls[1 + s:1 + e] = bytes([2 + lab]) * (e - s)
    return toks, bytes(cls)


# ---------------------------------------------------------------------------------------------
# Scoring (docs/TASKS.md "Scoring")
# ---------------------------------------------------------------------------------------------
def continuation_text(token_ids):
    """Decode generated ids up to the first "\\n" (10) or EOS; other non-byte ids are dropped
    from the text (they never match an ASCII answer)."""
    out = []
    for t in token_ids:
        if t == 10 or t == EOS:
            break
        if t < 256:
            out.append(chr(t))
        else:
            out.append("\x00")  # a special inside the answer: cannot match
    return "".join(out)


def score(answer, token_ids):
    """Exact match of the continuation (up to the first newline or EOS, at most len(answer)+16
    generated tokens) with the answer."""
    return continuation_text(token_ids[:len(answer) + 16]) == answer


def wilson(k, n, z=1.96):
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / d
    return (max(0.0, c - h), min(1.0, c + h))


if __name__ == "__main__":
    import sys
    L = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    for t in TASKS:
        s = make_eval_sample(t, L, 1000000)
        print("=== %s L=%d tokens=%d" % (t, L, s["n_tokens"]))
        print(s["prompt"][-400:] + "|" + s["answer"])
    text, spans = make_train_sequence(random.Random(0), L)
    print("=== train", len(text))
    print(text[-1500:])
    print(spans)
