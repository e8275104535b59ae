// JobSeries: the coordinator's per-job Prometheus series, served by Collect at each scrape:
//   tessera_job_running{job_id}, tessera_job_last_step_timestamp_seconds{job_id},
//   tessera_job_last_checkpoint_timestamp_seconds{job_id} (a RUNNING job's liveness), and
//   tessera_rank_step_seconds{job_id,rank}, tessera_job_straggler_skew{job_id} (a running job's
//   straggler figures). CoordinatorMetrics documents their meaning.
// prometheus-cpp's Family::Remove walks every series of its family, so that with thousands of
// jobs running and hundreds ending a second, dropping their series cost more CPU than the
// heartbeats' logic (2.7% of the coordinator at 10,000 simulated nodes). Here a job's series are
// one entry of a hash map: adding or dropping them costs a hash lookup, and a scrape sorts them.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator {

class JobSeries final : public prometheus::Collectable {
 public:
  // `job_id` is RUNNING; a timestamp (unix seconds) given replaces the one set before, one not
  // given keeps it (none until the first).
  void SetRunning(const std::string& job_id, std::optional<double> last_step_time,
                  std::optional<double> last_checkpoint_time);
  // `job_id` left RUNNING: its liveness series go.
  void DropRunning(const std::string& job_id);
  // The straggler series are those of `stragglers` (by job_id), replacing the previous ones.
  void SetStragglers(const std::map<std::string, v1::StragglerReport>& stragglers);

  // The families above that have a series, each ordered by its labels.
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  struct Liveness {
    std::optional<double> last_step_time;
    std::optional<double> last_checkpoint_time;
  };
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Liveness> running_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, v1::StragglerReport> stragglers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::coordinator
