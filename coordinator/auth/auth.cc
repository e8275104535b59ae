#include "coordinator/auth/auth.h"

#include <openssl/evp.h>

#include <cstdlib>
#include <iostream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/read_file.h"
#include "common/status_macros.h"
#include "grpc/grpc_security_constants.h"
#include "yaml-cpp/yaml.h"

namespace tessera::coordinator {
namespace {

constexpr absl::string_view kBearerPrefix = "Bearer ";

bool IsLowerHexSha256(absl::string_view text) {
  if (text.size() != 64) return false;
  for (char c : text) {
    if (!absl::ascii_isdigit(c) && (c < 'a' || c > 'f')) return false;
  }
  return true;
}

std::string RoleNames(uint32_t roles) {
  std::vector<std::string> names;
  if (roles & static_cast<uint32_t>(Role::kViewer)) names.push_back("viewer");
  if (roles & static_cast<uint32_t>(Role::kUser)) names.push_back("user");
  if (roles & static_cast<uint32_t>(Role::kAdmin)) names.push_back("admin");
  if (roles & static_cast<uint32_t>(Role::kNode)) names.push_back("node");
  return names.empty() ? "no role" : absl::StrJoin(names, ", ");
}

}  // namespace

std::optional<Role> ParseRole(absl::string_view name) {
  if (name == "viewer") return Role::kViewer;
  if (name == "user") return Role::kUser;
  if (name == "admin") return Role::kAdmin;
  if (name == "node") return Role::kNode;
  return std::nullopt;
}

CallCredentials CredentialsOf(const grpc::ServerContextBase& context) {
  CallCredentials credentials;
  const auto& metadata = context.client_metadata();
  if (auto it = metadata.find("authorization"); it != metadata.end()) {
    absl::string_view value(it->second.data(), it->second.size());
    if (absl::StartsWithIgnoreCase(value, kBearerPrefix) && value.size() > kBearerPrefix.size()) {
      credentials.bearer_token = std::string(value.substr(kBearerPrefix.size()));
    } else {
      credentials.malformed_authorization = true;
    }
  }
  std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    for (const auto& name : auth->FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME)) {
      credentials.certificate_common_name.assign(name.data(), name.size());
      break;
    }
  }
  return credentials;
}

std::string TokenSha256(absl::string_view token) {
  // Fetched once: EVP_sha256() makes every EVP_Digest look the algorithm up again, under a lock
  // that all threads share, and every heartbeat and report checks its node key through here.
  // Never freed: it lives as long as the process.
  static EVP_MD* const sha256 = [] {
    EVP_MD* md = EVP_MD_fetch(nullptr, "SHA256", nullptr);
    if (md == nullptr) {
      std::cerr << "tessera: OpenSSL offers no SHA-256\n";
      std::abort();
    }
    return md;
  }();
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(token.data(), token.size(), digest, &length, sha256, nullptr);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * length);
  for (unsigned int i = 0; i < length; ++i) {
    hex.push_back(kHex[digest[i] >> 4]);
    hex.push_back(kHex[digest[i] & 15]);
  }
  return hex;
}

absl::StatusOr<std::vector<AuthUser>> ParseAuthFile(absl::string_view yaml) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml));
  } catch (const YAML::Exception& error) {
    return absl::InvalidArgumentError(absl::StrCat("auth file: not YAML: ", error.what()));
  }
  if (!root.IsMap()) return absl::InvalidArgumentError("auth file: expected a map with 'users'");
  for (const auto& entry : root) {
    if (entry.first.as<std::string>("") != "users") {
      return absl::InvalidArgumentError(
          absl::StrCat("auth file: unknown key '", entry.first.as<std::string>(""), "'"));
    }
  }
  const YAML::Node list = root["users"];
  if (!list.IsSequence()) return absl::InvalidArgumentError("auth file: users: expected a list");
  std::vector<AuthUser> users;
  absl::flat_hash_map<std::string, std::string> token_owner;
  absl::flat_hash_map<std::string, bool> names;
  try {
    for (size_t i = 0; i < list.size(); ++i) {
      const YAML::Node node = list[i];
      const std::string where = absl::StrCat("auth file: users[", i, "]");
      if (!node.IsMap()) return absl::InvalidArgumentError(absl::StrCat(where, ": expected a map"));
      AuthUser user;
      for (const auto& field : node) {
        const std::string key = field.first.as<std::string>();
        if (key == "name") {
          user.name = field.second.as<std::string>();
        } else if (key == "roles") {
          if (!field.second.IsSequence()) {
            return absl::InvalidArgumentError(absl::StrCat(where, ".roles: expected a list"));
          }
          for (const auto& role_node : field.second) {
            const std::string role_name = role_node.as<std::string>();
            std::optional<Role> role = ParseRole(role_name);
            if (!role) {
              return absl::InvalidArgumentError(
                  absl::StrCat(where, ".roles: unknown role '", role_name,
                               "' (viewer, user, admin or node)"));
            }
            user.roles |= static_cast<uint32_t>(*role);
          }
        } else if (key == "token_sha256") {
          if (!field.second.IsSequence()) {
            return absl::InvalidArgumentError(
                absl::StrCat(where, ".token_sha256: expected a list of hex SHA-256 digests"));
          }
          for (const auto& hash_node : field.second) {
            std::string hash = absl::AsciiStrToLower(hash_node.as<std::string>());
            if (!IsLowerHexSha256(hash)) {
              return absl::InvalidArgumentError(absl::StrCat(
                  where, ".token_sha256: '", hash_node.as<std::string>(),
                  "' is not a SHA-256 in hex (printf %s \"$TOKEN\" | sha256sum)"));
            }
            user.token_sha256.push_back(std::move(hash));
          }
        } else {
          return absl::InvalidArgumentError(absl::StrCat(
              where, ": unknown key '", key, "' (name, roles, token_sha256)"));
        }
      }
      if (user.name.empty()) return absl::InvalidArgumentError(absl::StrCat(where, ".name: required"));
      if (user.roles == 0) {
        return absl::InvalidArgumentError(absl::StrCat(where, " (", user.name, ").roles: required"));
      }
      if (names.contains(user.name)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ".name: '", user.name, "' is listed twice"));
      }
      names[user.name] = true;
      for (const std::string& hash : user.token_sha256) {
        auto [it, inserted] = token_owner.emplace(hash, user.name);
        if (!inserted) {
          return absl::InvalidArgumentError(absl::StrCat(where, ".token_sha256: token ", hash.substr(0, 8),
                                                         "... also belongs to ", it->second));
        }
      }
      users.push_back(std::move(user));
    }
  } catch (const YAML::Exception& error) {
    return absl::InvalidArgumentError(absl::StrCat("auth file: ", error.what()));
  }
  return users;
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Create(AuthenticatorOptions options) {
  std::unique_ptr<Authenticator> authenticator(new Authenticator(std::move(options)));
  if (authenticator->open()) return authenticator;
  absl::MutexLock lock(&authenticator->mu_);
  RETURN_IF_ERROR(authenticator->LoadLocked());
  authenticator->last_check_ = authenticator->options_.clock->Now();
  return authenticator;
}

absl::Status Authenticator::LoadLocked() {
  ASSIGN_OR_RETURN(std::string identity, FileIdentity(options_.auth_file));
  ASSIGN_OR_RETURN(std::string text, ReadWholeFile(options_.auth_file));
  auto users = ParseAuthFile(text);
  if (!users.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_file ", options_.auth_file, ": ", users.status().message()));
  }
  users_ = std::move(*users);
  by_token_.clear();
  by_name_.clear();
  for (size_t i = 0; i < users_.size(); ++i) {
    by_name_[users_[i].name] = i;
    for (const std::string& hash : users_[i].token_sha256) by_token_[hash] = i;
  }
  file_identity_ = std::move(identity);
  ++reloads_;
  return absl::OkStatus();
}

absl::Status Authenticator::ReloadIfChanged() {
  if (open()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  last_check_ = options_.clock->Now();
  auto identity = FileIdentity(options_.auth_file);
  if (!identity.ok()) return identity.status();
  if (*identity == file_identity_) return absl::OkStatus();
  absl::Status status = LoadLocked();
  if (!status.ok()) {
    // Keep serving with the previous table; do not re-read the same bad file every call.
    file_identity_ = *identity;
    if (last_reload_error_ != status.message()) {
      last_reload_error_ = std::string(status.message());
      std::cerr << "tessera-coordinator: keeping the previous users: " << status << "\n";
    }
    return status;
  }
  last_reload_error_.clear();
  std::cerr << "tessera-coordinator: reloaded " << options_.auth_file << " (" << users_.size()
            << " users)\n";
  return absl::OkStatus();
}

int Authenticator::reloads() const {
  absl::MutexLock lock(&mu_);
  return reloads_;
}

absl::StatusOr<Principal> Authenticator::Authenticate(const CallCredentials& credentials) {
  if (open()) {
    return Principal{.user = "anonymous",
                     .roles = static_cast<uint32_t>(Role::kViewer) |
                              static_cast<uint32_t>(Role::kUser) |
                              static_cast<uint32_t>(Role::kAdmin) |
                              static_cast<uint32_t>(Role::kNode),
                     .method = "open"};
  }
  bool check_file = false;
  {
    absl::MutexLock lock(&mu_);
    check_file = options_.clock->Now() - last_check_ >= options_.reload_check_interval;
  }
  if (check_file) ReloadIfChanged().IgnoreError();  // logged inside; the old table stays

  if (credentials.malformed_authorization) {
    return absl::UnauthenticatedError(
        "the authorization header must be 'Bearer <token>'");
  }
  absl::MutexLock lock(&mu_);
  if (credentials.bearer_token.has_value()) {
    auto it = by_token_.find(TokenSha256(*credentials.bearer_token));
    if (it == by_token_.end()) return absl::UnauthenticatedError("unknown or revoked token");
    const AuthUser& user = users_[it->second];
    return Principal{.user = user.name, .roles = user.roles, .method = "token"};
  }
  if (!credentials.certificate_common_name.empty()) {
    auto it = by_name_.find(credentials.certificate_common_name);
    if (it == by_name_.end()) {
      return absl::UnauthenticatedError(absl::StrCat("client certificate CN=",
                                                     credentials.certificate_common_name,
                                                     " is not a user of the auth file"));
    }
    const AuthUser& user = users_[it->second];
    return Principal{.user = user.name, .roles = user.roles, .method = "certificate"};
  }
  return absl::UnauthenticatedError(
      "credentials required: a bearer token (TESSERA_TOKEN or the CLI config's token) or a "
      "client certificate");
}

absl::Status Authorize(const Principal& principal, Action action, absl::string_view job_owner) {
  auto deny = [&](absl::string_view what) {
    return absl::PermissionDeniedError(absl::StrCat("user ", principal.user, " (",
                                                    RoleNames(principal.roles), ") ", what));
  };
  switch (action) {
    case Action::kRead:
      if (principal.Has(Role::kViewer) || principal.Has(Role::kUser) ||
          principal.Has(Role::kAdmin)) {
        return absl::OkStatus();
      }
      return deny("may not read jobs (needs viewer, user or admin)");
    case Action::kSubmit:
      if (principal.Has(Role::kUser) || principal.Has(Role::kAdmin)) return absl::OkStatus();
      return deny("may not submit jobs (needs user or admin)");
    case Action::kManageJob:
      if (principal.Has(Role::kAdmin)) return absl::OkStatus();
      if (principal.Has(Role::kUser) && job_owner == principal.user) return absl::OkStatus();
      if (principal.Has(Role::kUser)) {
        return deny(absl::StrCat("may not act on a job of ",
                                 job_owner.empty() ? "no recorded owner" : job_owner,
                                 " (only its owner or an admin)"));
      }
      return deny("may not cancel jobs or read their logs (needs user or admin)");
    case Action::kAdminister:
      if (principal.Has(Role::kAdmin)) return absl::OkStatus();
      return deny("may not drain, undrain or remove nodes (needs admin)");
    case Action::kNode:
      if (principal.Has(Role::kNode)) return absl::OkStatus();
      return deny("is not a node (workers need a join token or certificate of a 'node' user)");
  }
  return deny("unknown action");
}

}  // namespace tessera::coordinator
