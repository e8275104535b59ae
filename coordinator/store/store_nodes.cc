// The Store's worker nodes: the `nodes` table, one row per node_id. Writes go through the group
// commit (on the writer); ListNodes runs under a Database::ReadLock.
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "coordinator/store/store.h"
#include "coordinator/store/store_database.h"

namespace tessera::coordinator {

absl::Status Store::PutNode(const v1::Node& node) {
  if (node.node_id().empty()) return absl::InvalidArgumentError("store: node.node_id is empty");
  RETURN_IF_ERROR(InjectedFailure(node.node_id()));
  Database::QueuedWrite write;
  write.apply = [&node](DbConnection& writer) -> absl::Status {
    const std::string operation = absl::StrCat("put node ", node.node_id());
    ASSIGN_OR_RETURN(Statement upsert, writer.Prepare(R"sql(
INSERT INTO nodes (node_id, node) VALUES (?1, ?2)
ON CONFLICT (node_id) DO UPDATE SET node = excluded.node)sql",
                                                      operation));
    upsert.BindText(1, node.node_id());
    upsert.BindMessage(2, node);
    return upsert.Run();
  };
  database_->GroupCommit({&write});
  return write.status;
}

absl::Status Store::DeleteNode(const std::string& node_id) {
  Database::QueuedWrite write;
  write.apply = [&node_id](DbConnection& writer) -> absl::Status {
    const std::string operation = absl::StrCat("delete node ", node_id);
    ASSIGN_OR_RETURN(Statement remove,
                     writer.Prepare("DELETE FROM nodes WHERE node_id = ?1", operation));
    remove.BindText(1, node_id);
    return remove.Run();
  };
  database_->GroupCommit({&write});
  return write.status;
}

absl::StatusOr<std::vector<v1::Node>> Store::ListNodes() {
  Database::ReadLock lock(*database_);
  DbConnection& reader = lock.connection();
  const std::string operation = "list nodes";
  ASSIGN_OR_RETURN(Statement select,
                   reader.Prepare("SELECT node_id, node FROM nodes ORDER BY node_id", operation));
  std::vector<v1::Node> nodes;
  while (true) {
    ASSIGN_OR_RETURN(bool has_row, select.Step());
    if (!has_row) break;
    const std::string node_id = select.ColumnText(0);
    RETURN_IF_ERROR(select.ColumnMessage(
        1, nodes.emplace_back(), absl::StrCat(operation, ": node '", node_id, "' in table nodes")));
  }
  return nodes;
}

}  // namespace tessera::coordinator
