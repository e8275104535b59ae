#include "client/queues_command.h"

#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::client {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// The whitespace-separated cells of each line.
std::vector<std::vector<std::string>> Cells(const std::string& table) {
  std::vector<std::vector<std::string>> rows;
  for (absl::string_view line : absl::StrSplit(table, '\n', absl::SkipEmpty())) {
    rows.push_back(absl::StrSplit(line, ' ', absl::SkipEmpty()));
  }
  return rows;
}

TEST(QueuesTableTest, OneRowPerQueueWithUseAgainstQuota) {
  v1::ListQueuesResponse response;
  response.set_queue_file("/etc/tessera/queues.yaml");
  v1::QueueStatus* nlp = response.add_queues();
  nlp->set_name("nlp");
  nlp->set_cohort("research");
  nlp->mutable_nominal()->set_gpus(32);
  nlp->mutable_used()->set_gpus(40);
  nlp->mutable_used()->set_cpu_slots(1);
  nlp->mutable_borrowed()->set_gpus(8);
  nlp->mutable_borrowed()->set_cpu_slots(1);
  nlp->set_fair_share(0.4567);
  nlp->set_pending_jobs(3);
  nlp->set_running_jobs(5);
  nlp->set_preemptions(2);
  v1::QueueStatus* solo = response.add_queues();
  solo->set_name("solo");
  solo->mutable_nominal()->set_cpu_slots(4);

  const auto rows = Cells(QueuesTable(response));
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_THAT(rows[0], ElementsAre("NAME", "COHORT", "GPUS", "CPU-SLOTS", "BORROWED", "PENDING",
                                   "RUNNING", "FAIR-SHARE", "PREEMPTED"));
  EXPECT_THAT(rows[1],
              ElementsAre("nlp", "research", "40/32", "1/0", "8gpu,1cpu", "3", "5", "0.457", "2"))
      << QueuesTable(response);
  // No cohort: nothing borrowed and no fair share to compare.
  EXPECT_THAT(rows[2], ElementsAre("solo", "-", "0/0", "0/4", "-", "0", "0", "-", "0"));
  EXPECT_THAT(QueuesTable(response), HasSubstr("queue file: /etc/tessera/queues.yaml\n"));
}

TEST(QueuesTableTest, WithoutAQueueFileTheImplicitQueueHasNoQuota) {
  v1::ListQueuesResponse response;
  v1::QueueStatus* queue = response.add_queues();
  queue->set_name("default");
  queue->mutable_used()->set_gpus(2);
  queue->set_running_jobs(1);
  const std::string table = QueuesTable(response);
  const auto rows = Cells(table);
  ASSERT_GE(rows.size(), 2u);
  EXPECT_THAT(rows[1], ElementsAre("default", "-", "2/-", "0/-", "-", "0", "1", "-", "0"));
  EXPECT_THAT(table, HasSubstr("no queue file"));
  EXPECT_THAT(table, StartsWith("NAME"));
}

// The column names docs/cli.md gives for `command`, in the order it gives them: the words in
// capitals of the command's row of the command table.
std::vector<std::string> DocumentedColumns(const std::string& command) {
  std::ifstream in(std::string(TESSERA_SOURCE_DIR) + "/docs/cli.md");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> columns;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StartsWith(line, absl::StrCat("| `", command, "` |"))) continue;
    const std::string row(line);
    const std::regex capitals(R"(\b[A-Z][A-Z-]*[A-Z]\b)");
    for (auto it = std::sregex_iterator(row.begin(), row.end(), capitals);
         it != std::sregex_iterator(); ++it) {
      columns.push_back(it->str());
    }
  }
  return columns;
}

// docs/cli.md names the table's columns in the order `tessera queues` prints them.
TEST(QueuesTableTest, TheDocumentedColumnsAreThePrintedOnesInOrder) {
  const std::vector<std::string> documented = DocumentedColumns("queues");
  ASSERT_FALSE(documented.empty()) << "docs/cli.md has no row for `queues`";
  EXPECT_EQ(documented, Cells(QueuesTable(v1::ListQueuesResponse())).front());
}

}  // namespace
}  // namespace tessera::client
