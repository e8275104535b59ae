#include "client/job_spec_file.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "yaml-cpp/yaml.h"

namespace tessera::client {
namespace {

// YAML -> JSON. Scalars become JSON strings except booleans and nulls; the
// protobuf JSON parser accepts numbers written as strings for numeric fields.
nlohmann::json ToJson(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map: {
      nlohmann::json object = nlohmann::json::object();
      for (const auto& item : node) object[item.first.as<std::string>()] = ToJson(item.second);
      return object;
    }
    case YAML::NodeType::Sequence: {
      nlohmann::json array = nlohmann::json::array();
      for (const auto& item : node) array.push_back(ToJson(item));
      return array;
    }
    case YAML::NodeType::Scalar: {
      const std::string& value = node.Scalar();
      if (node.Tag() != "!") {  // unquoted
        if (value == "true") return true;
        if (value == "false") return false;
      }
      return value;
    }
    default:
      return nullptr;
  }
}

}  // namespace

absl::StatusOr<v1::JobSpec> ParseJobSpec(const std::string& text) {
  nlohmann::json json;
  try {
    json = ToJson(YAML::Load(text));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: ", e.what()));
  }
  if (!json.is_object()) return absl::InvalidArgumentError("job spec: expected a mapping");
  // Shorthand: `parallelism: auto`.
  if (json.contains("parallelism") && json["parallelism"] == "auto") {
    json["parallelism"] = {{"auto_layout", nlohmann::json::object()}};
  }
  v1::JobSpec spec;
  auto status = google::protobuf::util::JsonStringToMessage(json.dump(), &spec);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: ", status.message().ToString()));
  }
  return spec;
}

absl::StatusOr<v1::JobSpec> LoadJobSpec(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  auto spec = ParseJobSpec(buffer.str());
  if (!spec.ok()) {
    return absl::Status(spec.status().code(), absl::StrCat(path, ": ", spec.status().message()));
  }
  return spec;
}

}  // namespace tessera::client
