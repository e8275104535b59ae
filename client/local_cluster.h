// LocalCluster: `tessera local`. Tokenizes a corpus into token shards (once),
// starts a coordinator and workers on 127.0.0.1 as child processes of the CLI
// (binaries beside it), with their state, logs and work directories under one
// directory, and stops them (workers first, SIGTERM) when destroyed.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tessera::client {

struct LocalClusterOptions {
  // Directory of tessera-coordinator and tessera-worker.
  std::string bin_dir;
  // State, logs and work directories go here (created).
  std::string dir;
  int workers = 1;
  // CPU trainer slots per worker.
  int cpu_slots = 2;
  // A text file `tessera-trainer prepare` tokenizes into <dir>/data (skipped when that directory
  // already holds train shards); empty: nothing is prepared.
  std::string corpus;
};

// The corpus the build puts beside the binaries in `bin_dir`
// (<bin_dir>/../share/tessera/corpus/*.txt); empty when there is none.
std::string BundledCorpus(const std::string& bin_dir);

struct LocalDaemon {
  std::string name;
  pid_t pid = -1;
  std::string address;
  int metrics_port = 0;
  std::string log_path;
};

// Thread safety: one thread.
class LocalCluster {
 public:
  // Starts everything and waits until each daemon serves; UNAVAILABLE with
  // the daemon's log when one does not come up.
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(const LocalClusterOptions& options);
  ~LocalCluster();

  const LocalDaemon& coordinator() const { return daemons_.front(); }
  // Where the corpus was prepared (<dir>/data); empty when none was asked for.
  const std::string& data_dir() const { return data_dir_; }
  const std::vector<LocalDaemon>& daemons() const { return daemons_; }

 private:
  LocalCluster() = default;
  absl::StatusOr<LocalDaemon> Spawn(const std::string& name, std::vector<std::string> argv,
                                    const std::string& log_path);
  std::vector<LocalDaemon> daemons_;
  std::string data_dir_;
};

}  // namespace tessera::client
