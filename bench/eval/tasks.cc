#include "bench/eval/tasks.h"

#include <algorithm>
#include <array>
#include <limits>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "model/byte_tokenizer.h"

namespace fluxion::eval {
namespace {

constexpr absl::string_view kConsonants = "bdfgklmnprstvz";
constexpr absl::string_view kVowels = "aeiou";
constexpr std::array<absl::string_view, 8> kFixedSentences = {
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
    "The river flows to the sea.",
    "A small bird sings in the tree.",
    "The old road winds through the hills.",
};
constexpr absl::string_view kShortestFixedSentence = "Here we go.";
constexpr int64_t kPassageChars = 256;
// Filler draws that may be rejected (too long for the room left) before the haystack counts as
// full; see FillHaystack.
constexpr int kMaxRejectedFillers = 64;

// Portable uniform integers: the same samples from the same seed with any standard library.
class Rng {
 public:
  explicit Rng(std::seed_seq& seq) : engine_(seq) {}

  // Uniform over [lo, hi] by rejection (no modulo bias).
  int64_t Uniform(int64_t lo, int64_t hi) {
    const uint64_t range = static_cast<uint64_t>(hi - lo) + 1;
    const uint64_t limit = std::numeric_limits<uint64_t>::max() -
                           std::numeric_limits<uint64_t>::max() % range;
    uint64_t x;
    do {
      x = engine_();
    } while (x >= limit);
    return lo + static_cast<int64_t>(x % range);
  }
  bool Coin() { return Uniform(0, 1) == 1; }

 private:
  std::mt19937_64 engine_;
};

// --- Words (TASKS.md "Words") ---

std::string Word(Rng& rng, int syllables) {
  std::string w;
  for (int i = 0; i < syllables; ++i) {
    w.push_back(kConsonants[rng.Uniform(0, kConsonants.size() - 1)]);
    w.push_back(kVowels[rng.Uniform(0, kVowels.size() - 1)]);
  }
  return w;
}

std::string FillerWord(Rng& rng) { return Word(rng, static_cast<int>(rng.Uniform(1, 3))); }

// `n` distinct values from `draw`, which is retried on a repeat.
template <typename Draw>
std::vector<std::string> Distinct(int n, Draw draw) {
  std::vector<std::string> out;
  std::set<std::string> seen;
  while (static_cast<int>(out.size()) < n) {
    std::string v = draw();
    if (seen.insert(v).second) out.push_back(std::move(v));
  }
  return out;
}

std::vector<std::string> Keys(Rng& rng, int n) {
  return Distinct(n, [&] { return Word(rng, 4); });
}

std::vector<std::string> VariableNames(Rng& rng, int n) {
  return Distinct(n, [&] {
    std::string name;
    // Lowercase (TASKS.md v2): v1's capitals confounded vt with the model's capital-copy failure.
    for (int i = 0; i < 5; ++i) name.push_back(static_cast<char>('a' + rng.Uniform(0, 25)));
    return name;
  });
}

std::vector<std::string> Numbers(Rng& rng, int n) {
  return Distinct(n, [&] { return absl::StrCat(rng.Uniform(1000000, 9999999)); });
}

std::vector<std::string> Values(Rng& rng, int n) {
  return Distinct(n, [&] { return absl::StrCat(rng.Uniform(10000, 99999)); });
}

// 4-10 filler words, the first capitalised, ending with '.'.
std::string RandomSentence(Rng& rng) {
  const int64_t words = rng.Uniform(4, 10);
  std::string s;
  for (int64_t i = 0; i < words; ++i) {
    if (i > 0) s.push_back(' ');
    s += FillerWord(rng);
  }
  s[0] = absl::ascii_toupper(s[0]);
  s.push_back('.');
  return s;
}

std::string FillerSentence(Rng& rng) {
  if (rng.Coin()) return std::string(kFixedSentences[rng.Uniform(0, kFixedSentences.size() - 1)]);
  return RandomSentence(rng);
}

// Random sentences joined by spaces until at least 256 characters, cut to exactly 256 (the cut
// may fall inside a word or on a space: TASKS.md says "cut", and both sides cut the same way).
std::string PassageText(Rng& rng) {
  std::string text;
  while (static_cast<int64_t>(text.size()) < kPassageChars) {
    if (!text.empty()) text.push_back(' ');
    text += RandomSentence(rng);
  }
  text.resize(kPassageChars);
  // Lowercase (TASKS.md v2): the model cannot copy sentence-initial capitals (model card).
  absl::AsciiStrToLower(&text);
  return text;
}

// --- Tasks (TASKS.md "Tasks") ---

// What a task puts into the haystack and asks. Each group's sentences appear in the haystack in
// the order listed; groups are placed independently of each other.
struct TaskItems {
  std::vector<std::vector<std::string>> groups;
  std::string query;  // question + " " + answer prefix
  std::string answer;
};

std::string Needle(const std::string& key, const std::string& number) {
  return absl::StrCat("The special magic number for ", key, " is ", number, ".");
}

std::string SingleNeedleQuery(const std::string& key) {
  return absl::StrCat("What is the special magic number for ", key,
                      "? The special magic number for ", key, " is ");
}

// Four needles with distinct keys. Their keys and numbers are i.i.d., so listing them in one
// ordered group is the same distribution as placing them unordered, and it makes the listed order
// the haystack order (which multiquery's question needs).
std::vector<std::string> FourNeedles(Rng& rng, std::vector<std::string>* keys,
                                     std::vector<std::string>* numbers) {
  *keys = Keys(rng, 4);
  *numbers = Numbers(rng, 4);
  std::vector<std::string> needles;
  for (int i = 0; i < 4; ++i) needles.push_back(Needle((*keys)[i], (*numbers)[i]));
  return needles;
}

TaskItems NiahSingle(Rng& rng) {
  const std::string key = Keys(rng, 1)[0];
  const std::string number = Numbers(rng, 1)[0];
  return {{{Needle(key, number)}}, SingleNeedleQuery(key), number};
}

TaskItems NiahMultikey(Rng& rng) {
  std::vector<std::string> keys, numbers;
  std::vector<std::string> needles = FourNeedles(rng, &keys, &numbers);
  const int64_t asked = rng.Uniform(0, 3);
  return {{needles}, SingleNeedleQuery(keys[asked]), numbers[asked]};
}

TaskItems NiahMultivalue(Rng& rng) {
  const std::string key = Keys(rng, 1)[0];
  const std::vector<std::string> numbers = Numbers(rng, 4);
  std::vector<std::string> needles;
  for (const std::string& n : numbers) needles.push_back(Needle(key, n));
  return {{needles},
          absl::StrCat("What are all the special magic numbers for ", key,
                       "? The special magic numbers for ", key, " are "),
          absl::StrJoin(numbers, ", ")};
}

TaskItems NiahMultiquery(Rng& rng) {
  std::vector<std::string> keys, numbers;
  std::vector<std::string> needles = FourNeedles(rng, &keys, &numbers);
  // A uniform unordered pair, then named in haystack (= listed) order.
  int64_t a = rng.Uniform(0, 3), b = rng.Uniform(0, 2);
  if (b >= a) ++b;
  if (a > b) std::swap(a, b);
  return {{needles},
          absl::StrCat("What are the special magic numbers for ", keys[a], " and ", keys[b],
                       "? The special magic numbers for ", keys[a], " and ", keys[b], " are "),
          absl::StrCat(numbers[a], ", ", numbers[b])};
}

TaskItems VariableTracking(Rng& rng) {
  const std::vector<std::string> names = VariableNames(rng, 5);  // X1 X2 X3 Y1 Y2
  // Distinct values, so the distractor chain's value is never also the right answer.
  const std::vector<std::string> values = Values(rng, 2);
  auto assign = [](const std::string& to, const std::string& from) {
    return absl::StrCat("VAR ", to, " = ", from, ".");
  };
  std::vector<std::string> chain = {assign(names[0], values[0]),
                                    assign(names[1], "VAR " + names[0]),
                                    assign(names[2], "VAR " + names[1])};
  std::vector<std::string> distractor = {assign(names[3], values[1]),
                                         assign(names[4], "VAR " + names[3])};
  // RULER's form (TASKS.md v2): name every variable holding the value, in chain order, so each
  // generated name is one lookup and the attended positions move across decode steps.
  return {{chain, distractor},
          absl::StrCat("Which variables hold the value ", values[0],
                       "? The variables that hold ", values[0], " are "),
          absl::StrCat(names[0], ", ", names[1], ", ", names[2])};
}

TaskItems Aggregate(Rng& rng) {
  const std::vector<std::string> keys = Keys(rng, 2);  // asked, distractor
  const int64_t m = rng.Uniform(2, 6);
  // Distinct across both keys as well, so a distractor sentence never repeats a listed word.
  const std::vector<std::string> words = Distinct(
      static_cast<int>(m) + 3, [&] { return Word(rng, static_cast<int>(rng.Uniform(2, 3))); });
  std::vector<std::string> tagged, distractor;
  for (int64_t i = 0; i < m + 3; ++i) {
    auto& group = i < m ? tagged : distractor;
    group.push_back(absl::StrCat("The ", keys[i < m ? 0 : 1], " tag is ", words[i], "."));
  }
  return {{tagged, distractor},
          absl::StrCat("List every ", keys[0], " tag. The ", keys[0], " tags are "),
          absl::StrJoin(words.begin(), words.begin() + m, ", ")};
}

TaskItems Passage(Rng& rng) {
  const std::vector<std::string> keys = Keys(rng, 2);  // asked, distractor
  std::vector<std::vector<std::string>> groups;
  std::string answer;
  for (const std::string& key : keys) {
    std::string text = PassageText(rng);
    groups.push_back(
        {absl::StrCat("Passage ", key, " begins: ", text, " Passage ", key, " ends.")});
    if (answer.empty()) answer = std::move(text);
  }
  return {groups, absl::StrCat("Repeat passage ", keys[0], ". Passage ", keys[0], " begins: "),
          answer};
}

using TaskFn = TaskItems (*)(Rng&);

const std::vector<std::pair<std::string, TaskFn>>& Tasks() {
  static const auto* tasks = new std::vector<std::pair<std::string, TaskFn>>{
      {"niah_single", NiahSingle},         {"niah_multikey", NiahMultikey},
      {"niah_multivalue", NiahMultivalue}, {"niah_multiquery", NiahMultiquery},
      {"vt", VariableTracking},            {"aggregate", Aggregate},
      {"passage", Passage},
  };
  return *tasks;
}

// --- The document (TASKS.md "The document", "Lengths") ---

// Prompt tokens: BOS + haystack (pieces joined by single spaces) + "\n\n" + query.
int64_t PromptLength(int64_t piece_chars, int64_t pieces, int64_t query_chars) {
  return 1 + piece_chars + std::max<int64_t>(pieces - 1, 0) + 2 + query_chars;
}

// Filler sentences drawn until the next one no longer fits in `context` tokens. Stopping at the
// first misfit can leave up to ~70 tokens unused, which for short contexts would fall below 0.9 L,
// so below that mark further draws are tried (a shorter one may fit) and, as a last resort, the
// shortest fixed sentence; the gap left is then under 12 tokens.
std::vector<std::string> FillHaystack(Rng& rng, int64_t context, int64_t item_chars,
                                      int64_t items, int64_t query_chars) {
  std::vector<std::string> filler;
  int64_t chars = item_chars;
  auto length = [&] { return PromptLength(chars, items + filler.size(), query_chars); };
  auto fits = [&](absl::string_view s) {
    return PromptLength(chars + s.size(), items + filler.size() + 1, query_chars) <= context;
  };
  auto reached_min = [&] { return 10 * length() >= 9 * context; };
  int rejected = 0;
  while (true) {
    std::string s = FillerSentence(rng);
    if (fits(s)) {
      chars += s.size();
      filler.push_back(std::move(s));
      continue;
    }
    if (reached_min() || ++rejected > kMaxRejectedFillers) break;
  }
  while (!reached_min() && fits(kShortestFixedSentence)) {
    chars += kShortestFixedSentence.size();
    filler.emplace_back(kShortestFixedSentence);
  }
  return filler;
}

// Inserts every item at a uniformly random boundary among the S + 1 around the S filler sentences
// (before the first, between two, after the last), independently per item; within a group the
// drawn boundaries are sorted so the group keeps its listed order. Items sharing a boundary follow
// group order, then listed order.
std::string AssembleHaystack(Rng& rng, const std::vector<std::string>& filler,
                             const std::vector<std::vector<std::string>>& groups) {
  const int64_t boundaries = filler.size() + 1;
  std::vector<std::vector<const std::string*>> at(boundaries);
  for (const auto& group : groups) {
    std::vector<int64_t> where;
    for (size_t i = 0; i < group.size(); ++i) where.push_back(rng.Uniform(0, boundaries - 1));
    std::sort(where.begin(), where.end());
    for (size_t i = 0; i < group.size(); ++i) at[where[i]].push_back(&group[i]);
  }
  std::string haystack;
  auto append = [&haystack](const std::string& s) {
    if (!haystack.empty()) haystack.push_back(' ');
    haystack += s;
  };
  for (int64_t b = 0; b < boundaries; ++b) {
    for (const std::string* item : at[b]) append(*item);
    if (b < static_cast<int64_t>(filler.size())) append(filler[b]);
  }
  return haystack;
}

uint32_t Fnv1a(absl::string_view s) {
  uint32_t h = 2166136261u;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 16777619u;
  return h;
}

}  // namespace

const std::vector<std::string>& TaskNames() {
  static const auto* names = [] {
    auto* n = new std::vector<std::string>;
    for (const auto& [name, fn] : Tasks()) n->push_back(name);
    return n;
  }();
  return *names;
}

absl::StatusOr<TaskSample> MakeTaskSample(const std::string& task, int64_t context_tokens,
                                          uint64_t seed) {
  auto it = std::find_if(Tasks().begin(), Tasks().end(),
                         [&](const auto& t) { return t.first == task; });
  if (it == Tasks().end()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown task '", task, "'; valid tasks: ",
                                                   absl::StrJoin(TaskNames(), ", ")));
  }
  if (seed < kFirstEvalSeed && !IsCalibrationSeed(seed)) {
    return absl::InvalidArgumentError(
        absl::StrCat("seed ", seed, " is a training seed; evaluation seeds start at ",
                     kFirstEvalSeed, ", calibration seeds are ", kFirstCalibrationSeed, "-",
                     kFirstCalibrationSeed + kCalibrationSeeds - 1, " (docs/TASKS.md)"));
  }
  if (context_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("context must be positive, got ", context_tokens));
  }
  // The stream depends on the task and context too, so that seed s gives unrelated prompts for
  // different (task, context) cells instead of the same haystack with different items.
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    Fnv1a(task), static_cast<uint32_t>(context_tokens),
                    static_cast<uint32_t>(static_cast<uint64_t>(context_tokens) >> 32)};
  Rng rng(seq);
  TaskItems items = it->second(rng);

  int64_t item_chars = 0, item_count = 0;
  for (const auto& group : items.groups) {
    for (const std::string& s : group) item_chars += s.size();
    item_count += group.size();
  }
  const int64_t query_chars = items.query.size();
  const int64_t minimum = PromptLength(item_chars, item_count, query_chars);
  if (minimum > context_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "context ", context_tokens, " is too short for task ", task, ": the items and question of ",
        "seed ", seed, " alone take ", minimum, " tokens"));
  }
  std::vector<std::string> filler =
      FillHaystack(rng, context_tokens, item_chars, item_count, query_chars);

  TaskSample sample;
  sample.task = task;
  sample.context = context_tokens;
  sample.seed = seed;
  sample.prompt_text =
      absl::StrCat(AssembleHaystack(rng, filler, items.groups), "\n\n", items.query);
  sample.query = std::move(items.query);
  sample.answer = std::move(items.answer);
  sample.prompt_ids = model::ByteTokenizer::Encode(sample.prompt_text, /*add_bos=*/true);
  const int64_t n = sample.prompt_ids.size();
  if (10 * n < 9 * context_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("context ", context_tokens, " is too short for task ", task, ": the prompt ",
                     "cannot be filled to within [0.9 L, L] (it has ", n, " tokens)"));
  }
  return sample;
}

}  // namespace fluxion::eval
