#include "client/job_spec_file.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "yaml-cpp/yaml.h"

namespace tessera::client {
namespace {

// YAML -> JSON. Scalars become JSON strings except booleans and nulls; the
// protobuf JSON parser accepts numbers written as strings for numeric fields.
// Values are expanded through `env`; the first failure lands in `*error`.
nlohmann::json ToJson(const YAML::Node& node, const EnvLookup& env, absl::Status* error) {
  switch (node.Type()) {
    case YAML::NodeType::Map: {
      nlohmann::json object = nlohmann::json::object();
      for (const auto& item : node) {
        object[item.first.as<std::string>()] = ToJson(item.second, env, error);
      }
      return object;
    }
    case YAML::NodeType::Sequence: {
      nlohmann::json array = nlohmann::json::array();
      for (const auto& item : node) array.push_back(ToJson(item, env, error));
      return array;
    }
    case YAML::NodeType::Scalar: {
      absl::StatusOr<std::string> value = ExpandEnvironment(node.Scalar(), env);
      if (!value.ok()) {
        if (error->ok()) {
          *error = absl::InvalidArgumentError(absl::StrCat(
              "job spec: ", value.status().message(), " (line ", node.Mark().line + 1, ")"));
        }
        return nullptr;
      }
      if (node.Tag() != "!") {  // unquoted
        if (*value == "true") return true;
        if (*value == "false") return false;
      }
      return *value;
    }
    default:
      return nullptr;
  }
}

bool IsNameStart(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; }
bool IsNameChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// Every mapping key of the document with the (1-based) line it is on.
void CollectKeyLines(const YAML::Node& node, std::vector<std::pair<std::string, int>>* keys) {
  if (node.IsMap()) {
    for (const auto& item : node) {
      keys->emplace_back(item.first.Scalar(), item.first.Mark().line + 1);
      CollectKeyLines(item.second, keys);
    }
  } else if (node.IsSequence()) {
    for (const auto& item : node) CollectKeyLines(item, keys);
  }
}

// " (line N)" for the key the protobuf error names; the longest key that
// appears in the message as a whole word wins.
std::string LineOfKeyIn(const std::string& message, const YAML::Node& root) {
  std::vector<std::pair<std::string, int>> keys;
  CollectKeyLines(root, &keys);
  std::string best;
  int line = 0;
  for (const auto& [key, key_line] : keys) {
    size_t at = message.find(key);
    if (at == std::string::npos || key.size() <= best.size()) continue;
    auto is_word = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
    bool starts = at == 0 || !is_word(message[at - 1]);
    bool ends = at + key.size() == message.size() || !is_word(message[at + key.size()]);
    if (starts && ends) {
      best = key;
      line = key_line;
    }
  }
  return line > 0 ? absl::StrCat(" (line ", line, ")") : "";
}

// One of SpecSettings (job_spec_file.h) applied to the spec's JSON.
absl::Status ApplySetting(const std::string& setting, const EnvLookup& env, nlohmann::json* spec) {
  const size_t equals = setting.find('=');
  if (equals == std::string::npos || equals == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--set '", setting, "': expected PATH=VALUE, e.g. data.seq_len=128"));
  }
  const std::string path = setting.substr(0, equals);
  nlohmann::json value;
  try {
    absl::Status expanded;
    value = ToJson(YAML::Load(setting.substr(equals + 1)), env, &expanded);
    if (!expanded.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--set ", path, ": ", expanded.message()));
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("--set ", path, ": not a YAML value: ", e.what()));
  }
  nlohmann::json* node = spec;
  for (absl::string_view name : absl::StrSplit(path, '.')) {
    if (name.empty() || !std::all_of(name.begin(), name.end(), IsNameChar)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--set ", path, ": a path is field names joined by dots, e.g. data.seq_len"));
    }
    if (!node->is_object()) *node = nlohmann::json::object();
    node = &(*node)[std::string(name)];
  }
  *node = std::move(value);
  return absl::OkStatus();
}

}  // namespace

EnvLookup ProcessEnvironment() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

absl::StatusOr<std::string> ExpandEnvironment(const std::string& value, const EnvLookup& env) {
  std::string out;
  for (size_t i = 0; i < value.size(); ++i) {
    if (value[i] != '$' || i + 1 == value.size()) {
      out += value[i];
      continue;
    }
    if (value[i + 1] == '$') {
      out += '$';
      ++i;
      continue;
    }
    if (value[i + 1] != '{') {
      out += value[i];
      continue;
    }
    const size_t close = value.find('}', i + 2);
    if (close == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", value.substr(i), "' has no closing '}' (write $$ for a literal $)"));
    }
    const std::string inside = value.substr(i + 2, close - i - 2);
    const size_t dash = inside.find(":-");
    const std::string name = inside.substr(0, dash);
    if (name.empty() || !IsNameStart(name[0]) ||
        !std::all_of(name.begin(), name.end(), IsNameChar)) {
      return absl::InvalidArgumentError(
          absl::StrCat("${", inside, "}: '", name, "' is not an environment variable name"));
    }
    std::optional<std::string> found = env ? env(name) : std::nullopt;
    if (dash != std::string::npos && (!found || found->empty())) {
      found = inside.substr(dash + 2);
    }
    if (!found) {
      return absl::InvalidArgumentError(absl::StrCat(
          "${", name, "} is not set in the environment (set it, or write ${", name,
          ":-default})"));
    }
    out += *found;
    i = close;
  }
  return out;
}

absl::StatusOr<v1::JobSpec> ParseJobSpec(const std::string& text, const EnvLookup& env,
                                         const SpecSettings& settings) {
  nlohmann::json json;
  YAML::Node root;
  absl::Status expanded;
  try {
    root = YAML::Load(text);
    json = ToJson(root, env, &expanded);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: ", e.what()));
  }
  if (!expanded.ok()) return expanded;
  if (!json.is_object()) return absl::InvalidArgumentError("job spec: expected a mapping");
  for (const std::string& setting : settings) {
    if (absl::Status set = ApplySetting(setting, env, &json); !set.ok()) return set;
  }
  // Shorthand: `parallelism: auto`.
  if (json.contains("parallelism") && json["parallelism"] == "auto") {
    json["parallelism"] = {{"auto_layout", nlohmann::json::object()}};
  }
  std::string json_text;
  try {
    json_text = json.dump();
  } catch (const nlohmann::json::type_error& e) {
    // YAML passes any bytes through; JSON text must be UTF-8 (and so must proto strings).
    return absl::InvalidArgumentError("job spec: a key or value is not valid UTF-8 text");
  }
  v1::JobSpec spec;
  auto status = google::protobuf::util::JsonStringToMessage(json_text, &spec);
  if (!status.ok()) {
    std::string message = status.message().ToString();
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: ", message, LineOfKeyIn(message, root)));
  }
  return spec;
}

absl::StatusOr<v1::JobSpec> LoadJobSpec(const std::string& path, const EnvLookup& env,
                                        const SpecSettings& settings) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  auto spec = ParseJobSpec(buffer.str(), env, settings);
  if (!spec.ok()) {
    return absl::Status(spec.status().code(), absl::StrCat(path, ": ", spec.status().message()));
  }
  return spec;
}

}  // namespace tessera::client
