// Credentials and transport on the real tessera-coordinator: tokens (the auth file) and the
// serving certificate rotate without a restart, a broken auth file keeps the previous users, and
// plaintext beyond loopback needs --insecure (bad TLS files stop the start, naming the flag).


#include <signal.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/security_e2e_fixture.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

TEST_F(SecurityTest, TokensAndCertificatesRotateWithoutARestart) {
  StartCoordinator();
  const pid_t pid = coordinator_->pid();
  const Caller old_alice = Token("alice", kAliceToken);
  const Caller new_alice = Token("alice", "alice-rotated-token-42");
  auto list = [](const Caller& caller) {
    v1::ListJobsResponse response;
    return v1::Coordinator::NewStub(caller.channel)
        ->ListJobs(Context(caller).get(), {}, &response)
        .error_code();
  };
  EXPECT_EQ(list(old_alice), Code::OK);
  EXPECT_EQ(list(new_alice), Code::UNAUTHENTICATED);
  WriteAtomically(auth_file_, AuthFile("alice-rotated-token-42"));
  testing::WaitUntil([&] { return list(new_alice) == Code::OK; }, absl::Seconds(10),
                     absl::Milliseconds(100));
  EXPECT_EQ(list(new_alice), Code::OK);
  EXPECT_EQ(list(old_alice), Code::UNAUTHENTICATED);

  // A broken auth file keeps the previous users: calls are answered as before until (and after)
  // the coordinator has read it and said so. (The file is checked at most once a second, when a
  // call comes.)
  WriteAtomically(auth_file_, "users: [oops\n");
  absl::StatusOr<std::string> kept;
  const bool read = testing::WaitUntil(
      [&] {
        EXPECT_EQ(list(new_alice), Code::OK);
        kept = coordinator_->WaitForStderrLine("keeping the previous users",
                                               absl::Milliseconds(100));
        return kept.ok();
      },
      absl::Seconds(30), absl::Milliseconds(100));
  ASSERT_TRUE(read) << kept.status();
  EXPECT_EQ(list(new_alice), Code::OK);

  // The serving certificate is replaced (cert-manager renews it): new connections see the new
  // one, with the same process.
  auto server_cn = [&]() -> std::string {
    Caller caller = Token("alice", "alice-rotated-token-42");
    auto context = Context(caller);
    v1::ListJobsResponse response;
    if (!v1::Coordinator::NewStub(caller.channel)->ListJobs(context.get(), {}, &response).ok()) {
      return "";
    }
    return PeerCommonName(context->auth_context().get()).value_or("");
  };
  EXPECT_EQ(server_cn(), "tessera-coordinator");
  PemFiles renewed = Issue("coordinator-renewed", "tessera-coordinator-renewed");
  CopyAtomically(renewed.key_file, coordinator_cert_.key_file);
  CopyAtomically(renewed.cert_file, coordinator_cert_.cert_file);
  testing::WaitUntil([&] { return server_cn() == "tessera-coordinator-renewed"; },
                     absl::Seconds(10), absl::Milliseconds(200));
  EXPECT_EQ(server_cn(), "tessera-coordinator-renewed");
  EXPECT_EQ(coordinator_->pid(), pid);
  EXPECT_EQ(kill(pid, 0), 0);
}

TEST_F(SecurityTest, PlaintextBeyondLoopbackNeedsInsecure) {
  std::vector<std::string> argv = {BinDir() + "/tessera-coordinator", "--listen=0.0.0.0:0",
                                   "--metrics_listen=", "--state=" + dir_.path() + "/plain.db"};
  auto refused = Subprocess::Start(argv);
  ASSERT_THAT(refused, IsOk());
  auto exit = refused->Wait(absl::Seconds(30));
  ASSERT_THAT(exit, IsOk());
  EXPECT_NE(exit->exit_code, 0);
  EXPECT_THAT(refused->stderr_text(), HasSubstr("--insecure"));

  argv.push_back("--insecure");
  auto insecure = Subprocess::Start(argv);
  ASSERT_THAT(insecure, IsOk());
  ASSERT_THAT(insecure->WaitForStderrLine("serving gRPC on"), IsOk());
  EXPECT_THAT(insecure->stderr_text(), HasSubstr("WARNING: serving plaintext"));
  EXPECT_THAT(insecure->stderr_text(), HasSubstr("WARNING: no --auth_file"));

  // Bad TLS files stop the coordinator at start, naming the flag.
  std::vector<std::string> bad = {BinDir() + "/tessera-coordinator", "--listen=127.0.0.1:0",
                                  "--metrics_listen=", "--state=" + dir_.path() + "/bad.db",
                                  "--tls_cert=" + coordinator_cert_.cert_file,
                                  "--tls_key=" + admin_cert_.key_file};
  auto mismatched = Subprocess::Start(bad);
  ASSERT_THAT(mismatched, IsOk());
  exit = mismatched->Wait(absl::Seconds(30));
  ASSERT_THAT(exit, IsOk());
  EXPECT_NE(exit->exit_code, 0);
  EXPECT_THAT(mismatched->stderr_text(), HasSubstr("--tls_key"));
}

}  // namespace
}  // namespace tessera
