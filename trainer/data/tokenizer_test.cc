#include "trainer/data/tokenizer.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace tessera::trainer {
namespace {

namespace fs = std::filesystem;
using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::tessera::testing::TestDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(TokenizerTest, ByteTokenizerRoundTripsUtf8) {
  const std::unique_ptr<Tokenizer> tokenizer = MakeByteTokenizer();
  EXPECT_EQ(tokenizer->vocab_size(), 257u);
  EXPECT_EQ(tokenizer->eos_id(), 256u);
  const std::string text =
      "h\xc3\xa9llo, \xe4\xb8\x96\xe7\x95\x8c \xf0\x9f\x8c\x8d";  // héllo, 世界 🌍
  const std::vector<uint32_t> tokens = tokenizer->Encode(text);
  ASSERT_EQ(tokens.size(), text.size());
  EXPECT_EQ(tokens[0], static_cast<uint32_t>('h'));
  EXPECT_EQ(tokens[1], 0xc3u);
  EXPECT_EQ(tokens[2], 0xa9u);
  EXPECT_EQ(tokenizer->Decode(tokens), text);
}

TEST(TokenizerTest, ByteTokenizerKeepsEveryByteAndDropsEosOnDecode) {
  const std::unique_ptr<Tokenizer> tokenizer = MakeByteTokenizer();
  std::string all_bytes;
  for (int b = 0; b < 256; ++b) all_bytes.push_back(static_cast<char>(b));
  std::vector<uint32_t> tokens = tokenizer->Encode(all_bytes);
  for (uint32_t b = 0; b < 256; ++b) ASSERT_EQ(tokens[b], b);
  tokens.push_back(tokenizer->eos_id());
  EXPECT_EQ(tokenizer->Decode(tokens), all_bytes);
  EXPECT_THAT(tokenizer->Encode("ab"), ElementsAre('a', 'b'));
}

// Trains a small BPE model on `text`; returns the .model path.
std::string TrainSentencePiece(const std::string& dir, const std::string& text, int vocab_size) {
  const std::string input = dir + "/train.txt";
  std::ofstream(input) << text;
  const std::string prefix = dir + "/spm";
  // SentencePieceTrainer::Train, through the shim (libsentencepiece cannot be linked here).
  EXPECT_THAT(TrainSentencePieceModel(absl::StrCat(
                  "--input=", input, " --model_prefix=", prefix, " --vocab_size=", vocab_size,
                  " --model_type=bpe --character_coverage=1.0 --byte_fallback=true "
                  "--minloglevel=2")),
              IsOk());
  return prefix + ".model";
}

std::string SampleText() {
  std::ifstream in(std::string(TESSERA_CORPUS_DIR) + "/kjv-genesis-ruth.txt");
  std::string text(20000, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  return text;
}

TEST(TokenizerTest, SentencePieceModelRoundTrips) {
  const std::string dir = TestDir();
  const std::string text = SampleText();
  ASSERT_GT(text.size(), 10000u);
  const std::string model = TrainSentencePiece(dir, text, 400);

  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadSentencePieceTokenizer(model);
  ASSERT_THAT(tokenizer, IsOk());
  EXPECT_EQ((*tokenizer)->vocab_size(), 400u);
  EXPECT_EQ((*tokenizer)->eos_id(), 2u);  // SentencePiece's default: <unk>=0, <s>=1, </s>=2

  const std::string sentence = "And God said, Let there be light: and there was light.";
  const std::vector<uint32_t> tokens = (*tokenizer)->Encode(sentence);
  EXPECT_LT(tokens.size(), sentence.size());  // merges happened
  for (uint32_t token : tokens) EXPECT_LT(token, 400u);
  EXPECT_EQ((*tokenizer)->Decode(tokens), sentence);

  // Characters the model never saw come back through byte fallback.
  const std::string unseen = "caf\xc3\xa9 \xe4\xb8\x96";
  EXPECT_EQ((*tokenizer)->Decode((*tokenizer)->Encode(unseen)), unseen);

  std::vector<uint32_t> with_eos = tokens;
  with_eos.push_back((*tokenizer)->eos_id());
  EXPECT_EQ((*tokenizer)->Decode(with_eos), sentence);
}

TEST(TokenizerTest, SentencePieceTrainingErrorsAreReported) {
  const std::string dir = TestDir();
  EXPECT_THAT(TrainSentencePieceModel("--input=" + dir + "/missing.txt --model_prefix=" + dir +
                                      "/m --vocab_size=100 --minloglevel=2"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("missing.txt")));
}

TEST(TokenizerTest, MissingSentencePieceModelIsNotFound) {
  const std::string path = TestDir() + "/missing.model";
  EXPECT_THAT(LoadSentencePieceTokenizer(path),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(path)));
}

TEST(TokenizerTest, GarbageSentencePieceModelIsInvalidArgument) {
  const std::string path = TestDir() + "/garbage.model";
  std::ofstream(path) << "this is not a protobuf";
  EXPECT_THAT(LoadSentencePieceTokenizer(path),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(path)));
}

}  // namespace
}  // namespace tessera::trainer
