#include "coordinator/auth/auth.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace tessera::coordinator {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::ScopedTempDir;
using ::testing::HasSubstr;

constexpr uint32_t kUser = static_cast<uint32_t>(Role::kUser);

std::string Users(const std::string& alice_token) {
  return absl::StrCat("users:\n  - name: alice\n    roles: [user]\n    token_sha256: [",
                      TokenSha256(alice_token),
                      "]\n  - name: ops\n    roles: [admin, viewer]\n"
                      "  - name: workers\n    roles: [node]\n    token_sha256: [",
                      TokenSha256("join"), "]\n");
}

void Write(const std::string& path, const std::string& text) {
  const std::string temp = path + ".tmp";
  std::ofstream(temp) << text;
  ASSERT_EQ(std::rename(temp.c_str(), path.c_str()), 0);
}

TEST(TokenSha256Test, MatchesSha256sum) {
  // printf %s abc | sha256sum
  EXPECT_EQ(TokenSha256("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(ParseAuthFileTest, ReadsUsersRolesAndHashes) {
  auto users = ParseAuthFile(Users("t1"));
  ASSERT_THAT(users, IsOk());
  ASSERT_EQ(users->size(), 3u);
  EXPECT_EQ((*users)[0].name, "alice");
  EXPECT_EQ((*users)[0].roles, kUser);
  EXPECT_EQ((*users)[0].token_sha256, std::vector<std::string>{TokenSha256("t1")});
  EXPECT_EQ((*users)[1].roles,
            static_cast<uint32_t>(Role::kAdmin) | static_cast<uint32_t>(Role::kViewer));
  EXPECT_TRUE((*users)[1].token_sha256.empty());
}

TEST(ParseAuthFileTest, NamesWhatIsWrong) {
  struct Case {
    std::string yaml;
    std::string message;
  };
  const std::string hash = TokenSha256("x");
  for (const Case& c : std::vector<Case>{
           {"users: [oops", "not YAML"},
           {"people: []", "unknown key 'people'"},
           {"users: {a: 1}", "users: expected a list"},
           {"users:\n  - name: a\n    roles: [root]", "users[0].roles: unknown role 'root'"},
           {"users:\n  - name: a", "users[0] (a).roles: required"},
           {"users:\n  - roles: [user]", "users[0].name: required"},
           {"users:\n  - name: a\n    roles: [user]\n    token_sha256: [abc]",
            "is not a SHA-256 in hex"},
           {"users:\n  - name: a\n    roles: [user]\n    tokens: []", "unknown key 'tokens'"},
           {absl::StrCat("users:\n  - name: a\n    roles: [user]\n    token_sha256: [", hash,
                         "]\n  - name: b\n    roles: [user]\n    token_sha256: [", hash, "]"),
            "also belongs to a"},
           {"users:\n  - name: a\n    roles: [user]\n  - name: a\n    roles: [viewer]",
            "listed twice"},
       }) {
    auto users = ParseAuthFile(c.yaml);
    EXPECT_EQ(users.status().code(), absl::StatusCode::kInvalidArgument) << c.yaml;
    EXPECT_THAT(users.status().message(), HasSubstr(c.message)) << c.yaml;
  }
}

class AuthenticatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.path() + "/auth.yaml";
    Write(path_, Users("alice-1"));
    auto authenticator = Authenticator::Create(
        {.auth_file = path_, .reload_check_interval = absl::Seconds(1), .clock = &clock_});
    ASSERT_THAT(authenticator, IsOk());
    authenticator_ = std::move(*authenticator);
  }

  absl::StatusOr<Principal> WithToken(const std::string& token) {
    return authenticator_->Authenticate({.bearer_token = token});
  }

  ScopedTempDir dir_;
  std::string path_;
  SimulatedClock clock_;
  std::unique_ptr<Authenticator> authenticator_;
};

TEST_F(AuthenticatorTest, TokensAndCertificatesNameUsers) {
  auto alice = WithToken("alice-1");
  ASSERT_THAT(alice, IsOk());
  EXPECT_EQ(alice->user, "alice");
  EXPECT_EQ(alice->method, "token");
  EXPECT_TRUE(alice->Has(Role::kUser));
  EXPECT_FALSE(alice->Has(Role::kAdmin));

  auto ops = authenticator_->Authenticate({.certificate_common_name = "ops"});
  ASSERT_THAT(ops, IsOk());
  EXPECT_EQ(ops->user, "ops");
  EXPECT_EQ(ops->method, "certificate");

  // A token wins over the certificate, and a bad token is not rescued by a good certificate.
  auto both = authenticator_->Authenticate(
      {.bearer_token = "alice-1", .certificate_common_name = "ops"});
  ASSERT_THAT(both, IsOk());
  EXPECT_EQ(both->user, "alice");
  EXPECT_EQ(authenticator_
                ->Authenticate({.bearer_token = "wrong", .certificate_common_name = "ops"})
                .status()
                .code(),
            absl::StatusCode::kUnauthenticated);
}

TEST_F(AuthenticatorTest, NothingValidIsUnauthenticated) {
  EXPECT_EQ(WithToken("wrong").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(authenticator_->Authenticate({}).status().code(), absl::StatusCode::kUnauthenticated);
  auto stranger = authenticator_->Authenticate({.certificate_common_name = "mallory"});
  EXPECT_EQ(stranger.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(stranger.status().message(), HasSubstr("CN=mallory"));
  auto malformed = authenticator_->Authenticate({.malformed_authorization = true});
  EXPECT_EQ(malformed.status().code(), absl::StatusCode::kUnauthenticated);
}

TEST_F(AuthenticatorTest, AChangedFileIsReadAtTheNextCheck) {
  Write(path_, Users("alice-2"));
  // Within the check interval the old table stands.
  clock_.Advance(absl::Milliseconds(500));
  EXPECT_THAT(WithToken("alice-1"), IsOk());
  clock_.Advance(absl::Seconds(1));
  EXPECT_EQ(WithToken("alice-1").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(WithToken("alice-2"), IsOk());
  EXPECT_EQ(authenticator_->reloads(), 2);

  // A broken file keeps the last good table and is reported.
  Write(path_, "users: [");
  EXPECT_EQ(authenticator_->ReloadIfChanged().code(), absl::StatusCode::kInvalidArgument);
  clock_.Advance(absl::Seconds(2));
  EXPECT_THAT(WithToken("alice-2"), IsOk());
}

TEST(AuthenticatorCreateTest, ABadFileStopsTheStartAndNoFileIsOpen) {
  ScopedTempDir dir;
  EXPECT_EQ(Authenticator::Create({.auth_file = dir.path() + "/missing.yaml"}).status().code(),
            absl::StatusCode::kNotFound);
  Write(dir.path() + "/bad.yaml", "users:\n  - name: a\n    roles: [god]\n");
  auto bad = Authenticator::Create({.auth_file = dir.path() + "/bad.yaml"});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("--auth_file"));

  auto open = Authenticator::Create({});
  ASSERT_THAT(open, IsOk());
  auto anyone = (*open)->Authenticate({});
  ASSERT_THAT(anyone, IsOk());
  EXPECT_EQ(anyone->method, "open");
  EXPECT_TRUE(anyone->Has(Role::kAdmin));
  EXPECT_TRUE(anyone->Has(Role::kNode));
}

TEST(AuthorizeTest, RolesAndOwnership) {
  const Principal viewer{.user = "v", .roles = static_cast<uint32_t>(Role::kViewer)};
  const Principal alice{.user = "alice", .roles = kUser};
  const Principal admin{.user = "ops", .roles = static_cast<uint32_t>(Role::kAdmin)};
  const Principal node{.user = "workers", .roles = static_cast<uint32_t>(Role::kNode)};
  auto code = [](const Principal& p, Action a, absl::string_view owner = "") {
    return Authorize(p, a, owner).code();
  };
  constexpr auto kOk = absl::StatusCode::kOk;
  constexpr auto kDenied = absl::StatusCode::kPermissionDenied;
  EXPECT_EQ(code(viewer, Action::kRead), kOk);
  EXPECT_EQ(code(viewer, Action::kSubmit), kDenied);
  EXPECT_EQ(code(viewer, Action::kManageJob, "v"), kDenied);
  EXPECT_EQ(code(viewer, Action::kNode), kDenied);
  EXPECT_EQ(code(alice, Action::kRead), kOk);
  EXPECT_EQ(code(alice, Action::kSubmit), kOk);
  EXPECT_EQ(code(alice, Action::kManageJob, "alice"), kOk);
  EXPECT_EQ(code(alice, Action::kManageJob, "bob"), kDenied);
  EXPECT_THAT(Authorize(alice, Action::kManageJob, "bob").message(), HasSubstr("job of bob"));
  EXPECT_EQ(code(alice, Action::kNode), kDenied);
  EXPECT_EQ(code(admin, Action::kManageJob, "bob"), kOk);
  EXPECT_EQ(code(admin, Action::kNode), kDenied);
  EXPECT_EQ(code(node, Action::kNode), kOk);
  EXPECT_EQ(code(node, Action::kRead), kDenied);
  EXPECT_EQ(code(node, Action::kSubmit), kDenied);
  // Draining and removing nodes: administrators only.
  EXPECT_EQ(code(admin, Action::kAdminister), kOk);
  EXPECT_EQ(code(alice, Action::kAdminister), kDenied);
  EXPECT_EQ(code(viewer, Action::kAdminister), kDenied);
  EXPECT_EQ(code(node, Action::kAdminister), kDenied);
  EXPECT_THAT(Authorize(alice, Action::kAdminister).message(), HasSubstr("needs admin"));
}

}  // namespace
}  // namespace tessera::coordinator
