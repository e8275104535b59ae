#include "trainer/prepare.h"

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
#include "trainer/token_shard.h"
#include "trainer/tokenizer.h"

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

absl::StatusOr<std::unique_ptr<Tokenizer>> MakeTokenizer(const std::string& name) {
  if (name == "byte") return MakeByteTokenizer();
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

// The document of one JSONL record (see PrepareOptions::format).
absl::StatusOr<std::string> JsonlDocument(std::string_view line, const std::string& where) {
  nlohmann::json record;
  try {
    record = nlohmann::json::parse(line);
  } catch (const nlohmann::json::parse_error& e) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": malformed JSON: ", e.what()));
  }
  if (!record.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": expected a JSON object"));
  }
  ASSIGN_OR_RETURN(const std::string* text, StringField(record, "text", where));
  if (text != nullptr) return *text;
  ASSIGN_OR_RETURN(const std::string* instruction, StringField(record, "instruction", where));
  ASSIGN_OR_RETURN(const std::string* response, StringField(record, "response", where));
  if (instruction == nullptr && response == nullptr) {
    ASSIGN_OR_RETURN(instruction, StringField(record, "prompt", where));
    ASSIGN_OR_RETURN(response, StringField(record, "completion", where));
  }
  if (instruction == nullptr || response == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(where,
                     ": expected a \"text\" field, or \"instruction\" and \"response\", or "
                     "\"prompt\" and \"completion\""));
  }
  return absl::StrCat(*instruction, "\n\n", *response);
}

void AppendDocument(const Tokenizer& tokenizer, std::string_view document,
                    std::vector<uint32_t>& tokens) {
  if (document.empty()) return;
  const std::vector<uint32_t> encoded = tokenizer.Encode(document);
  tokens.insert(tokens.end(), encoded.begin(), encoded.end());
  tokens.push_back(tokenizer.eos_id());
}

absl::Status TokenizeInput(const std::string& path, InputFormat format, const Tokenizer& tokenizer,
                           std::vector<uint32_t>& tokens) {
  ASSIGN_OR_RETURN(const std::string contents, ReadFile(path));
  if (format == InputFormat::kText) {
    AppendDocument(tokenizer, contents, tokens);
    return absl::OkStatus();
  }
  std::string_view rest = contents;
  for (int64_t line_number = 1; !rest.empty(); ++line_number) {
    const size_t end = rest.find('\n');
    std::string_view line = rest.substr(0, end);
    rest = end == std::string_view::npos ? std::string_view() : rest.substr(end + 1);
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    ASSIGN_OR_RETURN(const std::string document,
                     JsonlDocument(line, absl::StrCat(path, ":", line_number)));
    AppendDocument(tokenizer, document, tokens);
  }
  return absl::OkStatus();
}

// Writes `tokens` as <output_dir>/<split>-NNNNN.bin shards of at most tokens_per_shard tokens.
absl::Status WriteSplit(const fs::path& output_dir, const char* split,
                        std::span<const uint32_t> tokens, uint64_t tokens_per_shard,
                        uint32_t vocab_size, std::vector<std::string>& paths) {
  for (uint64_t begin = 0, index = 0; begin < tokens.size(); begin += tokens_per_shard, ++index) {
    const uint64_t count = std::min<uint64_t>(tokens_per_shard, tokens.size() - begin);
    const std::string path = (output_dir / absl::StrFormat("%s-%05d.bin", split, index)).string();
    RETURN_IF_ERROR(WriteTokenShard(path, tokens.subspan(begin, count), vocab_size));
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
  ASSIGN_OR_RETURN(const std::unique_ptr<Tokenizer> tokenizer, MakeTokenizer(options.tokenizer));

  std::vector<uint32_t> tokens;
  for (const std::string& input : options.inputs) {
    ASSIGN_OR_RETURN(const InputFormat format, FormatOf(input, options.format));
    RETURN_IF_ERROR(TokenizeInput(input, format, *tokenizer, tokens));
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError("inputs: the input files hold no text");
  }
  uint64_t val_tokens = static_cast<uint64_t>(
      std::llround(static_cast<double>(tokens.size()) * options.val_fraction));
  val_tokens = std::min<uint64_t>(val_tokens, tokens.size() - 1);  // keep one train token

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
  const std::span<const uint32_t> all(tokens);
  RETURN_IF_ERROR(WriteSplit(output_dir, "train", all.first(result.train_tokens),
                             options.tokens_per_shard, result.vocab_size, result.train_shards));
  RETURN_IF_ERROR(WriteSplit(output_dir, "val", all.subspan(result.train_tokens),
                             options.tokens_per_shard, result.vocab_size, result.val_shards));
  RETURN_IF_ERROR(RemoveStaleShards(output_dir, result));
  return result;
}

}  // namespace tessera::trainer
