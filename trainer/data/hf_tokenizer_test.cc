#include "trainer/data/hf_tokenizer.h"

#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/util/subprocess.h"
#include "tests/util/temp_dir.h"
#include "trainer/data/prepare.h"
#include "trainer/data/token_shard.h"

namespace tessera::trainer {
namespace {

namespace fs = std::filesystem;
using ::tessera::testing::IsOk;
using ::tessera::testing::RunCommand;
using ::tessera::testing::ScopedTempDir;
using ::tessera::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::SizeIs;

// Trains two small byte-level BPE tokenizers, as Llama 3 and Qwen build theirs (a ByteLevel
// pre-tokenizer and decoder, so every UTF-8 string encodes): llama/tokenizer.json with Llama 3's
// special tokens and a post-processor that prepends <|begin_of_text|> (which Encode must not
// add), and qwen/tokenizer.json with Qwen's <|im_end|> listed before <|endoftext|>.
constexpr char kMakeTokenizers[] = R"py(
import sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

corpus = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.",
    "### Instruction:\nAdd 2 and 3.\n\n### Response:\n5",
    "h\u00e9llo w\u00f6rld, \u4e16\u754c \U0001F30D caf\u00e9 na\u00efve",
] * 20

def train(specials, out):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    bos = specials[0]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=bos + " $A", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    tokenizer.save(out)

train(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"], sys.argv[1] + "/llama/tokenizer.json")
train(["<|im_start|>", "<|im_end|>", "<|endoftext|>"], sys.argv[1] + "/qwen/tokenizer.json")
)py";

// Python's answers for tokenizer argv[1] on the JSON list of strings in argv[2], as JSON in
// argv[3]: the ids of each (add_special_tokens=False), its decoding, and the tokenizer's facts.
constexpr char kReference[] = R"py(
import json, sys
from tokenizers import Tokenizer

tokenizer = Tokenizer.from_file(sys.argv[1])
texts = json.load(open(sys.argv[2], encoding="utf-8"))
ids = [tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
json.dump({
    "ids": ids,
    "with_specials": [tokenizer.encode(text).ids for text in texts],
    "decoded": [tokenizer.decode(i) for i in ids],
    "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
    "token_ids": {t: tokenizer.token_to_id(t) for t in
                  ["<|begin_of_text|>", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>"]},
}, open(sys.argv[3], "w", encoding="utf-8"))
)py";

std::string WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream(path, std::ios::binary) << contents;
  return path;
}

// The python that builds and checks the tests' tokenizers: $TESSERA_PYTHON, else this build's.
std::string TestPython() {
  if (const char* python = std::getenv(kTesseraPythonEnv); python != nullptr && *python != '\0') {
    return python;
  }
  return TESSERA_TEST_PYTHON;
}

HfTokenizerOptions WithPython(const std::string& python) {
  HfTokenizerOptions options;
  options.python = python;
  return options;
}

HfTokenizerOptions WithEos(const std::string& eos_token) {
  HfTokenizerOptions options;
  options.eos_token = eos_token;
  return options;
}

// Sets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name); old != nullptr) old_ = old;
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

class HfTokenizerTest : public ::testing::Test {
 protected:
  // Trains the tokenizers once for the suite; empty skip_reason_ when that worked.
  static void SetUpTestSuite() {
    dir_ = new ScopedTempDir("hf_tokenizer_test");
    fs::create_directories(dir_->path() + "/llama");
    fs::create_directories(dir_->path() + "/qwen");
    const std::string script = WriteFile(dir_->path() + "/make.py", kMakeTokenizers);
    absl::StatusOr<tessera::testing::RunResult> run =
        RunCommand({TestPython(), script, dir_->path()}, absl::Seconds(120));
    if (!run.ok()) {
      skip_reason_ = absl::StrCat(TestPython(), " does not run: ", run.status().ToString());
    } else if (run->exit.exit_code != 0) {
      skip_reason_ = absl::StrCat(TestPython(), " cannot build a tokenizer with `tokenizers` (",
                                  run->output, "); run scripts/bootstrap.sh");
    }
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (!skip_reason_.empty()) GTEST_SKIP() << skip_reason_;
  }

  static std::string Dir() { return dir_->path(); }
  static std::string LlamaJson() { return Dir() + "/llama/tokenizer.json"; }
  static std::string QwenJson() { return Dir() + "/qwen/tokenizer.json"; }

  // Python's encoding of `texts` with the tokenizer at `path` (kReference).
  static nlohmann::json Reference(const std::string& path, const std::vector<std::string>& texts) {
    const std::string script = WriteFile(Dir() + "/reference.py", kReference);
    const std::string input = WriteFile(Dir() + "/texts.json", nlohmann::json(texts).dump());
    const std::string output = Dir() + "/reference.json";
    absl::StatusOr<tessera::testing::RunResult> run =
        RunCommand({TestPython(), script, path, input, output}, absl::Seconds(120));
    EXPECT_THAT(run, IsOk());
    if (!run.ok()) return {};
    EXPECT_EQ(run->exit.exit_code, 0) << run->output;
    std::ifstream in(output);
    return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  }

 private:
  static ScopedTempDir* dir_;
  static std::string skip_reason_;
};

ScopedTempDir* HfTokenizerTest::dir_ = nullptr;
std::string HfTokenizerTest::skip_reason_;

const std::vector<std::string>& Texts() {
  static const std::vector<std::string>* const texts = new std::vector<std::string>{
      "In the beginning God created the heaven and the earth.",
      "### Instruction:\nAdd 2 and 3.\n\n### Response:\n",
      // héllo wörld, 世界 🌍
      "h\xc3\xa9llo w\xc3\xb6rld, \xe4\xb8\x96\xe7\x95\x8c \xf0\x9f\x8c\x8d",
      "Unseen words: \xce\xb1\xce\xb2\xce\xb3 \xd0\xb6\xd1\x83\xd0\xba qxzv\t\ttabs  and  spaces ",
      "a document<|end_of_text|>and the next",  // an added token's text encodes to that token
      "",
  };
  return *texts;
}

TEST_F(HfTokenizerTest, EncodeAndDecodeMatchPython) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadHfTokenizer(LlamaJson());
  ASSERT_THAT(tokenizer, IsOk());
  const nlohmann::json reference = Reference(LlamaJson(), Texts());
  ASSERT_TRUE(reference.is_object());
  const uint32_t bos = reference["token_ids"]["<|begin_of_text|>"];
  std::vector<std::string_view> views;
  for (size_t i = 0; i < Texts().size(); ++i) {
    SCOPED_TRACE(Texts()[i]);
    const std::vector<uint32_t> expected = reference["ids"][i];
    const std::vector<uint32_t> tokens = (*tokenizer)->Encode(Texts()[i]);
    EXPECT_EQ(tokens, expected);
    // Python's default adds <|begin_of_text|>; Encode does not.
    const std::vector<uint32_t> with_specials = reference["with_specials"][i];
    ASSERT_FALSE(with_specials.empty());
    EXPECT_EQ(with_specials[0], bos);
    if (!tokens.empty()) {
      EXPECT_NE(tokens[0], bos);
    }
    EXPECT_EQ((*tokenizer)->Decode(tokens), reference["decoded"][i].get<std::string>());
    views.push_back(Texts()[i]);
  }
  // A byte-level BPE decodes back to the text, less the special tokens.
  EXPECT_EQ((*tokenizer)->Decode((*tokenizer)->Encode(Texts()[2])), Texts()[2]);
  EXPECT_EQ((*tokenizer)->Decode((*tokenizer)->Encode(Texts()[4])), "a documentand the next");
  // One batch answers as the calls one by one do.
  const std::vector<std::vector<uint32_t>> batch = (*tokenizer)->EncodeBatch(views);
  ASSERT_THAT(batch, SizeIs(Texts().size()));
  for (size_t i = 0; i < batch.size(); ++i) {
    EXPECT_EQ(batch[i], reference["ids"][i].get<std::vector<uint32_t>>()) << Texts()[i];
  }
  EXPECT_THAT((*tokenizer)->status(), IsOk());
}

TEST_F(HfTokenizerTest, VocabSizeCountsAddedTokensAndEosIsEndOfText) {
  const nlohmann::json reference = Reference(LlamaJson(), {"x"});
  ASSERT_TRUE(reference.is_object());
  // The directory works as well as the file.
  EXPECT_TRUE(IsHfTokenizerPath(Dir() + "/llama"));
  EXPECT_TRUE(IsHfTokenizerPath("/anywhere/tokenizer.json"));
  EXPECT_FALSE(IsHfTokenizerPath(Dir()));
  EXPECT_FALSE(IsHfTokenizerPath("spm.model"));
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadHfTokenizer(Dir() + "/llama");
  ASSERT_THAT(tokenizer, IsOk());
  EXPECT_EQ((*tokenizer)->vocab_size(), reference["vocab_size"].get<uint32_t>());
  const uint32_t eos = reference["token_ids"]["<|end_of_text|>"];
  EXPECT_EQ((*tokenizer)->eos_id(), eos);
  EXPECT_LT(eos, (*tokenizer)->vocab_size());
  // eos and ids past the vocabulary decode to nothing.
  const std::vector<uint32_t> hello = (*tokenizer)->Encode("hello");
  std::vector<uint32_t> tokens = hello;
  tokens.push_back(eos);
  tokens.push_back((*tokenizer)->vocab_size() + 7);
  EXPECT_EQ((*tokenizer)->Decode(tokens), "hello");
}

TEST_F(HfTokenizerTest, EosPrefersThePretrainingTokenAndCanBeNamed) {
  const nlohmann::json reference = Reference(QwenJson(), {"x"});
  ASSERT_TRUE(reference.is_object());
  absl::StatusOr<std::unique_ptr<Tokenizer>> qwen = LoadHfTokenizer(QwenJson());
  ASSERT_THAT(qwen, IsOk());
  EXPECT_EQ((*qwen)->eos_id(), reference["token_ids"]["<|endoftext|>"].get<uint32_t>());

  absl::StatusOr<std::unique_ptr<Tokenizer>> im_end =
      LoadHfTokenizer(QwenJson(), WithEos("<|im_end|>"));
  ASSERT_THAT(im_end, IsOk());
  EXPECT_EQ((*im_end)->eos_id(), reference["token_ids"]["<|im_end|>"].get<uint32_t>());

  EXPECT_THAT(LoadHfTokenizer(QwenJson(), WithEos("<|nope|>")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(QwenJson()), HasSubstr("<|nope|>"))));
}

TEST_F(HfTokenizerTest, RequestsFromSeveralThreadsGetTheirOwnAnswers) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadHfTokenizer(LlamaJson());
  ASSERT_THAT(tokenizer, IsOk());
  std::vector<std::vector<uint32_t>> expected;
  for (const std::string& text : Texts()) expected.push_back((*tokenizer)->Encode(text));
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 50; ++round) {
        const size_t i = (t + round) % Texts().size();
        if ((*tokenizer)->Encode(Texts()[i]) != expected[i]) ++mismatches[t];
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_THAT(mismatches, ::testing::Each(0));
}

TEST_F(HfTokenizerTest, ErrorsNameThePathAndTheFix) {
  EXPECT_THAT(LoadHfTokenizer(Dir() + "/missing/tokenizer.json"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(Dir() + "/missing/tokenizer.json")));

  const std::string garbage = Dir() + "/garbage/tokenizer.json";
  fs::create_directories(Dir() + "/garbage");
  WriteFile(garbage, "this is not a tokenizer\n");
  EXPECT_THAT(LoadHfTokenizer(garbage),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(garbage), HasSubstr("not a Hugging Face tokenizer.json"))));

  {
    const ScopedEnv bad_python(kTesseraPythonEnv, "/nonexistent/python3");
    EXPECT_THAT(LoadHfTokenizer(LlamaJson()),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         AllOf(HasSubstr("/nonexistent/python3"), HasSubstr("TESSERA_PYTHON"),
                               HasSubstr("scripts/bootstrap.sh"))));
  }

  // A python without `tokenizers`: a module of that name that fails to import shadows it.
  fs::create_directories(Dir() + "/shadow");
  WriteFile(Dir() + "/shadow/tokenizers.py", "raise ImportError('no tokenizers here')\n");
  const std::string wrapper = WriteFile(
      Dir() + "/python-without-tokenizers",
      absl::StrCat("#!/bin/sh\nPYTHONPATH=", Dir(), "/shadow exec ", TestPython(), " \"$@\"\n"));
  fs::permissions(wrapper, fs::perms::owner_all);
  EXPECT_THAT(LoadHfTokenizer(LlamaJson(), WithPython(wrapper)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("no tokenizers here"), HasSubstr("TESSERA_PYTHON"))));

  // Text that is not UTF-8 fails, and the failure sticks.
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadHfTokenizer(LlamaJson());
  ASSERT_THAT(tokenizer, IsOk());
  EXPECT_THAT((*tokenizer)->Encode("bad \xff\xfe bytes"), SizeIs(0));
  EXPECT_THAT((*tokenizer)->status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(LlamaJson()), HasSubstr("UnicodeDecodeError"))));
  EXPECT_THAT((*tokenizer)->Encode("hello"), SizeIs(0));

  // A python that exits at once.
  EXPECT_THAT(LoadHfTokenizer(LlamaJson(), WithPython("/bin/false")),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("scripts/bootstrap.sh")));
}

// The prepare step with a tokenizer.json: an Alpaca record's prompt, response and eos are
// python's own ids, with the prompt masked.
TEST_F(HfTokenizerTest, PrepareWritesPythonsIds) {
  constexpr char kPrompt[] =
      "Below is an instruction that describes a task. Write a response that appropriately "
      "completes the request.\n\n### Instruction:\nGreet the w\xc3\xb6rld.\n\n### Response:\n";
  constexpr char kResponse[] = "h\xc3\xa9llo, \xe4\xb8\x96\xe7\x95\x8c \xf0\x9f\x8c\x8d";
  const nlohmann::json reference = Reference(LlamaJson(), {kPrompt, kResponse, "a whole doc"});
  ASSERT_TRUE(reference.is_object());
  const std::string dir = Dir() + "/prepare";
  fs::create_directories(dir);
  PrepareOptions options;
  options.inputs = {WriteFile(
      dir + "/alpaca.jsonl", absl::StrCat(nlohmann::json{{"instruction", "Greet the w\xc3\xb6rld."},
                                                         {"input", ""},
                                                         {"output", kResponse}}
                                              .dump(),
                                          "\n{\"text\": \"a whole doc\"}\n"))};
  options.output_dir = dir + "/out";
  options.tokenizer = Dir() + "/llama";  // the directory
  options.val_fraction = 0;
  absl::StatusOr<PrepareResult> result = PrepareData(options);
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->vocab_size, reference["vocab_size"].get<uint32_t>());
  ASSERT_THAT(result->train_shards, SizeIs(1));

  const uint32_t eos = reference["token_ids"]["<|end_of_text|>"];
  std::vector<uint32_t> expected;
  std::vector<uint8_t> expected_mask;
  const auto append = [&](const nlohmann::json& ids, uint8_t counted) {
    for (uint32_t id : ids.get<std::vector<uint32_t>>()) {
      expected.push_back(id);
      expected_mask.push_back(counted);
    }
  };
  append(reference["ids"][0], 0);
  append(reference["ids"][1], 1);
  append(nlohmann::json::array({eos}), 1);
  append(reference["ids"][2], 1);
  append(nlohmann::json::array({eos}), 1);

  absl::StatusOr<TokenShard> shard = TokenShard::Open(result->train_shards[0]);
  ASSERT_THAT(shard, IsOk());
  ASSERT_TRUE(shard->has_loss_mask());
  std::vector<uint32_t> tokens;
  for (uint64_t i = 0; i < shard->size(); ++i) tokens.push_back(shard->token(i));
  std::vector<uint8_t> mask(shard->size());
  shard->ReadLossMask(0, shard->size(), mask.data());
  EXPECT_EQ(tokens, expected);
  EXPECT_EQ(mask, expected_mask);

  // An eos_token for another kind of tokenizer is an error, as is a broken tokenizer.json.
  options.tokenizer = "byte";
  options.eos_token = "<|im_end|>";
  EXPECT_THAT(PrepareData(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("eos_token")));
  options.tokenizer = Dir() + "/missing/tokenizer.json";
  options.eos_token.clear();
  EXPECT_THAT(PrepareData(options), StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing")));
}

}  // namespace
}  // namespace tessera::trainer
