#include "model/safetensors.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "common/half.h"
#include "common/test_temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::model {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;


std::vector<uint8_t> F32Bytes(const std::vector<float>& values) {
  std::vector<uint8_t> bytes(values.size() * 4);
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

std::vector<uint8_t> Bf16Bytes(const std::vector<float>& values) {
  std::vector<uint8_t> bytes(values.size() * 2);
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t bits = FloatToBf16(values[i]).bits;
    std::memcpy(&bytes[2 * i], &bits, 2);
  }
  return bytes;
}

std::vector<uint8_t> F16Bytes(const std::vector<float>& values) {
  std::vector<uint8_t> bytes(values.size() * 2);
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t bits = FloatToFp16(values[i]).bits;
    std::memcpy(&bytes[2 * i], &bits, 2);
  }
  return bytes;
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string LittleEndian64(uint64_t value) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(value >> (8 * i));
  return bytes;
}

// A hand-made file: [header_len][header][data], for headers WriteSafetensors would never write.
void WriteRawSafetensors(const std::string& path, const std::string& header, size_t data_bytes) {
  WriteBytes(path, LittleEndian64(header.size()) + header + std::string(data_bytes, '\x01'));
}

// Opens `path` and expects failure with `code` and every one of `needles` in the message.
void ExpectOpenFails(const std::string& path, absl::StatusCode code,
                     const std::vector<std::string>& needles) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_FALSE(file.ok()) << "opened a file that should be rejected";
  EXPECT_EQ(file.status().code(), code) << file.status();
  for (const std::string& needle : needles) {
    EXPECT_THAT(file.status().message(), HasSubstr(needle));
  }
}

TEST(SafetensorsTest, WriteThenOpenRoundTripsEachDtypeAndMetadata) {
  ScopedTestTempDir temp;
  const std::string path = temp.File("model.safetensors");
  // Values exactly representable in each dtype, including extremes and an fp16 subnormal.
  const std::vector<float> bf16_values = {0.0f,     1.0f,     -2.5f,
                                          0.15625f, 65280.0f, -std::ldexp(1.0f, -100)};
  const std::vector<float> f16_values = {
      0.0f, -1.0f, 2.5f, 65504.0f, std::ldexp(1.0f, -14), std::ldexp(1.0f, -24)};
  const std::vector<float> f32_values = {3.14159274f, -1e-38f, 1e38f, 0.1f};
  const std::vector<TensorToWrite> tensors = {
      {"w.bf16", DType::kBF16, {2, 3}, Bf16Bytes(bf16_values)},
      {"w.f16", DType::kF16, {6}, F16Bytes(f16_values)},
      {"w.f32", DType::kF32, {2, 1, 2}, F32Bytes(f32_values)},
      {"scalar", DType::kF32, {}, F32Bytes({7.0f})},
      {"empty", DType::kBF16, {0, 4}, {}},
  };
  ASSERT_TRUE(WriteSafetensors(path, tensors, {{"format", "pt"}, {"note", "round trip"}}).ok());

  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors().size(), 5u);
  EXPECT_EQ((*file)->metadata(),
            (std::map<std::string, std::string>{{"format", "pt"}, {"note", "round trip"}}));

  absl::StatusOr<const TensorView*> bf16 = (*file)->Find("w.bf16");
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ((*bf16)->dtype, DType::kBF16);
  EXPECT_EQ((*bf16)->dtype_name, "BF16");
  EXPECT_EQ((*bf16)->numel(), 6);
  EXPECT_EQ((*bf16)->nbytes, 12u);
  EXPECT_EQ((*bf16)->file, path);
  absl::StatusOr<std::vector<float>> values = ReadAsFloat(**bf16, {2, 3});
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ElementsAreArray(bf16_values));

  absl::StatusOr<const TensorView*> f16 = (*file)->Find("w.f16");
  ASSERT_TRUE(f16.ok()) << f16.status();
  values = ReadAsFloat(**f16, {6});
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ElementsAreArray(f16_values));

  absl::StatusOr<const TensorView*> f32 = (*file)->Find("w.f32");
  ASSERT_TRUE(f32.ok()) << f32.status();
  values = ReadAsFloat(**f32, {2, 1, 2});
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ElementsAreArray(f32_values));

  absl::StatusOr<const TensorView*> scalar = (*file)->Find("scalar");
  ASSERT_TRUE(scalar.ok()) << scalar.status();
  EXPECT_EQ((*scalar)->numel(), 1);
  values = ReadAsFloat(**scalar, {});
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ElementsAre(7.0f));

  absl::StatusOr<const TensorView*> empty = (*file)->Find("empty");
  ASSERT_TRUE(empty.ok()) << empty.status();
  values = ReadAsFloat(**empty, {0, 4});
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_TRUE(values->empty());
}

TEST(SafetensorsTest, WrittenHeaderIsPaddedSoTheDataSectionIsEightByteAligned) {
  ScopedTestTempDir temp;
  const std::string path = temp.File("x.safetensors");
  // A one-letter name makes an unpadded header length unlikely to be a multiple of 8.
  for (const char* name : {"a", "ab", "abc", "abcd", "abcde", "abcdef", "abcdefg", "abcdefgh"}) {
    ASSERT_TRUE(WriteSafetensors(path, {{name, DType::kF32, {3}, F32Bytes({1, 2, 3})}}).ok());
    const std::string bytes = ReadBytes(path);
    ASSERT_GE(bytes.size(), 8u);
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
    EXPECT_EQ(header_len % 8, 0u) << name;
    EXPECT_EQ(bytes.size(), 8 + header_len + 12) << name;
  }
}

TEST(SafetensorsTest, WriteRejectsDataOfTheWrongSizeNamingTheTensorAndLeavesNoFile) {
  ScopedTestTempDir temp;
  const std::string path = temp.File("bad.safetensors");
  absl::Status status =
      WriteSafetensors(path, {{"ok", DType::kF32, {1}, F32Bytes({1})},
                              {"model.norm.weight", DType::kBF16, {4}, Bf16Bytes({1, 2, 3})}});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), AllOf(HasSubstr("model.norm.weight"), HasSubstr("[4]")));
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(SafetensorsTest, WriteRejectsUnknownDtypeAndDuplicateNames) {
  ScopedTestTempDir temp;
  const std::string path = temp.File("bad.safetensors");
  absl::Status status =
      WriteSafetensors(path, {{"ids", DType::kOther, {2}, std::vector<uint8_t>(16)}});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("ids"));

  status = WriteSafetensors(path, {{"twice", DType::kF32, {1}, F32Bytes({1})},
                                   {"twice", DType::kF32, {1}, F32Bytes({2})}});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("twice"));
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(SafetensorsTest, CheckpointOpensEveryShardListedInTheIndex) {
  ScopedTestTempDir temp;
  ASSERT_TRUE(WriteSafetensors(
                  temp.File("model-00001-of-00002.safetensors"),
                  {{"model.embed_tokens.weight", DType::kBF16, {2, 2}, Bf16Bytes({1, 2, 3, 4})},
                   {"model.norm.weight", DType::kF32, {2}, F32Bytes({5, 6})}})
                  .ok());
  ASSERT_TRUE(WriteSafetensors(temp.File("model-00002-of-00002.safetensors"),
                               {{"lm_head.weight", DType::kF16, {2, 2}, F16Bytes({7, 8, 9, 10})}})
                  .ok());
  WriteBytes(temp.File("model.safetensors.index.json"), R"({
    "metadata": {"total_size": 24},
    "weight_map": {
      "lm_head.weight": "model-00002-of-00002.safetensors",
      "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
      "model.norm.weight": "model-00001-of-00002.safetensors"
    }})");

  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(temp.dir());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ((*checkpoint)->tensors().size(), 3u);
  absl::StatusOr<const TensorView*> head = (*checkpoint)->Find("lm_head.weight");
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->file, temp.File("model-00002-of-00002.safetensors"));
  absl::StatusOr<std::vector<float>> values = ReadAsFloat(**head, {2, 2});
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ElementsAre(7, 8, 9, 10));
  absl::StatusOr<const TensorView*> embed = (*checkpoint)->Find("model.embed_tokens.weight");
  ASSERT_TRUE(embed.ok()) << embed.status();
  values = ReadAsFloat(**embed, {2, 2});
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ElementsAre(1, 2, 3, 4));
}

TEST(SafetensorsTest, CheckpointOpensASingleFileWhenThereIsNoIndex) {
  ScopedTestTempDir temp;
  ASSERT_TRUE(WriteSafetensors(temp.File("model.safetensors"),
                               {{"model.norm.weight", DType::kF32, {2}, F32Bytes({5, 6})}})
                  .ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(temp.dir());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ((*checkpoint)->tensors().size(), 1u);
  EXPECT_TRUE((*checkpoint)->Find("model.norm.weight").ok());
}

TEST(SafetensorsTest, CheckpointFindOfAnAbsentTensorIsNotFoundNamingIt) {
  ScopedTestTempDir temp;
  ASSERT_TRUE(WriteSafetensors(temp.File("model.safetensors"),
                               {{"model.norm.weight", DType::kF32, {2}, F32Bytes({5, 6})}})
                  .ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(temp.dir());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  absl::StatusOr<const TensorView*> missing = (*checkpoint)->Find("lm_head.weight");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("lm_head.weight"));
}

TEST(SafetensorsTest, DirectoryWithoutWeightsIsNotFoundNamingTheDirectory) {
  ScopedTestTempDir temp;
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(temp.dir());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(checkpoint.status().message(),
              AllOf(HasSubstr("no model.safetensors or model.safetensors.index.json"),
                    HasSubstr(temp.dir())));
}

TEST(SafetensorsTest, IndexNamingATensorAbsentFromItsShardIsNotFound) {
  ScopedTestTempDir temp;
  ASSERT_TRUE(WriteSafetensors(temp.File("shard-1.safetensors"),
                               {{"model.norm.weight", DType::kF32, {2}, F32Bytes({5, 6})}})
                  .ok());
  WriteBytes(temp.File("model.safetensors.index.json"), R"({"weight_map": {
      "model.norm.weight": "shard-1.safetensors",
      "lm_head.weight": "shard-1.safetensors"}})");
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(temp.dir());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(checkpoint.status().message(),
              AllOf(HasSubstr("lm_head.weight"), HasSubstr("shard-1.safetensors")));
}

TEST(SafetensorsTest, IndexWithAPathTraversingShardNameIsRejected) {
  ScopedTestTempDir temp;
  // A real file outside the checkpoint dir, so only the name check can stop it.
  ASSERT_TRUE(WriteSafetensors(temp.File("x"), {{"w", DType::kF32, {1}, F32Bytes({1})}}).ok());
  std::filesystem::create_directories(temp.File("ckpt"));
  WriteBytes(temp.File("ckpt/model.safetensors.index.json"), R"({"weight_map": {"w": "../x"}})");
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(temp.File("ckpt"));
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(checkpoint.status().message(), HasSubstr("'../x'"));
}

TEST(SafetensorsTest, TensorInTwoShardsIsInvalidArgumentNamingIt) {
  ScopedTestTempDir temp;
  for (const char* shard : {"a.safetensors", "b.safetensors"}) {
    ASSERT_TRUE(WriteSafetensors(temp.File(shard),
                                 {{"model.norm.weight", DType::kF32, {1}, F32Bytes({1})},
                                  {std::string("only.") + shard, DType::kF32, {1}, F32Bytes({1})}})
                    .ok());
  }
  WriteBytes(temp.File("model.safetensors.index.json"), R"({"weight_map": {
      "model.norm.weight": "a.safetensors",
      "only.a.safetensors": "a.safetensors",
      "only.b.safetensors": "b.safetensors"}})");
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(temp.dir());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(checkpoint.status().message(), HasSubstr("model.norm.weight"));
}

TEST(SafetensorsTest, MissingFileIsNotFound) {
  ScopedTestTempDir temp;
  ExpectOpenFails(temp.File("absent.safetensors"), absl::StatusCode::kNotFound,
                  {"absent.safetensors"});
}

TEST(SafetensorsTest, FileCutInTheMiddleOfTheDataIsDataLossNamingTheTensor) {
  ScopedTestTempDir temp;
  const std::string path = temp.File("cut.safetensors");
  ASSERT_TRUE(
      WriteSafetensors(
          path, {{"model.layers.0.mlp.up_proj.weight", DType::kF32, {4}, F32Bytes({1, 2, 3, 4})},
                 {"model.layers.0.mlp.down_proj.weight", DType::kF32, {4}, F32Bytes({5, 6, 7, 8})}})
          .ok());
  const uint64_t full = std::filesystem::file_size(path);
  std::filesystem::resize_file(path, full - 16);  // keep the first half of the 32 data bytes
  ExpectOpenFails(path, absl::StatusCode::kDataLoss, {"model.layers.0.mlp.down_proj.weight"});
}

TEST(SafetensorsTest, FileShorterThanTheLengthPrefixIsDataLoss) {
  ScopedTestTempDir temp;
  WriteBytes(temp.File("short"), std::string("\x10\x00\x00", 3));
  ExpectOpenFails(temp.File("short"), absl::StatusCode::kDataLoss, {"truncated"});
  WriteBytes(temp.File("empty"), "");
  ExpectOpenFails(temp.File("empty"), absl::StatusCode::kDataLoss, {"truncated"});
}

TEST(SafetensorsTest, HeaderLengthOverTheLimitIsRejectedBeforeAnyAllocation) {
  ScopedTestTempDir temp;
  // 2^40 bytes could neither be allocated nor mapped; the length check must come first.
  WriteBytes(temp.File("huge"), LittleEndian64(uint64_t{1} << 40) + "{}      ");
  ExpectOpenFails(temp.File("huge"), absl::StatusCode::kInvalidArgument,
                  {"header of 1099511627776 bytes exceeds"});
  WriteBytes(temp.File("max"), LittleEndian64(~uint64_t{0}) + "{}      ");
  ExpectOpenFails(temp.File("max"), absl::StatusCode::kInvalidArgument, {"exceeds"});
}

TEST(SafetensorsTest, HeaderLengthBeyondTheFileIsDataLoss) {
  ScopedTestTempDir temp;
  WriteBytes(temp.File("f"), LittleEndian64(1000) + R"({"__metadata__": {}})");
  ExpectOpenFails(temp.File("f"), absl::StatusCode::kDataLoss, {"1000"});
}

TEST(SafetensorsTest, MalformedHeaderJsonIsInvalidArgument) {
  ScopedTestTempDir temp;
  WriteRawSafetensors(temp.File("f"), R"({"w": {"dtype": "F32", "shape": [1],)", 4);
  ExpectOpenFails(temp.File("f"), absl::StatusCode::kInvalidArgument, {"not valid JSON"});
  WriteRawSafetensors(temp.File("g"), "[1, 2, 3]", 0);
  ExpectOpenFails(temp.File("g"), absl::StatusCode::kInvalidArgument, {"not a JSON object"});
}

TEST(SafetensorsTest, OverlappingTensorsAreDataLossNamingBoth) {
  ScopedTestTempDir temp;
  WriteRawSafetensors(temp.File("f"), R"({
      "model.first": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "model.second": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
                      24);
  ExpectOpenFails(temp.File("f"), absl::StatusCode::kDataLoss, {"model.first", "model.second"});
}

TEST(SafetensorsTest, ZeroLengthTensorInsideAnotherIsNotAnOverlap) {
  ScopedTestTempDir temp;
  WriteRawSafetensors(temp.File("f"), R"({
      "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}})",
                      16);
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(temp.File("f"));
  EXPECT_TRUE(file.ok()) << file.status();
}

TEST(SafetensorsTest, OffsetsOutsideTheDataSectionAreDataLossNamingTheTensor) {
  ScopedTestTempDir temp;
  WriteRawSafetensors(temp.File("f"), R"({
      "model.reversed": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})",
                      8);
  ExpectOpenFails(temp.File("f"), absl::StatusCode::kDataLoss, {"model.reversed"});
  WriteRawSafetensors(temp.File("g"), R"({
      "model.beyond": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
                      12);
  ExpectOpenFails(temp.File("g"), absl::StatusCode::kDataLoss, {"model.beyond"});
}

TEST(SafetensorsTest, ShapeThatDisagreesWithTheByteCountIsInvalidArgumentNamingTheTensor) {
  ScopedTestTempDir temp;
  WriteRawSafetensors(temp.File("f"), R"({
      "model.layers.3.self_attn.k_proj.weight":
          {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 16]}})",
                      16);
  ExpectOpenFails(temp.File("f"), absl::StatusCode::kInvalidArgument,
                  {"model.layers.3.self_attn.k_proj.weight", "[2,3]", "12 bytes", "16 bytes"});
}

TEST(SafetensorsTest, ShapeWhoseByteSizeOverflowsIsInvalidArgument) {
  ScopedTestTempDir temp;
  // 2^62 * 2^2 elements of 4 bytes wraps to 0 in 64 bits, which would "match" an empty range.
  WriteRawSafetensors(temp.File("f"), R"({
      "model.wrap": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 0]}})",
                      0);
  ExpectOpenFails(temp.File("f"), absl::StatusCode::kInvalidArgument, {"model.wrap"});
}

// Found by an attacker: a shape nested 100,000 deep overflowed the stack in nlohmann's recursive
// dump() while the "dimensions must be integers" message was built.
TEST(SafetensorsTest, DeeplyNestedShapeIsInvalidArgumentWithoutRecursingIntoIt) {
  ScopedTestTempDir temp;
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  WriteRawSafetensors(temp.File("f"),
                      R"({"model.deep": {"dtype": "F32", "shape": [)" + deep +
                          R"(], "data_offsets": [0, 4]}})",
                      4);
  ExpectOpenFails(temp.File("f"), absl::StatusCode::kInvalidArgument, {"nested deeper than"});
}

TEST(SafetensorsTest, ShapeWithTooManyDimensionsIsInvalidArgumentNamingTheTensor) {
  ScopedTestTempDir temp;
  std::string shape = "[1";
  for (size_t i = 0; i < kMaxTensorRank; ++i) shape += ",1";
  shape += "]";
  WriteRawSafetensors(temp.File("f"),
                      R"({"model.rank": {"dtype": "F32", "shape": )" + shape +
                          R"(, "data_offsets": [0, 4]}})",
                      4);
  ExpectOpenFails(temp.File("f"), absl::StatusCode::kInvalidArgument, {"model.rank", "dimensions"});
}

TEST(SafetensorsTest, ParseSafetensorsBytesValidatesAnImageInMemory) {
  std::map<std::string, TensorView> tensors;
  std::map<std::string, std::string> metadata;
  const std::string header = R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})";
  const std::string image = LittleEndian64(header.size()) + header + std::string(4, '\0');
  ASSERT_TRUE(ParseSafetensorsBytes(image, &tensors, &metadata).ok());
  ASSERT_EQ(tensors.count("w"), 1u);
  EXPECT_EQ(tensors["w"].nbytes, 4u);
  tensors.clear();
  EXPECT_EQ(ParseSafetensorsBytes("1234", &tensors, &metadata).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(ParseSafetensorsBytes(image.substr(0, image.size() - 1), &tensors, &metadata).code(),
            absl::StatusCode::kDataLoss);
}

TEST(SafetensorsTest, EntryFieldsOfTheWrongTypeAreInvalidArgumentNamingTheTensor) {
  ScopedTestTempDir temp;
  const std::vector<std::string> bad_entries = {
      R"({"dtype": 7, "shape": [1], "data_offsets": [0, 4]})",
      R"({"dtype": "F32", "shape": "1", "data_offsets": [0, 4]})",
      R"({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]})",
      R"({"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]})",
      R"({"dtype": "F32", "shape": [1], "data_offsets": [4]})",
      R"({"dtype": "F32", "shape": [1], "data_offsets": [0, -4]})",
      R"({"dtype": "F32", "shape": [1]})",
      R"("F32")",
  };
  for (const std::string& entry : bad_entries) {
    SCOPED_TRACE(entry);
    WriteRawSafetensors(temp.File("f"), R"({"model.bad": )" + entry + "}", 4);
    ExpectOpenFails(temp.File("f"), absl::StatusCode::kInvalidArgument, {"model.bad"});
  }
}

TEST(SafetensorsTest, TensorNamedTwiceInTheHeaderIsInvalidArgument) {
  ScopedTestTempDir temp;
  WriteRawSafetensors(temp.File("f"), R"({
      "model.twice": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "model.twice": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                      8);
  ExpectOpenFails(temp.File("f"), absl::StatusCode::kInvalidArgument, {"model.twice"});
}

TEST(SafetensorsTest, MetadataMustMapStringsToStrings) {
  ScopedTestTempDir temp;
  WriteRawSafetensors(temp.File("f"), R"({"__metadata__": {"format": "pt", "step": 100}})", 0);
  ExpectOpenFails(temp.File("f"), absl::StatusCode::kInvalidArgument, {"__metadata__", "step"});
  WriteRawSafetensors(temp.File("g"), R"({"__metadata__": ["pt"]})", 0);
  ExpectOpenFails(temp.File("g"), absl::StatusCode::kInvalidArgument, {"__metadata__"});
}

TEST(SafetensorsTest, UnknownDtypeOpensButReadAsFloatRejectsItNamingTensorAndDtype) {
  ScopedTestTempDir temp;
  WriteRawSafetensors(temp.File("f"), R"({
      "model.position_ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}})",
                      16);
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(temp.File("f"));
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<const TensorView*> ids = (*file)->Find("model.position_ids");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ((*ids)->dtype, DType::kOther);
  EXPECT_EQ((*ids)->dtype_name, "I64");
  EXPECT_EQ((*ids)->nbytes, 16u);
  absl::StatusOr<std::vector<float>> values = ReadAsFloat(**ids, {2});
  EXPECT_EQ(values.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(values.status().message(),
            "tensor 'model.position_ids' has dtype I64; expected BF16, F16 or F32");
}

TEST(SafetensorsTest, FileFindOfAnAbsentTensorIsNotFoundNamingIt) {
  ScopedTestTempDir temp;
  ASSERT_TRUE(WriteSafetensors(temp.File("f"), {{"a", DType::kF32, {1}, F32Bytes({1})}}).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(temp.File("f"));
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<const TensorView*> missing = (*file)->Find("model.missing");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("model.missing"));
}

TEST(SafetensorsTest, ReadAsFloatShapeMismatchNamesTensorAndBothShapes) {
  ScopedTestTempDir temp;
  const std::string name = "model.layers.0.self_attn.q_proj.weight";
  ASSERT_TRUE(WriteSafetensors(
                  temp.File("f"),
                  {{name, DType::kBF16, {64, 32}, Bf16Bytes(std::vector<float>(64 * 32, 1.0f))}})
                  .ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(temp.File("f"));
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<const TensorView*> q = (*file)->Find(name);
  ASSERT_TRUE(q.ok()) << q.status();
  absl::StatusOr<std::vector<float>> values = ReadAsFloat(**q, {64, 64});
  EXPECT_EQ(values.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(values.status().message(),
            "tensor 'model.layers.0.self_attn.q_proj.weight' has shape [64,32], expected [64,64]");
  EXPECT_EQ(ReadAsFloat(**q, {64 * 32}).status().code(), absl::StatusCode::kInvalidArgument)
      << "same element count, different shape";
}

TEST(SafetensorsTest, ReadAsFloatConvertsUnalignedData) {
  // Offsets in a file need not be aligned to the element size; the reader must not assume it.
  const std::vector<uint8_t> f32 = F32Bytes({1.5f, -2.0f});
  const std::vector<uint8_t> bf16 = Bf16Bytes({0.5f, -3.0f});
  std::vector<uint8_t> buffer(1 + f32.size() + bf16.size());
  std::memcpy(buffer.data() + 1, f32.data(), f32.size());
  std::memcpy(buffer.data() + 1 + f32.size(), bf16.data(), bf16.size());

  TensorView view;
  view.name = "unaligned.f32";
  view.dtype = DType::kF32;
  view.shape = {2};
  view.data = buffer.data() + 1;
  view.nbytes = f32.size();
  absl::StatusOr<std::vector<float>> values = ReadAsFloat(view, {2});
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ElementsAre(1.5f, -2.0f));

  view.name = "unaligned.bf16";
  view.dtype = DType::kBF16;
  view.data = buffer.data() + 1 + f32.size();
  view.nbytes = bf16.size();
  values = ReadAsFloat(view, {2});
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ElementsAre(0.5f, -3.0f));
}

TEST(SafetensorsTest, ReadAsFloatRejectsAViewWhoseByteCountDisagreesWithItsShape) {
  std::vector<uint8_t> buffer(8);
  TensorView view;
  view.name = "hand.built";
  view.dtype = DType::kF32;
  view.shape = {4};
  view.data = buffer.data();
  view.nbytes = buffer.size();
  absl::StatusOr<std::vector<float>> values = ReadAsFloat(view, {4});
  EXPECT_EQ(values.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(values.status().message(), HasSubstr("hand.built"));
}

TEST(SafetensorsTest, DtypeNamesAndSizesMatchTheFormat) {
  EXPECT_EQ(ParseDType("BF16"), DType::kBF16);
  EXPECT_EQ(ParseDType("F16"), DType::kF16);
  EXPECT_EQ(ParseDType("F32"), DType::kF32);
  EXPECT_EQ(ParseDType("I64"), DType::kOther);
  EXPECT_EQ(ParseDType("bf16"), DType::kOther);
  EXPECT_STREQ(DTypeName(DType::kBF16), "BF16");
  EXPECT_STREQ(DTypeName(DType::kF16), "F16");
  EXPECT_STREQ(DTypeName(DType::kF32), "F32");
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kOther), 0u);
}

}  // namespace
}  // namespace fluxion::model
