#include "client/queues_command.h"

#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace tessera::client {
namespace {

// "used/nominal", or "used/-" for a queue without quota.
std::string UsedOfNominal(int64_t used, int64_t nominal, bool quota) {
  return quota ? absl::StrCat(used, "/", nominal) : absl::StrCat(used, "/-");
}

std::string Borrowed(const v1::QueueResources& borrowed) {
  std::vector<std::string> parts;
  if (borrowed.gpus() > 0) parts.push_back(absl::StrCat(borrowed.gpus(), "gpu"));
  if (borrowed.cpu_slots() > 0) parts.push_back(absl::StrCat(borrowed.cpu_slots(), "cpu"));
  return parts.empty() ? "-" : absl::StrJoin(parts, ",");
}

}  // namespace

std::string QueuesTable(const v1::ListQueuesResponse& response) {
  const bool quota = !response.queue_file().empty();
  constexpr char kRow[] = "%-20s %-12s %-10s %-10s %-12s %7s %7s %10s %9s\n";
  std::string out = absl::StrFormat(kRow, "NAME", "COHORT", "GPUS", "CPU-SLOTS", "BORROWED",
                                    "PENDING", "RUNNING", "FAIR-SHARE", "PREEMPTED");
  for (const v1::QueueStatus& queue : response.queues()) {
    absl::StrAppendFormat(
        &out, kRow, queue.name(), queue.cohort().empty() ? "-" : queue.cohort(),
        UsedOfNominal(queue.used().gpus(), queue.nominal().gpus(), quota),
        UsedOfNominal(queue.used().cpu_slots(), queue.nominal().cpu_slots(), quota),
        Borrowed(queue.borrowed()), absl::StrCat(queue.pending_jobs()),
        absl::StrCat(queue.running_jobs()),
        queue.cohort().empty() ? std::string("-") : absl::StrFormat("%.3f", queue.fair_share()),
        absl::StrCat(queue.preemptions()));
  }
  absl::StrAppend(&out,
                  quota ? absl::StrCat("queue file: ", response.queue_file())
                        : std::string("no queue file: every job goes to the queue "
                                      "'default', without quota"),
                  "\n");
  return out;
}

}  // namespace tessera::client
