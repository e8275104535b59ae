// The Store's job events: the `job_events` table, numbered 1, 2, 3... per job without gaps, a
// write's events in one row since schema version 3. Store's reads run under a
// Database::ReadLock; AppendEvents (store_tables.h) runs on the writer in a group commit.
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "coordinator/store/store.h"
#include "coordinator/store/store_database.h"
#include "coordinator/store/store_tables.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

namespace tessera::coordinator {
namespace {

void SetNow(google::protobuf::Timestamp& time) {
  const absl::Duration since_epoch = absl::Now() - absl::UnixEpoch();
  const int64_t seconds = absl::ToInt64Seconds(since_epoch);
  time.set_seconds(seconds);
  time.set_nanos(
      static_cast<int32_t>(absl::ToInt64Nanoseconds(since_epoch - absl::Seconds(seconds))));
}

// The blob of a job_events row holding several events (schema v3): each event's size as a
// varint32, then the event.
std::string EncodeEvents(const std::vector<v1::JobEvent>& events) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    for (const v1::JobEvent& event : events) {
      coded.WriteVarint32(static_cast<uint32_t>(event.ByteSizeLong()));
      event.SerializeWithCachedSizes(&coded);
    }
  }
  return out;
}

// Appends the events of such a blob to `events`; false when it does not parse.
bool DecodeEvents(absl::string_view blob, std::vector<v1::JobEvent>& events) {
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(blob.data()),
                                            static_cast<int>(blob.size()));
  while (in.CurrentPosition() < static_cast<int>(blob.size())) {
    uint32_t length = 0;
    if (!in.ReadVarint32(&length)) return false;
    const auto limit = in.PushLimit(static_cast<int>(length));
    if (!events.emplace_back().ParseFromCodedStream(&in) || !in.ConsumedEntireMessage()) {
      return false;
    }
    in.PopLimit(limit);
  }
  return true;
}

}  // namespace

namespace store_internal {

absl::StatusOr<int64_t> LastEventSequence(DbConnection& connection, const std::string& job_id,
                                          absl::string_view operation) {
  // The last row's last event (schema v3: a row may hold several).
  ASSIGN_OR_RETURN(Statement select, connection.Prepare(R"sql(
SELECT COALESCE(last_sequence, sequence) FROM job_events WHERE job_id = ?1
ORDER BY sequence DESC LIMIT 1)sql",
                                                        operation));
  select.BindText(1, job_id);
  ASSIGN_OR_RETURN(bool has_row, select.Step());
  return has_row ? select.ColumnInt64(0) : 0;
}

absl::Status AppendEvents(DbConnection& writer, const std::string& job_id,
                          const std::vector<v1::JobEvent>& events,
                          std::vector<v1::JobEvent>& stored_events) {
  const std::string read = absl::StrCat("read last event sequence of ", job_id);
  ASSIGN_OR_RETURN(int64_t sequence, LastEventSequence(writer, job_id, read));
  const int64_t first = sequence + 1;
  stored_events.reserve(events.size());
  for (const v1::JobEvent& event : events) {
    v1::JobEvent& stored = stored_events.emplace_back(event);
    stored.set_job_id(job_id);
    stored.set_sequence(++sequence);
    if (!stored.has_time()) SetNow(*stored.mutable_time());
  }
  // One row for the write's events (schema v3).
  const std::string operation = absl::StrCat("insert events for ", job_id);
  ASSIGN_OR_RETURN(Statement insert, writer.Prepare(R"sql(
INSERT INTO job_events (job_id, sequence, last_sequence, event) VALUES (?1, ?2, ?3, ?4))sql",
                                                    operation));
  insert.BindText(1, job_id);
  insert.Bind(2, first);
  if (stored_events.size() == 1) {
    insert.BindMessage(4, stored_events.front());  // last_sequence NULL: one event
  } else {
    insert.Bind(3, sequence);
    insert.BindBlob(4, EncodeEvents(stored_events));
  }
  return insert.Run();
}

}  // namespace store_internal

absl::StatusOr<std::vector<v1::JobEvent>> Store::ReadEvents(const std::string& job_id,
                                                            int64_t after_sequence, int limit) {
  Database::ReadLock lock(*database_);
  DbConnection& reader = lock.connection();
  const std::string operation = absl::StrCat("read events of ", job_id);
  // From the row that holds event after_sequence + 1 (the last row that starts at or before it).
  ASSIGN_OR_RETURN(Statement select, reader.Prepare(R"sql(
SELECT sequence, last_sequence, event FROM job_events
WHERE job_id = ?1 AND sequence >= (
  SELECT COALESCE(MAX(sequence), 0) FROM job_events WHERE job_id = ?1 AND sequence <= ?2 + 1)
ORDER BY sequence)sql",
                                                    operation));
  select.BindText(1, job_id);
  select.Bind(2, after_sequence);
  std::vector<v1::JobEvent> events;
  while (limit <= 0 || static_cast<int>(events.size()) < limit) {
    ASSIGN_OR_RETURN(bool has_row, select.Step());
    if (!has_row) break;
    const int64_t sequence = select.ColumnInt64(0);
    const std::string what =
        absl::StrCat(operation, ": event ", sequence, " of job '", job_id, "' in table job_events");
    std::vector<v1::JobEvent> row;
    if (select.ColumnIsNull(1)) {
      RETURN_IF_ERROR(select.ColumnMessage(2, row.emplace_back(), what));
    } else if (!DecodeEvents(select.ColumnBytes(2), row)) {
      return absl::DataLossError(absl::StrCat("store: ", what, " (events ", sequence, " to ",
                                              select.ColumnInt64(1), ") does not parse"));
    }
    for (v1::JobEvent& event : row) {
      if (event.sequence() <= after_sequence) continue;
      if (limit > 0 && static_cast<int>(events.size()) >= limit) break;
      events.push_back(std::move(event));
    }
  }
  return events;
}

absl::StatusOr<int64_t> Store::LastEventSequence(const std::string& job_id) {
  Database::ReadLock lock(*database_);
  const std::string operation = absl::StrCat("read last event sequence of ", job_id);
  return store_internal::LastEventSequence(lock.connection(), job_id, operation);
}

}  // namespace tessera::coordinator
