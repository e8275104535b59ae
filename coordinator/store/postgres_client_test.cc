// The one mapping of PostgreSQL failures to statuses that the store and the leader election share
// (postgres_client.h). No server needed: SQLSTATEs from PostgreSQL's appendix A.
#include "coordinator/store/postgres_client.h"

#include <string>

#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

absl::StatusCode Code(const char* state) {
  return StatusFromSqlState(state, std::string("m")).code();
}

TEST(StatusFromSqlStateTest, TransientFailuresAreWorthRetrying) {
  for (const char* state :
       {"", "08006", "08001", "57014", "57P01", "57P03", "40001", "40P01", "55P03", "53300"}) {
    EXPECT_EQ(Code(state), absl::StatusCode::kUnavailable) << "SQLSTATE '" << state << "'";
  }
}

TEST(StatusFromSqlStateTest, OtherFailuresSayWhatIsWrong) {
  EXPECT_EQ(Code("23505"), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(Code("53100"), absl::StatusCode::kResourceExhausted);  // disk full
  EXPECT_EQ(Code("28P01"), absl::StatusCode::kPermissionDenied);   // bad password
  EXPECT_EQ(Code("XX001"), absl::StatusCode::kDataLoss);
  EXPECT_EQ(Code("3D000"), absl::StatusCode::kFailedPrecondition);  // no such database
  EXPECT_EQ(Code("42P01"), absl::StatusCode::kFailedPrecondition);  // no such table
  EXPECT_EQ(Code("42601"), absl::StatusCode::kInternal);            // syntax error
  EXPECT_EQ(StatusFromSqlState("42601", "leader election: boom").message(),
            "leader election: boom");
}

TEST(PgMessageTest, DropsTheTrailingNewline) {
  EXPECT_EQ(PgMessage("FATAL:  no such database\n"), "FATAL:  no such database");
  EXPECT_EQ(PgMessage(nullptr), "");
}

}  // namespace
}  // namespace tessera::coordinator
