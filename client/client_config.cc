#include "client/client_config.h"

#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/read_file.h"
#include "yaml-cpp/yaml.h"

namespace tessera::client {
namespace {

// Environment variable naming the config file.
constexpr char kConfigEnv[] = "TESSERA_CONFIG";

// "~/x" -> "$HOME/x".
std::string ExpandHome(const std::string& path) {
  if (path.rfind("~/", 0) != 0) return path;
  const char* home = std::getenv("HOME");
  return home == nullptr ? path : absl::StrCat(home, path.substr(1));
}

}  // namespace

absl::StatusOr<ClientConfig> ParseClientConfig(const std::string& yaml) {
  ClientConfig config;
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::Exception& error) {
    return absl::InvalidArgumentError(absl::StrCat("not YAML: ", error.what()));
  }
  if (root.IsNull()) return config;
  if (!root.IsMap()) return absl::InvalidArgumentError("expected a map of settings");
  try {
    for (const auto& entry : root) {
      const std::string key = entry.first.as<std::string>();
      // Several coordinators (HA) may be a YAML list as well as "a:1,b:2".
      if (key == "coordinator" && entry.second.IsSequence()) {
        std::vector<std::string> addresses;
        for (const auto& address : entry.second) addresses.push_back(address.as<std::string>());
        config.coordinator = absl::StrJoin(addresses, ",");
        continue;
      }
      const std::string value = entry.second.as<std::string>();
      if (key == "coordinator") {
        config.coordinator = value;
      } else if (key == "token") {
        config.token = value;
      } else if (key == "tls_ca") {
        config.tls_ca = ExpandHome(value);
      } else if (key == "tls_cert") {
        config.tls_cert = ExpandHome(value);
      } else if (key == "tls_key") {
        config.tls_key = ExpandHome(value);
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "unknown key '", key, "' (coordinator, token, tls_ca, tls_cert, tls_key)"));
      }
    }
  } catch (const YAML::Exception& error) {
    return absl::InvalidArgumentError(error.what());
  }
  return config;
}

std::string ClientConfigPath(const std::string& flag_path, bool* explicit_path) {
  *explicit_path = true;
  if (!flag_path.empty()) return ExpandHome(flag_path);
  if (const char* env = std::getenv(kConfigEnv); env != nullptr && *env != '\0') {
    return ExpandHome(env);
  }
  *explicit_path = false;
  if (const char* xdg = std::getenv("XDG_CONFIG_HOME"); xdg != nullptr && *xdg != '\0') {
    return absl::StrCat(xdg, "/tessera/config.yaml");
  }
  return ExpandHome("~/.config/tessera/config.yaml");
}

absl::StatusOr<ClientConfig> LoadClientConfig(const std::string& flag_path) {
  bool explicit_path = false;
  const std::string path = ClientConfigPath(flag_path, &explicit_path);
  std::error_code error;
  if (!std::filesystem::exists(path, error)) {
    if (explicit_path) return absl::NotFoundError(absl::StrCat("config file ", path, ": missing"));
    return ClientConfig();
  }
  auto text = ReadWholeFile(path);
  if (!text.ok()) return text.status();
  auto config = ParseClientConfig(*text);
  if (!config.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config file ", path, ": ", config.status().message()));
  }
  struct stat info {};
  if (!config->token.empty() && stat(path.c_str(), &info) == 0 && (info.st_mode & 077) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "config file ", path, " holds a token and is readable by others: chmod 600 it"));
  }
  return config;
}

}  // namespace tessera::client
