// The CLI's connection settings: coordinator address, bearer token and TLS
// files, from flags, the environment (TESSERA_COORDINATOR, TESSERA_TOKEN) and
// a YAML config file (--config, else $TESSERA_CONFIG, else
// ~/.config/tessera/config.yaml), in that order of precedence.
//
//   coordinator: tessera.example.com:50051
//   # or several (HA): "a:50051,b:50051", or a YAML list [a:50051, b:50051]
//   token: 3f1c...            # or leave it to TESSERA_TOKEN
//   tls_ca: /etc/tessera/ca.crt
//   tls_cert: ~/.config/tessera/alice.crt   # client certificate, optional
//   tls_key: ~/.config/tessera/alice.key
#pragma once

#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace tessera::client {

struct ClientConfig {
  // One address, or several comma-separated (a YAML list is joined so).
  std::string coordinator;
  std::string token;
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
};

// Parses a config file's text; INVALID_ARGUMENT naming an unknown key.
absl::StatusOr<ClientConfig> ParseClientConfig(const std::string& yaml);

// The config file to read: `flag_path` when set, else $TESSERA_CONFIG, else
// $XDG_CONFIG_HOME/tessera/config.yaml or ~/.config/tessera/config.yaml.
// `explicit_path` is set when the file was named (then it must exist).
std::string ClientConfigPath(const std::string& flag_path, bool* explicit_path);

// Reads the config file (a missing default file is an empty config; a
// missing named one NOT_FOUND). A token in a file readable by others is
// refused (FAILED_PRECONDITION): chmod 600 it.
absl::StatusOr<ClientConfig> LoadClientConfig(const std::string& flag_path);

}  // namespace tessera::client
