// JobManager: the coordinator's job lifecycle. It validates and plans
// submissions, persists every change through the Store (job row, numbered
// events, metric points, checkpoints in one transaction), serves reads, and
// tells watchers when a job has new events.
//
// Thread safety: all methods may be called from any thread. Changes to one
// job are serialized by a mutex of its own (KeyedMutex) so that its events
// are numbered in the order they happen, while changes to different jobs
// overlap and share the Store's group commits; submissions with the same
// request id are serialized the same way. Reads go
// straight to the Store. Watcher callbacks run outside the locks.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "coordinator/jobs/keyed_mutex.h"
#include "coordinator/queues/queue_file.h"
#include "coordinator/store/store.h"
#include "tessera/v1/coordinator_service.pb.h"

namespace tessera::coordinator {

// Is `state` one of SUCCEEDED, FAILED, CANCELLED?
bool IsTerminal(v1::JobState state);

class JobManager {
 public:
  // `store` must outlive the manager. `clock` (must outlive it) stamps create, start and end
  // times. `queues` (may be null: one implicit queue; must outlive it) routes submissions.
  explicit JobManager(Store* store, Clock* clock = Clock::Real(), QueueFile* queues = nullptr);

  // Validates (INVALID_ARGUMENT naming the field), plans, routes to a queue (Job.queue; NOT_FOUND
  // for an unknown queue, PERMISSION_DENIED for one `owner` may not submit into,
  // FAILED_PRECONDITION for a gang its queue's quota can never hold) and stores a new PENDING job
  // owned by `owner`. A request_id `owner` used before returns that job instead (request ids are
  // per owner: another user's id never returns someone else's job).
  absl::StatusOr<v1::Job> Submit(const v1::JobSpec& spec, const std::string& request_id,
                                 const std::string& owner = "anonymous");
  // NOT_FOUND for an unknown id.
  absl::StatusOr<v1::Job> Get(const std::string& job_id);
  absl::StatusOr<JobPage> List(const std::vector<v1::JobState>& states, int page_size,
                               const std::string& page_token);
  // Moves a non-terminal job to CANCELLED; a terminal job is returned
  // unchanged.
  absl::StatusOr<v1::Job> Cancel(const std::string& job_id, const std::string& reason);
  // Moves a job to `state` with `reason`, recording the event after
  // `preceding_events` (e.g. the failures that caused it), all in one
  // transaction. Terminal jobs do not move (FAILED_PRECONDITION).
  absl::StatusOr<v1::Job> Transition(const std::string& job_id, v1::JobState state,
                                     const std::string& reason,
                                     const std::function<void(v1::Job&)>& mutate = nullptr,
                                     const std::vector<v1::JobEvent>& preceding_events = {});
  // Transition, made only when `precondition` is OK for the job as stored (e.g. "SCHEDULED in
  // attempt 3"), checked on the one read the transition makes, under the job's lock: nothing can
  // move the job between the check and the write. Its error is returned as is, and nothing stored.
  absl::StatusOr<v1::Job> TransitionIf(
      const std::string& job_id, const std::function<absl::Status(const v1::Job&)>& precondition,
      v1::JobState state, const std::string& reason,
      const std::function<void(v1::Job&)>& mutate = nullptr);
  // One Transition of a batch (TransitionAll).
  struct TransitionRequest {
    std::string job_id;
    v1::JobState state = v1::JOB_STATE_UNSPECIFIED;
    std::string reason;
    std::function<void(v1::Job&)> mutate;
    // Checked on the stored job under its lock before anything changes; an error is the
    // request's result and nothing of it is stored (e.g. the job moved on meanwhile).
    std::function<absl::Status(const v1::Job&)> precondition;
  };
  // Transition for every request, all stored in ONE store transaction (one
  // fsync): result i is what Transition(requests[i]) would return, and a
  // request that fails (a terminal job, a store error) does not stop the
  // others. At most one request per job.
  std::vector<absl::StatusOr<v1::Job>> TransitionAll(
      const std::vector<TransitionRequest>& requests);
  // Records trainer reports for a job (metrics, evals, checkpoints) with
  // their events. Metric points are idempotent per step, and a point at or
  // below the job's current_step adds no event: a resent point is not shown
  // twice (a restart sets current_step back to the step it resumes from).
  // `attempt`, where given, is the attempt that sent them: the metrics and
  // evaluations of an attempt the job has since replaced are dropped (a
  // partitioned worker relaying what it queued before the restart); the new
  // attempt trains those steps again or reports them again from the
  // checkpoint it resumed from (TrainerTask.metrics_complete_through_step).
  // Its checkpoints are kept: they were committed under the fence.
  absl::Status RecordReports(const std::string& job_id, const std::vector<v1::StepMetrics>& metrics,
                             const std::vector<v1::EvalMetrics>& evals,
                             const std::vector<v1::Checkpoint>& checkpoints,
                             std::optional<int32_t> attempt = std::nullopt);

  // Metric points of steps [from_step, to_step] (0 = open), downsampled to at
  // most max_points (0 = all): each point the mean of an equal run of
  // consecutive steps, stamped with the run's last step.
  absl::StatusOr<v1::GetMetricsResponse> Metrics(const v1::GetMetricsRequest& request);
  absl::StatusOr<std::vector<v1::Checkpoint>> Checkpoints(const std::string& job_id);
  // Stored events after `after_sequence`, at most `limit`.
  absl::StatusOr<std::vector<v1::JobEvent>> Events(const std::string& job_id,
                                                   int64_t after_sequence, int limit);

  // Calls `listener` (from the thread that committed) after new events of
  // `job_id` are stored. Returns a handle for Unsubscribe.
  int64_t Subscribe(const std::string& job_id, std::function<void()> listener);
  void Unsubscribe(int64_t handle);

  // Calls `observer` with a job as stored each time a change of it commits (submission, state
  // change, reports), from the committing thread while the job's own lock is held, so one job's
  // calls come in commit order. For figures kept up to date without reading the store (the
  // coordinator's per-job metrics). One observer; may be set at any time; null removes it.
  void SetCommitObserver(std::function<void(const v1::Job&)> observer);

  // Shutdown: from now on closed() is true, and every listener is called once so that the
  // streams following events end (a watcher resumes on the next coordinator) instead of holding
  // the gRPC server's shutdown for its whole grace period.
  void CloseWatches();
  bool closed() const { return closed_.load(); }

 private:
  // Transition and TransitionIf (`precondition` null: any non-terminal job); takes the job's lock.
  absl::StatusOr<v1::Job> TransitionChecked(
      const std::string& job_id, const std::function<absl::Status(const v1::Job&)>& precondition,
      v1::JobState state, const std::string& reason, const std::function<void(v1::Job&)>& mutate,
      const std::vector<v1::JobEvent>& preceding_events);
  // Commits `write`, tells the commit observer and wakes the job's watchers.
  absl::StatusOr<std::vector<v1::JobEvent>> CommitAndNotify(const JobWrite& write);

  void NotifyWatchers(const std::string& job_id);
  google::protobuf::Timestamp NowTimestamp() const;

  // The queue a submission goes to (QueueFor) when its quota can ever hold its gang.
  absl::StatusOr<std::string> RouteToQueue(const v1::JobSpec& spec, const std::string& owner,
                                           int world_size) const;

  Store* store_;
  Clock* const clock_;
  QueueFile* const queues_;
  // Serialize read-modify-write of each job, by job id.
  KeyedMutex job_locks_;
  // Serialize submissions with the same request id.
  KeyedMutex submit_locks_;
  std::atomic<bool> closed_{false};
  absl::Mutex listeners_mu_;
  int64_t next_listener_ ABSL_GUARDED_BY(listeners_mu_) = 1;
  std::map<int64_t, std::pair<std::string, std::function<void()>>> listeners_
      ABSL_GUARDED_BY(listeners_mu_);
  std::function<void(const v1::Job&)> commit_observer_ ABSL_GUARDED_BY(listeners_mu_);

  // Calls the commit observer, if any, with `job` (after it committed).
  void ObserveCommit(const v1::Job& job);
};

// Downsamples step metrics to at most `max_points` (see JobManager::Metrics).
std::vector<v1::StepMetrics> Downsample(const std::vector<v1::StepMetrics>& points, int max_points);

}  // namespace tessera::coordinator
