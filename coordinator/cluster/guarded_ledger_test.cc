// GuardedLedger: the ledger is reached only under its lock, Holds exclude one another, and a timed
// Hold adds the time it held the lock (the pass's lock_held_seconds).
#include "coordinator/cluster/guarded_ledger.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

Allocation OneRank(const std::string& node) {
  Allocation allocation;
  v1::RankPlacement& rank = allocation.ranks.emplace_back();
  rank.set_node_id(node);
  rank.set_gpu_index(-1);
  return allocation;
}

// Two threads change one allocation in place, each change under a Hold of its own: none is lost.
TEST(GuardedLedgerTest, HoldsExcludeOneAnother) {
  GuardedLedger ledger;
  {
    GuardedLedger::Hold held(&ledger);
    held->Add("job-a", OneRank("n1"));
  }
  constexpr int kChanges = 50000;
  auto change = [&] {
    for (int i = 0; i < kChanges; ++i) {
      GuardedLedger::Hold held(&ledger);
      ++held->Find("job-a")->start_step;
    }
  };
  std::thread first(change), second(change);
  first.join();
  second.join();
  GuardedLedger::Hold held(&ledger);
  EXPECT_EQ(held->Find("job-a")->start_step, 2 * kChanges);
  EXPECT_EQ(held->JobsOn("n1"), std::vector<std::string>{"job-a"});
}

TEST(GuardedLedgerTest, ATimedHoldAddsTheTimeHeld) {
  GuardedLedger ledger;
  double held_seconds = 0, longest = 0;
  for (int i = 0; i < 3; ++i) {
    GuardedLedger::Hold held(&ledger, &held_seconds, &longest);
    (*held).Add(absl::StrCat("job-", i), OneRank("n1"));
  }
  EXPECT_GT(held_seconds, 0);
  EXPECT_GT(longest, 0);
  EXPECT_LE(longest, held_seconds);
  GuardedLedger::Hold untimed(&ledger);
  EXPECT_EQ(untimed->JobsOn("n1").size(), 3u);
}

}  // namespace
}  // namespace tessera::coordinator
