// Format tests for the task generators against docs/TASKS.md: the model was trained on text made by
// an independent Python implementation, so every byte of the format matters.
#include "bench/eval/tasks.h"

#include <algorithm>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/byte_tokenizer.h"

namespace fluxion::eval {
namespace {

using ::testing::HasSubstr;

const std::string kKey = "(?:[bdfgklmnprstvz][aeiou]){4}";
const std::string kNumber = "[1-9][0-9]{6}";
const std::string kValue = "[1-9][0-9]{4}";
const std::string kVar = "[a-z]{5}";

const std::vector<std::string> kFixedSentences = {
    "The grass is green.",         "The sky is blue.",
    "The sun is yellow.",          "Here we go.",
    "There and back again.",       "The river flows to the sea.",
    "A small bird sings in the tree.", "The old road winds through the hills.",
};

TaskSample Make(const std::string& task, int64_t context, uint64_t seed) {
  absl::StatusOr<TaskSample> s = MakeTaskSample(task, context, seed);
  EXPECT_TRUE(s.ok()) << task << " " << context << " " << seed << ": " << s.status();
  return s.ok() ? *std::move(s) : TaskSample{};
}

int Count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t p = text.find(needle); p != std::string::npos; p = text.find(needle, p + 1)) ++n;
  return n;
}

// One regex match, owning its text (std::smatch would dangle once a temporary haystack dies).
struct Match {
  std::vector<std::string> groups;  // group 0 = the whole match
  size_t at = 0;                    // offset of the whole match
  const std::string& operator[](int i) const { return groups[i]; }
  const std::string& str(int i) const { return groups[i]; }
  size_t position(int) const { return at; }
  size_t length(int i) const { return groups[i].size(); }
};

// Every match of `pattern` in `text`.
std::vector<Match> Matches(const std::string& text, const std::string& pattern) {
  std::regex re(pattern);
  std::vector<Match> out;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator();
       ++it) {
    Match m;
    for (size_t i = 0; i < it->size(); ++i) m.groups.push_back((*it)[i].str());
    m.at = it->position(0);
    out.push_back(std::move(m));
  }
  return out;
}

std::string Haystack(const TaskSample& s) {
  return s.prompt_text.substr(0, s.prompt_text.size() - s.query.size() - 2);
}

// Seeds 1,000,000 .. 1,000,000 + n - 1: the evaluation range.
std::vector<uint64_t> Seeds(int n) {
  std::vector<uint64_t> seeds;
  for (int i = 0; i < n; ++i) seeds.push_back(kFirstEvalSeed + i);
  return seeds;
}

TEST(TasksTest, ListsTheSevenTasksOfTasksMd) {
  EXPECT_EQ(TaskNames(),
            (std::vector<std::string>{"niah_single", "niah_multikey", "niah_multivalue",
                                      "niah_multiquery", "vt", "aggregate", "passage"}));
}

TEST(TasksTest, EveryPromptIsBosHaystackBlankLineQueryAndEndsWithTheAnswerPrefixSpace) {
  for (const std::string& task : TaskNames()) {
    for (int64_t context : {1024, 4096}) {
      for (uint64_t seed : Seeds(5)) {
        TaskSample s = Make(task, context, seed);
        ASSERT_FALSE(s.prompt_ids.empty());
        EXPECT_EQ(s.prompt_ids[0], model::ByteTokenizer::kBos);
        EXPECT_EQ(s.prompt_ids, model::ByteTokenizer::Encode(s.prompt_text, true));
        ASSERT_GT(s.prompt_text.size(), s.query.size() + 2);
        EXPECT_EQ(s.prompt_text.substr(s.prompt_text.size() - s.query.size() - 2), "\n\n" + s.query)
            << task;
        EXPECT_EQ(s.query.back(), ' ');
        // One blank line only, and no newline inside the haystack, query or answer.
        EXPECT_EQ(Count(s.prompt_text, "\n"), 2) << task;
        EXPECT_EQ(s.answer.find('\n'), std::string::npos);
        EXPECT_FALSE(s.answer.empty());
        const std::string hay = Haystack(s);
        // Single spaces between sentences (a passage cut just after a '.' may end in a space).
        if (task != "passage") {
          EXPECT_EQ(hay.find("  "), std::string::npos) << task;
        }
        EXPECT_NE(hay.front(), ' ');
        EXPECT_NE(hay.back(), ' ');
        EXPECT_EQ(s.task, task);
        EXPECT_EQ(s.context, context);
        EXPECT_EQ(s.seed, seed);
      }
    }
  }
}

TEST(TasksTest, PromptLengthLiesWithinNinetyPercentOfTheContextAndTheContext) {
  for (const std::string& task : TaskNames()) {
    for (int64_t context : {1024, 1500, 4096, 16384}) {
      for (uint64_t seed : Seeds(4)) {
        TaskSample s = Make(task, context, seed);
        const int64_t n = s.prompt_ids.size();
        EXPECT_LE(n, context) << task;
        EXPECT_GE(10 * n, 9 * context) << task << " " << context << " got " << n;
      }
    }
  }
}

TEST(TasksTest, NiahSingleHasOneNeedleAndAsksForItsNumber) {
  for (uint64_t seed : Seeds(20)) {
    TaskSample s = Make("niah_single", 2048, seed);
    std::smatch m;
    ASSERT_TRUE(std::regex_match(
        s.query, m,
        std::regex("What is the special magic number for (" + kKey +
                   ")\\? The special magic number for \\1 is ")))
        << s.query;
    const std::string key = m[1];
    EXPECT_TRUE(std::regex_match(s.answer, std::regex(kNumber))) << s.answer;
    const std::string needle = absl::StrCat("The special magic number for ", key, " is ",
                                            s.answer, ".");
    EXPECT_EQ(Count(s.prompt_text, needle), 1);
    EXPECT_EQ(Matches(Haystack(s), "special magic").size(), 1u);
  }
}

TEST(TasksTest, NiahMultikeyHasFourDistinctKeysAndAsksOne) {
  for (uint64_t seed : Seeds(20)) {
    TaskSample s = Make("niah_multikey", 2048, seed);
    auto needles = Matches(Haystack(s), "The special magic number for (" + kKey + ") is (" +
                                            kNumber + ")\\.");
    ASSERT_EQ(needles.size(), 4u);
    EXPECT_EQ(Matches(Haystack(s), "special magic").size(), 4u);
    std::set<std::string> keys;
    for (const auto& m : needles) keys.insert(m[1]);
    EXPECT_EQ(keys.size(), 4u);
    std::smatch q;
    ASSERT_TRUE(std::regex_match(s.query, q,
                                 std::regex("What is the special magic number for (" + kKey +
                                            ")\\? The special magic number for \\1 is ")));
    int asked = 0;
    for (const auto& m : needles) {
      if (m[1] == q[1]) {
        ++asked;
        EXPECT_EQ(s.answer, m[2]);
        EXPECT_EQ(Count(s.prompt_text, m[0]), 1);
      }
    }
    EXPECT_EQ(asked, 1);
  }
}

TEST(TasksTest, NiahMultivalueListsFourDistinctNumbersInHaystackOrder) {
  for (uint64_t seed : Seeds(20)) {
    TaskSample s = Make("niah_multivalue", 2048, seed);
    std::smatch q;
    ASSERT_TRUE(std::regex_match(
        s.query, q,
        std::regex("What are all the special magic numbers for (" + kKey +
                   ")\\? The special magic numbers for \\1 are ")))
        << s.query;
    auto needles = Matches(Haystack(s), "The special magic number for (" + kKey + ") is (" +
                                            kNumber + ")\\.");
    ASSERT_EQ(needles.size(), 4u);
    std::vector<std::string> numbers;
    for (const auto& m : needles) {
      EXPECT_EQ(m[1], q[1].str());
      EXPECT_EQ(Count(s.prompt_text, m[0]), 1);
      numbers.push_back(m[2]);
    }
    EXPECT_EQ(std::set<std::string>(numbers.begin(), numbers.end()).size(), 4u);
    EXPECT_EQ(s.answer, absl::StrJoin(numbers, ", "));
  }
}

TEST(TasksTest, NiahMultiqueryAsksTwoOfFourKeysInHaystackOrder) {
  std::set<std::pair<int, int>> pairs_seen;
  for (uint64_t seed : Seeds(60)) {
    TaskSample s = Make("niah_multiquery", 2048, seed);
    std::smatch q;
    ASSERT_TRUE(std::regex_match(
        s.query, q,
        std::regex("What are the special magic numbers for (" + kKey + ") and (" + kKey +
                   ")\\? The special magic numbers for \\1 and \\2 are ")))
        << s.query;
    auto needles = Matches(Haystack(s), "The special magic number for (" + kKey + ") is (" +
                                            kNumber + ")\\.");
    ASSERT_EQ(needles.size(), 4u);
    int a = -1, b = -1;
    for (int i = 0; i < 4; ++i) {
      if (needles[i][1] == q[1]) a = i;
      if (needles[i][1] == q[2]) b = i;
    }
    ASSERT_GE(a, 0);
    ASSERT_GT(b, a) << "keys must be named in haystack order";
    pairs_seen.insert({a, b});
    EXPECT_EQ(s.answer, absl::StrCat(needles[a][2], ", ", needles[b][2]));
  }
  EXPECT_EQ(pairs_seen.size(), 6u) << "every pair of the four needles gets asked";
}

TEST(TasksTest, VariableTrackingNamesTheThreeHopChainOfTheAskedValueInOrder) {
  for (uint64_t seed : Seeds(20)) {
    TaskSample s = Make("vt", 2048, seed);
    const std::string hay = Haystack(s);
    std::smatch q;
    ASSERT_TRUE(std::regex_match(s.query, q,
                                 std::regex("Which variables hold the value (" + kValue +
                                            ")\\? The variables that hold \\1 are ")))
        << s.query;
    const std::string asked = q[1];
    auto assigns = Matches(hay, "VAR (" + kVar + ") = (" + kValue + "|VAR " + kVar + ")\\.");
    ASSERT_EQ(assigns.size(), 5u);
    EXPECT_EQ(Count(hay, "VAR "), 8);  // 5 targets + 3 references: nothing else says VAR
    // Resolve every variable (definitions precede uses: each chain is in haystack order) and
    // list the holders of the asked value in haystack order.
    std::map<std::string, std::string> value_of;
    std::vector<std::string> holders;
    for (const auto& m : assigns) {
      const std::string name = m[1], rhs = m[2];
      EXPECT_EQ(value_of.count(name), 0u) << name;
      if (rhs.rfind("VAR ", 0) == 0) {
        ASSERT_EQ(value_of.count(rhs.substr(4)), 1u) << "used before defined: " << rhs;
        value_of[name] = value_of[rhs.substr(4)];
      } else {
        value_of[name] = rhs;
      }
      if (value_of[name] == asked) holders.push_back(name);
    }
    ASSERT_EQ(holders.size(), 3u);
    EXPECT_EQ(s.answer, absl::StrJoin(holders, ", "));
    EXPECT_EQ(Matches(hay, "VAR " + kVar + " = " + kValue + "\\.").size(), 2u);
  }
}

TEST(TasksTest, AggregateListsEveryTagOfTheKeyInHaystackOrderBesideThreeDistractors) {
  std::set<size_t> counts;
  for (uint64_t seed : Seeds(60)) {
    TaskSample s = Make("aggregate", 2048, seed);
    std::smatch q;
    ASSERT_TRUE(std::regex_match(
        s.query, q, std::regex("List every (" + kKey + ") tag\\. The \\1 tags are ")))
        << s.query;
    auto tags = Matches(Haystack(s), "The (" + kKey + ") tag is ((?:[bdfgklmnprstvz][aeiou])+)\\.");
    std::vector<std::string> words;
    std::map<std::string, int> per_key;
    std::set<std::string> all_words;
    for (const auto& m : tags) {
      ++per_key[m[1]];
      all_words.insert(m[2]);
      const size_t syllables = m[2].length() / 2;
      EXPECT_TRUE(syllables == 2 || syllables == 3) << m[2];
      if (m[1] == q[1]) words.push_back(m[2]);
    }
    ASSERT_EQ(per_key.size(), 2u);
    for (const auto& [key, n] : per_key) {
      if (key != q[1].str()) {
        EXPECT_EQ(n, 3);
      }
    }
    EXPECT_GE(words.size(), 2u);
    EXPECT_LE(words.size(), 6u);
    counts.insert(words.size());
    EXPECT_EQ(all_words.size(), tags.size()) << "tag words are distinct";
    EXPECT_EQ(s.answer, absl::StrJoin(words, ", "));
  }
  EXPECT_EQ(counts, (std::set<size_t>{2, 3, 4, 5, 6}));
}

TEST(TasksTest, PassageAnswerIsExactly256CharactersOfRandomSentencesBetweenItsMarkers) {
  for (uint64_t seed : Seeds(30)) {
    TaskSample s = Make("passage", 2048, seed);
    std::smatch q;
    ASSERT_TRUE(std::regex_match(
        s.query, q, std::regex("Repeat passage (" + kKey + ")\\. Passage \\1 begins: ")))
        << s.query;
    const std::string key = q[1];
    EXPECT_EQ(s.answer.size(), 256u);
    EXPECT_TRUE(std::regex_match(s.answer, std::regex("[a-z][a-z .]*"))) << s.answer;
    EXPECT_EQ(Count(s.prompt_text,
                    absl::StrCat("Passage ", key, " begins: ", s.answer, " Passage ", key,
                                 " ends.")),
              1);
    const std::string hay = Haystack(s);
    auto begins = Matches(hay, "Passage (" + kKey + ") begins: ");
    auto ends = Matches(hay, "Passage (" + kKey + ") ends\\.");
    ASSERT_EQ(begins.size(), 2u);
    ASSERT_EQ(ends.size(), 2u);
    EXPECT_NE(begins[0][1], begins[1][1]) << "the distractor passage has another key";
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(begins[i][1], ends[i][1]);
      const size_t text_at = begins[i].position(0) + begins[i].length(0);
      EXPECT_EQ(ends[i].position(0) - text_at, 257u) << "256 characters and one space";
    }
  }
}

TEST(TasksTest, FillerSentencesAreFixedOrFourToTenWordsOfOneToThreeSyllables) {
  const std::regex random_sentence(
      "[BDFGKLMNPRSTVZ][aeiou](?:[bdfgklmnprstvz][aeiou]){0,2}"
      "(?: (?:[bdfgklmnprstvz][aeiou]){1,3}){3,9}\\.");
  int fixed = 0, random = 0;
  std::set<std::string> fixed_seen;
  for (uint64_t seed : Seeds(10)) {
    TaskSample s = Make("niah_single", 4096, seed);
    std::string hay = Haystack(s);
    const std::string needle =
        Matches(hay, "The special magic number for " + kKey + " is " + kNumber + "\\.")[0][0];
    hay.replace(hay.find(needle), needle.size(), "");
    // Sentences end with '.' and are joined by single spaces; no filler sentence has an inner '.'.
    for (absl::string_view piece : absl::StrSplit(hay, ". ", absl::SkipEmpty())) {
      std::string sentence(piece);
      if (sentence.back() != '.') sentence.push_back('.');
      if (sentence.front() == ' ') sentence.erase(0, 1);  // where the needle was removed
      if (std::find(kFixedSentences.begin(), kFixedSentences.end(), sentence) !=
          kFixedSentences.end()) {
        ++fixed;
        fixed_seen.insert(sentence);
      } else {
        EXPECT_TRUE(std::regex_match(sentence, random_sentence)) << "'" << sentence << "'";
        ++random;
      }
    }
  }
  EXPECT_EQ(fixed_seen.size(), kFixedSentences.size());
  const double share = static_cast<double>(fixed) / (fixed + random);
  EXPECT_GT(share, 0.45);
  EXPECT_LT(share, 0.55);
}

TEST(TasksTest, NeedlesLandAtEveryDepthOfTheHaystack) {
  int shallow = 0, deep = 0;
  for (uint64_t seed : Seeds(200)) {
    TaskSample s = Make("niah_single", 1024, seed);
    const double depth = static_cast<double>(s.prompt_text.find("special magic")) /
                         Haystack(s).size();
    shallow += depth < 0.2;
    deep += depth > 0.8;
  }
  EXPECT_GT(shallow, 20);
  EXPECT_GT(deep, 20);
}

TEST(TasksTest, SameSeedGivesTheSameSampleAndOtherSeedsOrCellsDiffer) {
  for (const std::string& task : TaskNames()) {
    TaskSample a = Make(task, 1024, kFirstEvalSeed + 7);
    TaskSample b = Make(task, 1024, kFirstEvalSeed + 7);
    EXPECT_EQ(a.prompt_ids, b.prompt_ids);
    EXPECT_EQ(a.answer, b.answer);
    TaskSample c = Make(task, 1024, kFirstEvalSeed + 8);
    EXPECT_NE(a.prompt_text, c.prompt_text);
    EXPECT_NE(a.answer, c.answer);
    TaskSample d = Make(task, 1100, kFirstEvalSeed + 7);
    EXPECT_NE(a.prompt_text.substr(0, 200), d.prompt_text.substr(0, 200));
  }
}

TEST(TasksTest, RejectsTrainingSeedsBelowOneMillion) {
  absl::StatusOr<TaskSample> s = MakeTaskSample("niah_single", 1024, kFirstEvalSeed - 1);
  ASSERT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("1000000"));
  EXPECT_TRUE(MakeTaskSample("niah_single", 1024, kFirstEvalSeed).ok());
}

TEST(TasksTest, AcceptsOnlyTheCalibrationRangeBelowTheEvaluationSeeds) {
  EXPECT_TRUE(MakeTaskSample("vt", 1024, kFirstCalibrationSeed).ok());
  EXPECT_TRUE(MakeTaskSample("vt", 1024, kFirstCalibrationSeed + kCalibrationSeeds - 1).ok());
  EXPECT_FALSE(MakeTaskSample("vt", 1024, kFirstCalibrationSeed - 1).ok());
  EXPECT_FALSE(MakeTaskSample("vt", 1024, kFirstCalibrationSeed + kCalibrationSeeds).ok());
  EXPECT_LT(kFirstCalibrationSeed + kCalibrationSeeds, kFirstEvalSeed);
}

TEST(TasksTest, UnknownTaskErrorListsTheValidNames) {
  absl::StatusOr<TaskSample> s = MakeTaskSample("niah", 1024, kFirstEvalSeed);
  ASSERT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  for (const std::string& name : TaskNames()) EXPECT_THAT(s.status().message(), HasSubstr(name));
}

TEST(TasksTest, ContextTooShortForTheItemsIsInvalidArgument) {
  absl::StatusOr<TaskSample> s = MakeTaskSample("passage", 512, kFirstEvalSeed);
  ASSERT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("too short for task passage"));
  EXPECT_EQ(MakeTaskSample("niah_single", 100, kFirstEvalSeed).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeTaskSample("niah_single", 0, kFirstEvalSeed).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fluxion::eval
