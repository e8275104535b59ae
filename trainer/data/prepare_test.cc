#include "trainer/data/prepare.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"
#include "trainer/data/data_loader.h"
#include "trainer/data/token_shard.h"
#include "trainer/data/tokenizer.h"

namespace tessera::trainer {
namespace {

namespace fs = std::filesystem;
using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::tessera::testing::TestDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::SizeIs;

constexpr uint32_t kEos = 256;

std::string WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream(path, std::ios::binary) << contents;
  return path;
}

std::vector<uint32_t> Bytes(const std::string& text) {
  return std::vector<uint32_t>(reinterpret_cast<const unsigned char*>(text.data()),
                               reinterpret_cast<const unsigned char*>(text.data()) + text.size());
}

// The tokens of `paths`, concatenated.
std::vector<uint32_t> ReadShards(const std::vector<std::string>& paths) {
  std::vector<uint32_t> tokens;
  for (const std::string& path : paths) {
    absl::StatusOr<TokenShard> shard = TokenShard::Open(path);
    EXPECT_THAT(shard, IsOk());
    if (!shard.ok()) continue;
    for (uint64_t i = 0; i < shard->size(); ++i) tokens.push_back(shard->token(i));
  }
  return tokens;
}

TEST(PrepareTest, TextFilesAreDocumentsEndedByEos) {
  const std::string dir = TestDir();
  const std::string a = "hello world\n";
  const std::string b = "h\xc3\xa9llo";
  PrepareOptions options;
  options.inputs = {WriteFile(dir + "/a.txt", a), WriteFile(dir + "/b.txt", b)};
  options.output_dir = dir + "/out";
  options.val_fraction = 0;
  absl::StatusOr<PrepareResult> result = PrepareData(options);
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->vocab_size, 257u);
  EXPECT_EQ(result->train_tokens, a.size() + b.size() + 2);
  EXPECT_EQ(result->val_tokens, 0u);
  EXPECT_THAT(result->train_shards, ElementsAre(dir + "/out/train-00000.bin"));
  EXPECT_THAT(result->val_shards, SizeIs(0));
  std::vector<uint32_t> expected = Bytes(a);
  expected.push_back(kEos);
  for (uint32_t t : Bytes(b)) expected.push_back(t);
  expected.push_back(kEos);
  EXPECT_EQ(ReadShards(result->train_shards), expected);
}

TEST(PrepareTest, SplitsValidationFromTheEndAndCutsShards) {
  const std::string dir = TestDir();
  std::string text;
  for (int i = 0; i < 1000; ++i) text.push_back(static_cast<char>('a' + i % 26));
  PrepareOptions options;
  options.inputs = {WriteFile(dir + "/corpus.txt", text)};
  options.output_dir = dir + "/out";
  options.val_fraction = 0.1;
  options.tokens_per_shard = 300;
  // A shard of an earlier, larger run: must not survive into this run's glob.
  fs::create_directories(dir + "/out");
  WriteFile(dir + "/out/train-00009.bin", "stale");
  WriteFile(dir + "/out/notes.txt", "kept");

  absl::StatusOr<PrepareResult> result = PrepareData(options);
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->val_tokens, 100u);  // round(1001 * 0.1)
  EXPECT_EQ(result->train_tokens, 901u);
  EXPECT_THAT(result->train_shards,
              ElementsAre(dir + "/out/train-00000.bin", dir + "/out/train-00001.bin",
                          dir + "/out/train-00002.bin", dir + "/out/train-00003.bin"));
  EXPECT_THAT(result->val_shards, ElementsAre(dir + "/out/val-00000.bin"));
  EXPECT_FALSE(fs::exists(dir + "/out/train-00009.bin"));
  EXPECT_TRUE(fs::exists(dir + "/out/notes.txt"));

  std::vector<uint32_t> expected = Bytes(text);
  expected.push_back(kEos);
  std::vector<uint32_t> train = ReadShards(result->train_shards);
  const std::vector<uint32_t> val = ReadShards(result->val_shards);
  EXPECT_EQ(train.size(), 901u);
  train.insert(train.end(), val.begin(), val.end());
  EXPECT_EQ(train, expected);
}

TEST(PrepareTest, JsonlRecordsBecomeDocuments) {
  const std::string dir = TestDir();
  PrepareOptions options;
  options.inputs = {WriteFile(dir + "/sft.jsonl",
                              "{\"text\": \"plain\"}\n"
                              "{\"instruction\": \"Q?\", \"response\": \"A.\"}\n"
                              "\n"
                              "{\"prompt\": \"P\", \"completion\": \"C\", \"id\": 3}\n")};
  options.output_dir = dir + "/out";
  options.val_fraction = 0;
  absl::StatusOr<PrepareResult> result = PrepareData(options);
  ASSERT_THAT(result, IsOk());
  const std::unique_ptr<Tokenizer> bytes = MakeByteTokenizer();
  const std::vector<uint32_t> tokens = ReadShards(result->train_shards);
  EXPECT_EQ(bytes->Decode(tokens), "plainQ?\n\nA.P\n\nC");
  EXPECT_EQ(std::count(tokens.begin(), tokens.end(), kEos), 3);
  EXPECT_EQ(tokens.back(), kEos);
}

// The tokens and loss mask of one shard.
struct MaskedShard {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> mask;
  uint64_t sample_tokens = 0;
  // Empty when the shard has none.
  std::vector<uint8_t> record_starts;
};

MaskedShard ReadMaskedShard(const std::string& path) {
  MaskedShard out;
  absl::StatusOr<TokenShard> shard = TokenShard::Open(path);
  EXPECT_THAT(shard, IsOk());
  if (!shard.ok()) return out;
  EXPECT_TRUE(shard->has_loss_mask()) << path;
  EXPECT_EQ(shard->version(), 2u);
  out.sample_tokens = shard->sample_tokens();
  out.mask.resize(shard->size());
  shard->ReadLossMask(0, shard->size(), out.mask.data());
  for (uint64_t i = 0; i < shard->size(); ++i) out.tokens.push_back(shard->token(i));
  if (shard->has_record_starts()) {
    out.record_starts.resize(shard->size());
    shard->ReadRecordStarts(0, shard->size(), out.record_starts.data());
  }
  return out;
}

// `text`'s bytes, each with `counted` as its mask.
void AppendText(MaskedShard& shard, const std::string& text, uint8_t counted) {
  for (uint32_t t : Bytes(text)) {
    shard.tokens.push_back(t);
    shard.mask.push_back(counted);
  }
}

void AppendEos(MaskedShard& shard, uint8_t counted = 1) {
  shard.tokens.push_back(kEos);
  shard.mask.push_back(counted);
}

constexpr char kAlpacaNoInput[] =
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\nAdd 2 and 3.\n\n### Response:\n";
constexpr char kAlpacaWithInput[] =
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\nTranslate.\n\n### Input:\nbonjour\n\n### Response:\n";

TEST(PrepareTest, AlpacaRecordsMaskThePromptAndCountTheResponseAndEos) {
  const std::string dir = TestDir();
  PrepareOptions options;
  options.inputs = {WriteFile(dir + "/alpaca.jsonl",
                              "{\"instruction\": \"Add 2 and 3.\", \"input\": \"\", \"output\": \"5\"}\n"
                              "{\"instruction\": \"Translate.\", \"input\": \"bonjour\", "
                              "\"output\": \"hello\"}\n"
                              "{\"text\": \"doc\"}\n")};
  options.output_dir = dir + "/out";
  options.val_fraction = 0;
  absl::StatusOr<PrepareResult> result = PrepareData(options);
  ASSERT_THAT(result, IsOk());
  EXPECT_TRUE(result->loss_mask);
  EXPECT_EQ(result->records, 3u);
  ASSERT_THAT(result->train_shards, SizeIs(1));
  MaskedShard expected;
  AppendText(expected, kAlpacaNoInput, 0);
  AppendText(expected, "5", 1);
  AppendEos(expected);
  AppendText(expected, kAlpacaWithInput, 0);
  AppendText(expected, "hello", 1);
  AppendEos(expected);
  AppendText(expected, "doc", 1);  // a plain document counts whole
  AppendEos(expected);
  const MaskedShard shard = ReadMaskedShard(result->train_shards[0]);
  EXPECT_EQ(shard.tokens, expected.tokens);
  EXPECT_EQ(shard.mask, expected.mask);
  EXPECT_EQ(shard.sample_tokens, 0u);
  // Spelled out: the template's last token ("\n" after "### Response:") does not count, the
  // response's first token does.
  const size_t first_response = std::string(kAlpacaNoInput).size();
  EXPECT_EQ(shard.tokens[first_response - 1], '\n');
  EXPECT_EQ(shard.mask[first_response - 1], 0);
  EXPECT_EQ(shard.tokens[first_response], '5');
  EXPECT_EQ(shard.mask[first_response], 1);
}

TEST(PrepareTest, ChatRecordsCountOnlyTheAssistantReplies) {
  const std::string dir = TestDir();
  PrepareOptions options;
  options.inputs = {WriteFile(
      dir + "/chat.jsonl",
      "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, "
      "{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Hey\"}, "
      "{\"role\": \"user\", \"content\": \"Bye\"}, {\"role\": \"assistant\", \"content\": \"Ok\"}]}\n"
      "{\"instruction\": \"Q\", \"output\": \"A\"}\n")};
  options.output_dir = dir + "/out";
  options.val_fraction = 0;
  options.prompt_template = "chat";
  absl::StatusOr<PrepareResult> result = PrepareData(options);
  ASSERT_THAT(result, IsOk());
  MaskedShard expected;
  AppendText(expected, "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n", 0);
  AppendText(expected, "Hey", 1);
  AppendEos(expected);
  AppendText(expected, "<|user|>\nBye\n<|assistant|>\n", 0);
  AppendText(expected, "Ok", 1);
  AppendEos(expected);
  // An Alpaca record under the chat template.
  AppendText(expected, "<|user|>\nQ\n<|assistant|>\n", 0);
  AppendText(expected, "A", 1);
  AppendEos(expected);
  const MaskedShard shard = ReadMaskedShard(result->train_shards.at(0));
  EXPECT_EQ(shard.tokens, expected.tokens);
  EXPECT_EQ(shard.mask, expected.mask);
}

TEST(PrepareTest, BadChatRecordsNameFileLineAndMessage) {
  const std::string dir = TestDir();
  PrepareOptions options;
  options.output_dir = dir + "/out";
  options.inputs = {WriteFile(dir + "/chat.jsonl",
                              "{\"messages\": [{\"role\": \"robot\", \"content\": \"x\"}]}\n")};
  EXPECT_THAT(PrepareData(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(dir + "/chat.jsonl:1: messages[0]: role \"robot\"")));
  options.inputs = {WriteFile(dir + "/chat.jsonl",
                              "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}\n")};
  EXPECT_THAT(PrepareData(options), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("no \"assistant\" message")));
  options.prompt_template = "vicuna";
  EXPECT_THAT(PrepareData(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("prompt_template")));
}

// One sample of seq_len + 1 tokens per record: padded with uncounted eos, truncated, or dropped
// when truncation leaves no response; the shards record the sample size and the loader keeps
// prompt targets out of the loss.
TEST(PrepareTest, SampleSeqLenPadsTruncatesAndDrops) {
  const std::string dir = TestDir();
  PrepareOptions options;
  options.inputs = {WriteFile(dir + "/pairs.jsonl",
                              "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, "
                              "{\"role\": \"assistant\", \"content\": \"b\"}]}\n"
                              "{\"messages\": [{\"role\": \"user\", \"content\": \"c\"}, "
                              "{\"role\": \"assistant\", \"content\": \"0123456789abcdef\"}]}\n"
                              "{\"messages\": [{\"role\": \"user\", \"content\": "
                              "\"a prompt longer than the whole sample\"}, "
                              "{\"role\": \"assistant\", \"content\": \"lost\"}]}\n")};
  options.output_dir = dir + "/out";
  options.val_fraction = 0;
  options.seq_len = 27;  // samples of 28 tokens; "<|user|>\nc\n<|assistant|>\n" is 25
  absl::StatusOr<PrepareResult> result = PrepareData(options);
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->records, 2u);
  EXPECT_EQ(result->dropped_records, 1u);
  EXPECT_EQ(result->train_tokens, 56u);
  MaskedShard expected;
  AppendText(expected, "<|user|>\na\n<|assistant|>\n", 0);
  AppendText(expected, "b", 1);
  AppendEos(expected);
  while (expected.tokens.size() < 28) AppendEos(expected, 0);
  AppendText(expected, "<|user|>\nc\n<|assistant|>\n", 0);
  AppendText(expected, "012", 1);
  const MaskedShard shard = ReadMaskedShard(result->train_shards.at(0));
  EXPECT_EQ(shard.sample_tokens, 28u);
  EXPECT_EQ(shard.tokens, expected.tokens);
  EXPECT_EQ(shard.mask, expected.mask);

  // Through the loader: sample 0's targets are kIgnoreTarget up to the response.
  absl::StatusOr<TokenDataset> dataset = TokenDataset::Open(result->train_shards, 27);
  ASSERT_THAT(dataset, IsOk());
  ASSERT_TRUE(dataset->has_loss_mask());
  ASSERT_EQ(dataset->num_samples(), 2);
  std::vector<int64_t> inputs(27), targets(27);
  EXPECT_EQ(dataset->ReadExample(0, inputs.data(), targets.data()), 2);  // "b" and eos
  EXPECT_EQ(dataset->CountLossTargets(0), 2);
  const size_t prompt = std::string("<|user|>\na\n<|assistant|>\n").size();
  for (size_t i = 0; i + 1 < prompt; ++i) EXPECT_EQ(targets[i], kIgnoreTarget) << i;
  EXPECT_EQ(targets[prompt - 1], 'b');
  EXPECT_EQ(inputs[prompt - 1], '\n');  // inputs are never masked
  EXPECT_EQ(targets[prompt], kEos);
  for (size_t i = prompt + 1; i < 27; ++i) EXPECT_EQ(targets[i], kIgnoreTarget) << i;
  // Another seq_len would cut samples across records: refused by name.
  EXPECT_THAT(TokenDataset::Open(result->train_shards, 31),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("prepared with --seq_len=27) but seq_len is 31")));
}

TEST(PrepareTest, PackPutsShortRecordsInOneSample) {
  const std::string dir = TestDir();
  PrepareOptions options;
  options.inputs = {WriteFile(dir + "/pairs.jsonl",
                              "{\"instruction\": \"x\", \"output\": \"1\"}\n"
                              "{\"text\": \"ab\"}\n"
                              "{\"text\": \"cd\"}\n"
                              "{\"text\": \"efghij\"}\n")};
  options.output_dir = dir + "/out";
  options.val_fraction = 0.5;
  options.seq_len = 7;  // samples of 8
  options.pack = true;
  // The Alpaca record is longer than a sample: truncated, it is all prompt and dropped.
  absl::StatusOr<PrepareResult> result = PrepareData(options);
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->dropped_records, 1u);
  // "ab<eos>cd<eos>" + 2 pad, then "efghij<eos>" + 1 pad; the second sample is validation.
  EXPECT_EQ(result->train_tokens, 8u);
  EXPECT_EQ(result->val_tokens, 8u);
  MaskedShard train;
  AppendText(train, "ab", 1);
  AppendEos(train);
  AppendText(train, "cd", 1);
  AppendEos(train);
  AppendEos(train, 0);
  AppendEos(train, 0);
  const MaskedShard shard = ReadMaskedShard(result->train_shards.at(0));
  EXPECT_EQ(shard.tokens, train.tokens);
  EXPECT_EQ(shard.mask, train.mask);
  // Each record's first token is marked, so that training keeps the records apart.
  EXPECT_TRUE(result->record_starts);
  EXPECT_EQ(shard.record_starts, (std::vector<uint8_t>{1, 0, 0, 1, 0, 0, 0, 0}));
  const MaskedShard val = ReadMaskedShard(result->val_shards.at(0));
  EXPECT_EQ(val.mask, (std::vector<uint8_t>{1, 1, 1, 1, 1, 1, 1, 0}));
  EXPECT_EQ(val.record_starts, (std::vector<uint8_t>{1, 0, 0, 0, 0, 0, 0, 0}));
  // Without packing a sample is one record, and nothing is marked.
  options.pack = false;
  result = PrepareData(options);
  ASSERT_THAT(result, IsOk());
  EXPECT_FALSE(result->record_starts);
  EXPECT_TRUE(ReadMaskedShard(result->train_shards.at(0)).record_starts.empty());
  options.pack = true;
  options.seq_len = 0;
  EXPECT_THAT(PrepareData(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pack needs seq_len")));
}

TEST(PrepareTest, MalformedJsonlNamesFileAndLine) {
  const std::string dir = TestDir();
  PrepareOptions options;
  options.output_dir = dir + "/out";
  options.inputs = {WriteFile(dir + "/bad.jsonl",
                              "{\"text\": \"fine\"}\n{\"text\": \"fine\"}\n{\"text\": broken\n")};
  EXPECT_THAT(PrepareData(options), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr(dir + "/bad.jsonl:3: malformed JSON")));
  options.inputs = {WriteFile(dir + "/fields.jsonl", "{\"text\": \"fine\"}\n{\"title\": \"x\"}\n")};
  EXPECT_THAT(PrepareData(options), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr(dir + "/fields.jsonl:2: expected")));
  options.inputs = {WriteFile(dir + "/type.jsonl", "{\"text\": 5}\n")};
  EXPECT_THAT(PrepareData(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(dir + "/type.jsonl:1: field \"text\" is not a string")));
  // A .txt file holding JSON is text when format is auto, JSONL when asked.
  options.inputs = {WriteFile(dir + "/records.txt", "{\"text\": broken\n")};
  EXPECT_THAT(PrepareData(options), IsOk());
  options.format = "jsonl";
  EXPECT_THAT(PrepareData(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(dir + "/records.txt:1")));
}

TEST(PrepareTest, BadOptionsNameTheOption) {
  const std::string dir = TestDir();
  PrepareOptions options;
  options.output_dir = dir + "/out";
  options.inputs = {dir + "/missing.txt"};
  EXPECT_THAT(PrepareData(options),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(dir + "/missing.txt")));
  options.inputs = {WriteFile(dir + "/a.txt", "text")};
  options.tokenizer = dir + "/missing.model";
  EXPECT_THAT(PrepareData(options),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(dir + "/missing.model")));
  options.tokenizer = "byte";
  options.format = "csv";
  EXPECT_THAT(PrepareData(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("format")));
  options.format = "auto";
  options.val_fraction = 1.0;
  EXPECT_THAT(PrepareData(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("val_fraction")));
  options.val_fraction = 0.05;
  options.inputs = {WriteFile(dir + "/empty.txt", "")};
  EXPECT_THAT(PrepareData(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no text")));
}

TEST(PrepareTest, SentencePieceTokenizerEncodesDocuments) {
  const std::string dir = TestDir();
  std::ifstream in(std::string(TESSERA_CORPUS_DIR) + "/kjv-genesis-ruth.txt");
  std::string sample(30000, '\0');
  in.read(sample.data(), static_cast<std::streamsize>(sample.size()));
  const std::string train_text = WriteFile(dir + "/spm_train.txt", sample);
  ASSERT_THAT(TrainSentencePieceModel("--input=" + train_text + " --model_prefix=" + dir +
                                      "/spm --vocab_size=400 --model_type=bpe --minloglevel=2 "
                                      // Keep newlines: no whitespace folding, bytes for "\n".
                                      "--normalization_rule_name=identity "
                                      "--remove_extra_whitespaces=false --byte_fallback=true"),
              IsOk());
  PrepareOptions options;
  options.inputs = {
      WriteFile(dir + "/a.txt", "In the beginning God created the heaven."),
      WriteFile(dir + "/b.jsonl", "{\"prompt\": \"Who\", \"completion\": \"Moses\"}\n")};
  options.output_dir = dir + "/out";
  options.tokenizer = dir + "/spm.model";
  options.val_fraction = 0;
  absl::StatusOr<PrepareResult> result = PrepareData(options);
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->vocab_size, 400u);
  const std::vector<uint32_t> tokens = ReadShards(result->train_shards);
  ASSERT_EQ(tokens.size(), result->train_tokens);
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
      LoadSentencePieceTokenizer(dir + "/spm.model");
  ASSERT_THAT(tokenizer, IsOk());
  const uint32_t eos = (*tokenizer)->eos_id();
  ASSERT_EQ(std::count(tokens.begin(), tokens.end(), eos), 2);
  const auto first_eos = std::find(tokens.begin(), tokens.end(), eos);
  EXPECT_EQ((*tokenizer)->Decode(std::vector<uint32_t>(tokens.begin(), first_eos)),
            "In the beginning God created the heaven.");
  EXPECT_EQ((*tokenizer)->Decode(std::vector<uint32_t>(first_eos + 1, tokens.end())),
            "Who\n\nMoses");
}

TEST(PrepareTest, BundledCorpusPreparesWithTheByteTokenizer) {
  const std::string corpus = std::string(TESSERA_CORPUS_DIR) + "/kjv-genesis-ruth.txt";
  ASSERT_TRUE(fs::exists(corpus)) << corpus;
  const uint64_t bytes = fs::file_size(corpus);
  EXPECT_GT(bytes, 500'000u);
  EXPECT_LT(bytes, 2'000'000u);

  const std::string dir = TestDir();
  PrepareOptions options;
  options.inputs = {corpus};
  options.output_dir = dir + "/out";
  options.tokens_per_shard = 1 << 18;
  absl::StatusOr<PrepareResult> result = PrepareData(options);
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->train_tokens + result->val_tokens, bytes + 1);  // one document, one eos
  EXPECT_NEAR(static_cast<double>(result->val_tokens), 0.05 * static_cast<double>(bytes), 1.0);
  EXPECT_EQ(result->train_shards.size(), (result->train_tokens + (1 << 18) - 1) / (1 << 18));
  EXPECT_THAT(result->val_shards, SizeIs(1));

  absl::StatusOr<TokenDataset> train = TokenDataset::Open({dir + "/out/train-*.bin"}, 256);
  ASSERT_THAT(train, IsOk());
  EXPECT_EQ(train->vocab_size(), 257u);
  std::vector<int64_t> window(257);
  train->ReadSample(0, window.data());
  std::string head;
  for (int64_t t : window) head.push_back(static_cast<char>(t));
  EXPECT_TRUE(head.starts_with("The Holy Bible, King James Version")) << head;
  absl::StatusOr<TokenDataset> val =
      TokenDataset::Open({dir + "/out/val-*.bin"}, 256, "data.val_shards");
  ASSERT_THAT(val, IsOk());
  EXPECT_GT(val->num_samples(), 100);
}

}  // namespace
}  // namespace tessera::trainer
