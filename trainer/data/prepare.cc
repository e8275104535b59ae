#include "trainer/data/prepare.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <span>
#include <sstream>
#include <string_view>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "trainer/data/hf_tokenizer.h"
#include "trainer/data/token_shard.h"
#include "trainer/data/tokenizer.h"

namespace tessera::trainer {
namespace {

namespace fs = std::filesystem;

enum class InputFormat { kText, kJsonl };

absl::StatusOr<InputFormat> FormatOf(const std::string& path, const std::string& format) {
  if (format == "text") return InputFormat::kText;
  if (format == "jsonl") return InputFormat::kJsonl;
  if (format != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("format must be \"text\", \"jsonl\" or \"auto\" (got \"", format, "\")"));
  }
  const std::string extension = fs::path(path).extension().string();
  return extension == ".jsonl" || extension == ".ndjson" ? InputFormat::kJsonl : InputFormat::kText;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> MakeTokenizer(const PrepareOptions& options) {
  const std::string& name = options.tokenizer;
  if (name == "byte") return MakeByteTokenizer();
  if (IsHfTokenizerPath(name)) {
    HfTokenizerOptions hf_options;
    hf_options.eos_token = options.eos_token;
    return LoadHfTokenizer(name, hf_options);
  }
  return LoadSentencePieceTokenizer(name);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::error_code error;
  if (!fs::exists(path, error)) {
    return absl::NotFoundError(absl::StrCat(path, ": no such input file"));
  }
  std::ifstream in(path, std::ios::binary);
  std::ostringstream contents;
  contents << in.rdbuf();
  if (!in.good() && !in.eof()) {
    return absl::InternalError(absl::StrCat(path, ": cannot read"));
  }
  return std::move(contents).str();
}

// The string field `key` of `record`, if present. An error names where it is not a string.
absl::StatusOr<const std::string*> StringField(const nlohmann::json& record, const char* key,
                                               const std::string& where) {
  const auto it = record.find(key);
  if (it == record.end()) return nullptr;
  if (!it->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": field \"", key, "\" is not a string"));
  }
  return &it->get_ref<const std::string&>();
}

// One record: first its text segments as the input format lays them out, then, once a batch of
// records is tokenized (TokenizeExamples), its tokens and, per token, whether its loss is taken
// (1) or not (0).
struct Example {
  struct Segment {
    std::string text;
    uint8_t counted = 1;
    // The end-of-sequence token instead of text (counted); with `if_tokens`, only when the
    // segments before it produced a token.
    bool eos = false;
    bool if_tokens = false;
  };
  std::vector<Segment> segments;
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> mask;

  void Append(std::string_view text, uint8_t counted) {
    if (!text.empty()) segments.push_back({.text = std::string(text), .counted = counted});
  }
  void AppendEos() { segments.push_back({.eos = true}); }
  // The end-of-sequence token unless the record turned out to hold no token at all.
  void AppendEosIfTokens() { segments.push_back({.eos = true, .if_tokens = true}); }
};

// Tokenizes the segments of `examples` with one EncodeBatch call (one round trip to a Hugging
// Face tokenizer's process for the whole batch, not one per segment) and fills their tokens and
// masks.
void TokenizeExamples(const Tokenizer& tokenizer, std::span<Example> examples) {
  std::vector<std::string_view> texts;
  for (const Example& example : examples) {
    for (const Example::Segment& segment : example.segments) {
      if (!segment.eos) texts.push_back(segment.text);
    }
  }
  const std::vector<std::vector<uint32_t>> encoded =
      texts.empty() ? std::vector<std::vector<uint32_t>>() : tokenizer.EncodeBatch(texts);
  size_t next = 0;
  for (Example& example : examples) {
    for (const Example::Segment& segment : example.segments) {
      if (segment.eos) {
        if (segment.if_tokens && example.tokens.empty()) continue;
        example.tokens.push_back(tokenizer.eos_id());
        example.mask.push_back(1);
        continue;
      }
      if (next >= encoded.size()) return;  // a failed tokenizer; its status() says why
      const std::vector<uint32_t>& tokens = encoded[next++];
      example.tokens.insert(example.tokens.end(), tokens.begin(), tokens.end());
      example.mask.insert(example.mask.end(), tokens.size(), segment.counted);
    }
    example.segments.clear();
  }
}

// Records tokenized per EncodeBatch call.
constexpr size_t kRecordsPerBatch = 512;

constexpr char kAlpacaPromptWithInput[] =
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n";
constexpr char kAlpacaPromptNoInput[] =
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n";

struct ChatMessage {
  std::string role;
  std::string content;
};

// The chat template (PrepareOptions::prompt_template).
void RenderChat(const std::vector<ChatMessage>& messages, Example& example) {
  for (const ChatMessage& message : messages) {
    if (message.role == "assistant") {
      example.Append("<|assistant|>\n", 0);
      example.Append(message.content, 1);
      example.AppendEos();
    } else {
      example.Append(absl::StrCat("<|", message.role, "|>\n", message.content, "\n"), 0);
    }
  }
}

std::string Substitute(std::string text, std::string_view key, std::string_view value) {
  const size_t at = text.find(key);
  if (at != std::string::npos) text.replace(at, key.size(), value);
  return text;
}

absl::StatusOr<std::vector<ChatMessage>> ChatMessages(const nlohmann::json& messages,
                                                      const std::string& where) {
  if (!messages.is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": field \"messages\" is not an array"));
  }
  std::vector<ChatMessage> out;
  bool has_reply = false;
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string at = absl::StrCat(where, ": messages[", i, "]");
    if (!messages[i].is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(at, ": expected a JSON object"));
    }
    ASSIGN_OR_RETURN(const std::string* role, StringField(messages[i], "role", at));
    ASSIGN_OR_RETURN(const std::string* content, StringField(messages[i], "content", at));
    if (role == nullptr || content == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ": expected string fields \"role\" and \"content\""));
    }
    if (*role != "system" && *role != "user" && *role != "assistant") {
      return absl::InvalidArgumentError(absl::StrCat(
          at, ": role \"", *role, "\" is not \"system\", \"user\" or \"assistant\""));
    }
    has_reply = has_reply || *role == "assistant";
    out.push_back({*role, *content});
  }
  if (!has_reply) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": \"messages\" has no \"assistant\" message to learn from"));
  }
  return out;
}

// The example of one JSONL record (see PrepareOptions::format).
absl::StatusOr<Example> JsonlExample(std::string_view line, const std::string& where,
                                     const std::string& prompt_template) {
  nlohmann::json record;
  try {
    record = nlohmann::json::parse(line);
  } catch (const nlohmann::json::parse_error& e) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": malformed JSON: ", e.what()));
  }
  if (!record.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": expected a JSON object"));
  }
  Example example;
  if (const auto messages = record.find("messages"); messages != record.end()) {
    ASSIGN_OR_RETURN(const std::vector<ChatMessage> chat, ChatMessages(*messages, where));
    RenderChat(chat, example);
    return example;
  }
  ASSIGN_OR_RETURN(const std::string* text, StringField(record, "text", where));
  if (text != nullptr) {
    example.Append(*text, 1);
    example.AppendEosIfTokens();
    return example;
  }
  ASSIGN_OR_RETURN(const std::string* instruction, StringField(record, "instruction", where));
  ASSIGN_OR_RETURN(const std::string* output, StringField(record, "output", where));
  if (instruction != nullptr && output != nullptr) {
    ASSIGN_OR_RETURN(const std::string* input, StringField(record, "input", where));
    const bool has_input = input != nullptr && !input->empty();
    if (prompt_template == "chat") {
      RenderChat({{"user", has_input ? absl::StrCat(*instruction, "\n\n", *input) : *instruction},
                  {"assistant", *output}},
                 example);
      return example;
    }
    std::string prompt = Substitute(has_input ? kAlpacaPromptWithInput : kAlpacaPromptNoInput,
                                    "{instruction}", *instruction);
    if (has_input) prompt = Substitute(std::move(prompt), "{input}", *input);
    example.Append(prompt, 0);
    example.Append(*output, 1);
    example.AppendEos();
    return example;
  }
  ASSIGN_OR_RETURN(const std::string* response, StringField(record, "response", where));
  if (instruction == nullptr && response == nullptr) {
    ASSIGN_OR_RETURN(instruction, StringField(record, "prompt", where));
    ASSIGN_OR_RETURN(response, StringField(record, "completion", where));
  }
  if (instruction == nullptr || response == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        where,
        ": expected a \"text\" field, \"messages\", \"instruction\" and \"output\" (Alpaca), "
        "\"instruction\" and \"response\", or \"prompt\" and \"completion\""));
  }
  example.Append(absl::StrCat(*instruction, "\n\n", *response), 1);
  example.AppendEosIfTokens();
  return example;
}

absl::Status TokenizeInput(const std::string& path, InputFormat format, const Tokenizer& tokenizer,
                           const std::string& prompt_template, std::vector<Example>& examples) {
  ASSIGN_OR_RETURN(const std::string contents, ReadFile(path));
  // Records wait in `batch` until kRecordsPerBatch of them are tokenized at once; those left
  // without a token are dropped.
  std::vector<Example> batch;
  auto flush = [&] {
    TokenizeExamples(tokenizer, batch);
    for (Example& example : batch) {
      if (!example.tokens.empty()) examples.push_back(std::move(example));
    }
    batch.clear();
  };
  if (format == InputFormat::kText) {
    Example& example = batch.emplace_back();
    example.Append(contents, 1);
    example.AppendEosIfTokens();
    flush();
    return absl::OkStatus();
  }
  std::string_view rest = contents;
  for (int64_t line_number = 1; !rest.empty(); ++line_number) {
    const size_t end = rest.find('\n');
    std::string_view line = rest.substr(0, end);
    rest = end == std::string_view::npos ? std::string_view() : rest.substr(end + 1);
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    ASSIGN_OR_RETURN(Example example,
                     JsonlExample(line, absl::StrCat(path, ":", line_number), prompt_template));
    batch.push_back(std::move(example));
    if (batch.size() == kRecordsPerBatch) flush();
  }
  flush();
  return absl::OkStatus();
}

// The corpus as written: tokens and their loss mask, in samples of sample_tokens when that is
// not 0.
struct Corpus {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> mask;
  // Packed samples only: 1 where a record begins (see token_shard.h).
  std::vector<uint8_t> record_starts;
  uint64_t sample_tokens = 0;
  uint64_t dropped = 0;
};

// Whether a sample with this loss mask has a counted target (its first token is never a
// target).
bool HasTarget(std::span<const uint8_t> mask) {
  return mask.size() > 1 && std::find(mask.begin() + 1, mask.end(), 1) != mask.end();
}

Corpus Arrange(std::vector<Example>& examples, const PrepareOptions& options, uint32_t pad_id) {
  Corpus corpus;
  if (options.seq_len <= 0) {
    for (Example& example : examples) {
      corpus.tokens.insert(corpus.tokens.end(), example.tokens.begin(), example.tokens.end());
      corpus.mask.insert(corpus.mask.end(), example.mask.begin(), example.mask.end());
    }
    return corpus;
  }
  const size_t window = static_cast<size_t>(options.seq_len) + 1;
  corpus.sample_tokens = window;
  size_t filled = 0;  // tokens of the open sample (packing)
  auto close_sample = [&]() {
    if (filled == 0) return;
    corpus.tokens.insert(corpus.tokens.end(), window - filled, pad_id);
    corpus.mask.insert(corpus.mask.end(), window - filled, 0);
    if (options.pack) corpus.record_starts.insert(corpus.record_starts.end(), window - filled, 0);
    filled = 0;
  };
  for (Example& example : examples) {
    const size_t size = std::min(example.tokens.size(), window);
    if (!HasTarget(std::span<const uint8_t>(example.mask).first(size))) {
      ++corpus.dropped;
      continue;
    }
    if (!options.pack || filled + size > window) close_sample();
    corpus.tokens.insert(corpus.tokens.end(), example.tokens.begin(),
                         example.tokens.begin() + static_cast<std::ptrdiff_t>(size));
    corpus.mask.insert(corpus.mask.end(), example.mask.begin(),
                       example.mask.begin() + static_cast<std::ptrdiff_t>(size));
    if (options.pack) {
      corpus.record_starts.push_back(1);
      corpus.record_starts.insert(corpus.record_starts.end(), size - 1, 0);
    }
    filled += size;
  }
  close_sample();
  return corpus;
}

// Writes `tokens` as <output_dir>/<split>-NNNNN.bin shards of at most tokens_per_shard tokens.
// With `mask` and `record_starts` empty, version-1 shards; else each shard gets its part of them.
// With sample_tokens, tokens_per_shard is a multiple of it.
absl::Status WriteSplit(const fs::path& output_dir, const char* split,
                        std::span<const uint32_t> tokens, std::span<const uint8_t> mask,
                        std::span<const uint8_t> record_starts, uint64_t sample_tokens,
                        uint64_t tokens_per_shard, uint32_t vocab_size,
                        std::vector<std::string>& paths) {
  for (uint64_t begin = 0, index = 0; begin < tokens.size(); begin += tokens_per_shard, ++index) {
    const uint64_t count = std::min<uint64_t>(tokens_per_shard, tokens.size() - begin);
    const std::string path = (output_dir / absl::StrFormat("%s-%05d.bin", split, index)).string();
    TokenShardExtras extras;
    extras.sample_tokens = sample_tokens;
    if (!mask.empty()) extras.loss_mask = mask.subspan(begin, count);
    if (!record_starts.empty()) extras.record_starts = record_starts.subspan(begin, count);
    RETURN_IF_ERROR(WriteTokenShard(path, tokens.subspan(begin, count), vocab_size, extras));
    paths.push_back(path);
  }
  return absl::OkStatus();
}

// Whether `name` is <split>-NNNNN.bin, as WriteSplit names shards.
bool IsShardName(std::string_view name) {
  for (std::string_view split : {"train-", "val-"}) {
    if (!name.starts_with(split) || name.size() != split.size() + 5 + 4 ||
        !name.ends_with(".bin")) {
      continue;
    }
    const std::string_view digits = name.substr(split.size(), 5);
    return digits.find_first_not_of("0123456789") == std::string_view::npos;
  }
  return false;
}

// Removes train-NNNNN.bin / val-NNNNN.bin files of an earlier run that this run did not write,
// so that a glob over the directory sees only this run's shards.
absl::Status RemoveStaleShards(const fs::path& output_dir, const PrepareResult& result) {
  std::set<std::string> written(result.train_shards.begin(), result.train_shards.end());
  written.insert(result.val_shards.begin(), result.val_shards.end());
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(output_dir, error)) {
    const std::string name = entry.path().filename().string();
    if (!IsShardName(name) || written.count(entry.path().string()) > 0) {
      continue;
    }
    std::error_code remove_error;
    fs::remove(entry.path(), remove_error);
    if (remove_error) {
      return absl::InternalError(absl::StrCat(
          entry.path().string(), ": cannot remove stale shard: ", remove_error.message()));
    }
  }
  if (error) {
    return absl::InternalError(
        absl::StrCat(output_dir.string(), ": cannot list: ", error.message()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PrepareResult> PrepareData(const PrepareOptions& options) {
  if (options.inputs.empty()) return absl::InvalidArgumentError("inputs: no input file given");
  if (options.output_dir.empty()) return absl::InvalidArgumentError("output_dir is empty");
  if (!(options.val_fraction >= 0.0 && options.val_fraction < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("val_fraction must be in [0, 1) (got ", options.val_fraction, ")"));
  }
  if (options.tokens_per_shard == 0) {
    return absl::InvalidArgumentError("tokens_per_shard must be positive");
  }
  if (options.prompt_template != "alpaca" && options.prompt_template != "chat") {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt_template must be \"alpaca\" or \"chat\" (got \"", options.prompt_template, "\")"));
  }
  if (options.seq_len < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("seq_len must not be negative (got ", options.seq_len, ")"));
  }
  if (options.pack && options.seq_len == 0) {
    return absl::InvalidArgumentError("pack needs seq_len: packing fills samples of seq_len + 1");
  }
  if (!options.eos_token.empty() && !IsHfTokenizerPath(options.tokenizer)) {
    return absl::InvalidArgumentError("eos_token applies to Hugging Face tokenizers only");
  }
  ASSIGN_OR_RETURN(const std::unique_ptr<Tokenizer> tokenizer, MakeTokenizer(options));

  std::vector<Example> examples;
  for (const std::string& input : options.inputs) {
    ASSIGN_OR_RETURN(const InputFormat format, FormatOf(input, options.format));
    RETURN_IF_ERROR(TokenizeInput(input, format, *tokenizer, options.prompt_template, examples));
    if (absl::Status status = tokenizer->status(); !status.ok()) {
      return absl::Status(status.code(), absl::StrCat(input, ": ", status.message()));
    }
  }
  const uint64_t records = examples.size();
  Corpus corpus = Arrange(examples, options, tokenizer->eos_id());
  examples.clear();
  if (corpus.tokens.empty()) {
    return absl::InvalidArgumentError(
        corpus.dropped > 0 ? absl::StrCat("inputs: all ", corpus.dropped,
                                          " records lose their whole response to seq_len ",
                                          options.seq_len)
                           : std::string("inputs: the input files hold no text"));
  }
  const std::vector<uint32_t>& tokens = corpus.tokens;
  // The unit the split and the shards are cut in: a token, or a sample.
  const uint64_t unit = corpus.sample_tokens > 0 ? corpus.sample_tokens : 1;
  const uint64_t units = tokens.size() / unit;
  uint64_t val_units =
      static_cast<uint64_t>(std::llround(static_cast<double>(units) * options.val_fraction));
  val_units = std::min<uint64_t>(val_units, units - 1);  // keep one train token / sample
  const uint64_t val_tokens = val_units * unit;
  const uint64_t tokens_per_shard = std::max<uint64_t>(unit, options.tokens_per_shard / unit * unit);
  const bool masked = std::find(corpus.mask.begin(), corpus.mask.end(), 0) != corpus.mask.end();
  const std::span<const uint8_t> mask =
      masked ? std::span<const uint8_t>(corpus.mask) : std::span<const uint8_t>();

  const fs::path output_dir(options.output_dir);
  std::error_code error;
  fs::create_directories(output_dir, error);
  if (error) {
    return absl::InternalError(
        absl::StrCat(options.output_dir, ": cannot create output_dir: ", error.message()));
  }
  PrepareResult result;
  result.vocab_size = tokenizer->vocab_size();
  result.val_tokens = val_tokens;
  result.train_tokens = tokens.size() - val_tokens;
  result.records = records - corpus.dropped;
  result.dropped_records = corpus.dropped;
  result.loss_mask = masked;
  result.record_starts = !corpus.record_starts.empty();
  const std::span<const uint32_t> all(tokens);
  const std::span<const uint8_t> starts(corpus.record_starts);
  RETURN_IF_ERROR(WriteSplit(output_dir, "train", all.first(result.train_tokens),
                             mask.empty() ? mask : mask.first(result.train_tokens),
                             starts.empty() ? starts : starts.first(result.train_tokens),
                             corpus.sample_tokens, tokens_per_shard, result.vocab_size,
                             result.train_shards));
  RETURN_IF_ERROR(WriteSplit(output_dir, "val", all.subspan(result.train_tokens),
                             mask.empty() ? mask : mask.subspan(result.train_tokens),
                             starts.empty() ? starts : starts.subspan(result.train_tokens),
                             corpus.sample_tokens, tokens_per_shard, result.vocab_size,
                             result.val_shards));
  RETURN_IF_ERROR(RemoveStaleShards(output_dir, result));
  return result;
}

}  // namespace tessera::trainer
