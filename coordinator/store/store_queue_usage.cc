// The Store's saved fair-share usage: the `queue_usage` table, one row per queue, replaced whole
// by each save (through the group commit, on the writer); LoadQueueUsage runs under a
// Database::ReadLock.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "coordinator/store/store.h"
#include "coordinator/store/store_database.h"

namespace tessera::coordinator {

absl::Status Store::SaveQueueUsage(const SavedQueueUsage& usage) {
  for (const auto& [queue, unused] : usage.queues) {
    if (queue.empty()) return absl::InvalidArgumentError("store: queue usage: empty queue name");
  }
  Database::QueuedWrite write;
  write.apply = [&usage](DbConnection& writer) -> absl::Status {
    const std::string operation = "save queue usage";
    RETURN_IF_ERROR(writer.Exec("DELETE FROM queue_usage", operation));
    constexpr char kInsert[] = R"sql(
INSERT INTO queue_usage (queue, gpu_seconds, cpu_slot_seconds, as_of_ns) VALUES (?1, ?2, ?3, ?4)
)sql";
    const int64_t as_of_ns = absl::ToUnixNanos(usage.as_of);
    for (const auto& [queue, queue_usage] : usage.queues) {
      const std::string row_operation = absl::StrCat(operation, " of queue ", queue);
      ASSIGN_OR_RETURN(Statement insert, writer.Prepare(kInsert, row_operation));
      insert.BindText(1, queue);
      insert.BindDouble(2, queue_usage.gpu_seconds);
      insert.BindDouble(3, queue_usage.cpu_slot_seconds);
      insert.Bind(4, as_of_ns);
      RETURN_IF_ERROR(insert.Run());
    }
    return absl::OkStatus();
  };
  database_->GroupCommit({&write});
  return write.status;
}

absl::StatusOr<std::optional<SavedQueueUsage>> Store::LoadQueueUsage() {
  Database::ReadLock lock(*database_);
  DbConnection& reader = lock.connection();
  const std::string operation = "load queue usage";
  ASSIGN_OR_RETURN(Statement select,
                   reader.Prepare("SELECT queue, gpu_seconds, cpu_slot_seconds, as_of_ns "
                                  "FROM queue_usage ORDER BY queue",
                                  operation));
  std::optional<SavedQueueUsage> usage;
  while (true) {
    ASSIGN_OR_RETURN(bool has_row, select.Step());
    if (!has_row) break;
    if (!usage.has_value()) usage.emplace().as_of = absl::InfinitePast();
    SavedQueueUsage::Usage& queue = usage->queues[select.ColumnText(0)];
    queue.gpu_seconds = select.ColumnDouble(1);
    queue.cpu_slot_seconds = select.ColumnDouble(2);
    // One save writes one time; rows of different times cannot come from SaveQueueUsage.
    usage->as_of = std::max(usage->as_of, absl::FromUnixNanos(select.ColumnInt64(3)));
  }
  return usage;
}

}  // namespace tessera::coordinator
