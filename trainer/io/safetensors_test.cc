#include "trainer/io/safetensors.h"

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/util/temp_dir.h"

namespace tessera::trainer {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::ReadBytes;
using ::tessera::testing::ScopedTempDir;
using ::tessera::testing::StatusIs;
using ::tessera::testing::WriteBytes;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

bool Exists(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0;
}

uint64_t LittleEndian64(const std::string& bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | static_cast<unsigned char>(bytes[i]);
  return value;
}

// A file of raw header JSON (padded to 8) and `data_bytes` zero bytes of data.
std::string RawSafetensors(std::string header, size_t data_bytes) {
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return file + header + std::string(data_bytes, '\0');
}

class SafetensorsTest : public ::testing::Test {
 protected:
  ScopedTempDir tmp_;
  const std::string dir_ = tmp_.path();
};

TEST_F(SafetensorsTest, WritesF32AndI64ThatReadBack) {
  const std::vector<float> weights = {1.5f, -2.25f, 3.0f, 0.0f, 1e-3f, -7.75f};
  const std::vector<int64_t> ids = {1, -2, 1LL << 40, 7};
  const std::string path = dir_ + "/model.safetensors";
  ASSERT_THAT(
      WriteSafetensors(
          path,
          {{"layers.0.weight", "F32", {2, 3}, weights.data(), weights.size() * sizeof(float)},
           {"token_ids", "I64", {4}, ids.data(), ids.size() * sizeof(int64_t)}},
          {{"format", "pt"}, {"step", "100"}}),
      IsOk());
  EXPECT_FALSE(Exists(path + ".tmp"));

  absl::StatusOr<SafetensorsFile> file = ReadSafetensorsHeader(path);
  ASSERT_THAT(file, IsOk());
  EXPECT_EQ(file->metadata,
            (std::map<std::string, std::string>{{"format", "pt"}, {"step", "100"}}));
  EXPECT_EQ(file->data_offset % 8, 0u);
  ASSERT_EQ(file->tensors.size(), 2u);
  const SafetensorsEntry& w = file->tensors.at("layers.0.weight");
  EXPECT_EQ(w.dtype, "F32");
  EXPECT_THAT(w.shape, ElementsAre(2, 3));
  // I64 data goes first (widest dtype), keeping every tensor aligned to its element size.
  EXPECT_EQ(w.begin, 32u);
  EXPECT_EQ(w.end, 56u);
  const SafetensorsEntry& t = file->tensors.at("token_ids");
  EXPECT_EQ(t.dtype, "I64");
  EXPECT_THAT(t.shape, ElementsAre(4));
  EXPECT_EQ(t.begin, 0u);
  EXPECT_EQ(t.end, 32u);

  const std::string bytes = ReadBytes(path);
  ASSERT_EQ(bytes.size(), file->data_offset + 56);
  EXPECT_EQ(LittleEndian64(bytes), file->data_offset - 8);
  const std::string header = bytes.substr(8, file->data_offset - 8);
  EXPECT_EQ(header.front(), '{');
  EXPECT_THAT(header.substr(header.find_last_not_of(' ') + 1), ::testing::Each(' '));
  EXPECT_EQ(std::memcmp(bytes.data() + file->data_offset + w.begin, weights.data(), 24), 0);
  EXPECT_EQ(std::memcmp(bytes.data() + file->data_offset + t.begin, ids.data(), 32), 0);

  // An independent reading of the header with a JSON parser.
  nlohmann::json json = nlohmann::json::parse(header);
  EXPECT_EQ(json["__metadata__"]["step"], "100");
  EXPECT_EQ(json["token_ids"]["data_offsets"], nlohmann::json({0, 32}));
  EXPECT_EQ(json["layers.0.weight"]["shape"], nlohmann::json({2, 3}));
}

TEST_F(SafetensorsTest, HeaderIsPaddedToEightBytesForEveryLength) {
  const uint16_t half = 0x3c00;  // 1.0 in F16 and in nothing else in particular
  for (int name_length = 1; name_length <= 9; ++name_length) {
    const std::string path = dir_ + "/pad.safetensors";
    ASSERT_THAT(WriteSafetensors(path, {{std::string(name_length, 'x'), "F16", {1}, &half, 2}}, {}),
                IsOk());
    absl::StatusOr<SafetensorsFile> file = ReadSafetensorsHeader(path);
    ASSERT_THAT(file, IsOk());
    EXPECT_EQ(file->data_offset % 8, 0u) << "name length " << name_length;
    EXPECT_TRUE(file->metadata.empty());
  }
}

TEST_F(SafetensorsTest, RejectsWrongSizesAndRepeatedNames) {
  const std::vector<float> values(6);
  const std::string path = dir_ + "/bad.safetensors";
  EXPECT_THAT(WriteSafetensors(path, {{"w", "F32", {2, 2}, values.data(), 24}}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("\"w\""), HasSubstr("nbytes 24"), HasSubstr("need 16"))));
  EXPECT_THAT(
      WriteSafetensors(
          path, {{"w", "F32", {6}, values.data(), 24}, {"w", "F32", {6}, values.data(), 24}}, {}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("name repeats")));
  EXPECT_THAT(WriteSafetensors(path, {{"w", "F31", {6}, values.data(), 24}}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown dtype")));
  EXPECT_THAT(WriteSafetensors(path, {{"__metadata__", "F32", {6}, values.data(), 24}}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("reserved")));
  EXPECT_FALSE(Exists(path));
  EXPECT_FALSE(Exists(path + ".tmp"));
}

TEST_F(SafetensorsTest, ReadRejectsCorruptFilesNamingThem) {
  const std::string path = dir_ + "/corrupt.safetensors";
  EXPECT_THAT(ReadSafetensorsHeader(path), StatusIs(absl::StatusCode::kNotFound, HasSubstr(path)));

  const std::vector<float> values = {1, 2, 3, 4};
  ASSERT_THAT(WriteSafetensors(path, {{"w", "F32", {4}, values.data(), 16}}, {}), IsOk());
  std::string good = ReadBytes(path);
  WriteBytes(path, good.substr(0, good.size() - 4));  // truncated data
  EXPECT_THAT(ReadSafetensorsHeader(path),
              StatusIs(absl::StatusCode::kDataLoss, AllOf(HasSubstr(path), HasSubstr("cover 16"))));

  std::string huge_length = good;
  huge_length[6] = 0x01;  // header length beyond the file
  WriteBytes(path, huge_length);
  EXPECT_THAT(ReadSafetensorsHeader(path),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("header length")));

  WriteBytes(path, RawSafetensors("{not json", 0));
  EXPECT_THAT(ReadSafetensorsHeader(path),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("not a JSON object")));

  // Overlapping ranges.
  WriteBytes(path, RawSafetensors(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                  R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                  12));
  EXPECT_THAT(ReadSafetensorsHeader(path),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("not contiguous")));

  // A range that disagrees with its shape.
  WriteBytes(path, RawSafetensors(R"({"a":{"dtype":"I64","shape":[2],"data_offsets":[0,8]}})", 8));
  EXPECT_THAT(ReadSafetensorsHeader(path),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("\"a\""), HasSubstr("do not match its dtype and shape"))));

  WriteBytes(path, "1234");
  EXPECT_THAT(ReadSafetensorsHeader(path),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("too short")));
}

TEST_F(SafetensorsTest, EmptyAndZeroSizedTensors) {
  const std::string path = dir_ + "/empty.safetensors";
  const float one = 1.0f;
  ASSERT_THAT(WriteSafetensors(
                  path, {{"empty", "BF16", {0, 4}, nullptr, 0}, {"one", "F32", {}, &one, 4}}, {}),
              IsOk());
  absl::StatusOr<SafetensorsFile> file = ReadSafetensorsHeader(path);
  ASSERT_THAT(file, IsOk());
  EXPECT_EQ(file->tensors.at("empty").begin, file->tensors.at("empty").end);
  EXPECT_EQ(file->tensors.at("one").end - file->tensors.at("one").begin, 4u);
  EXPECT_THAT(file->tensors.at("one").shape, ::testing::IsEmpty());
}

TEST_F(SafetensorsTest, StreamingWritesTheSameFileOneTensorAtATime) {
  const std::vector<float> weights = {1.5f, -2.25f, 3.0f, 0.0f, 1e-3f, -7.75f};
  const std::vector<int64_t> ids = {1, -2, 1LL << 40, 7};
  const std::vector<uint16_t> halves = {0x3c00, 0xc000, 0x0001};
  const std::vector<TensorView> views = {
      {"layers.0.weight", "F32", {2, 3}, weights.data(), weights.size() * sizeof(float)},
      {"halves", "F16", {3}, halves.data(), halves.size() * sizeof(uint16_t)},
      {"token_ids", "I64", {4}, ids.data(), ids.size() * sizeof(int64_t)}};
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  const std::string reference = dir_ + "/reference.safetensors";
  ASSERT_THAT(WriteSafetensors(reference, views, metadata), IsOk());

  std::vector<TensorSpec> specs;
  for (const TensorView& view : views) specs.push_back({view.name, view.dtype, view.shape});
  const std::string path = dir_ + "/streamed.safetensors";
  std::vector<size_t> asked;
  ASSERT_THAT(WriteSafetensorsStreaming(path, specs, metadata,
                                        [&](size_t i, void* data) {
                                          asked.push_back(i);
                                          std::memcpy(data, views[i].data, views[i].nbytes);
                                          return absl::OkStatus();
                                        }),
              IsOk());
  // Data order: widest dtype first, then as given; the file is byte for byte WriteSafetensors'.
  EXPECT_THAT(asked, ElementsAre(2, 0, 1));
  EXPECT_EQ(ReadBytes(path), ReadBytes(reference));
  EXPECT_FALSE(Exists(path + ".tmp"));

  // A failing producer stops the write: the previous file stays, no temporary is left.
  EXPECT_THAT(WriteSafetensorsStreaming(path, specs, {},
                                        [&](size_t i, void*) {
                                          return i == 0 ? absl::DataLossError("tensor 0 is gone")
                                                        : absl::OkStatus();
                                        }),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor 0 is gone")));
  EXPECT_EQ(ReadBytes(path), ReadBytes(reference));
  EXPECT_FALSE(Exists(path + ".tmp"));
  // Invalid tensors are refused before the producer is asked for anything.
  asked.clear();
  EXPECT_THAT(WriteSafetensorsStreaming(dir_ + "/bad.safetensors",
                                        {{"w", "F32", {2}}, {"w", "F32", {2}}}, {},
                                        [&](size_t i, void*) {
                                          asked.push_back(i);
                                          return absl::OkStatus();
                                        }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("name repeats")));
  EXPECT_THAT(asked, ::testing::IsEmpty());
  EXPECT_FALSE(Exists(dir_ + "/bad.safetensors"));
}

}  // namespace
}  // namespace tessera::trainer
