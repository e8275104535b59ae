// The real tessera-coordinator's job API over gRPC: submit, get, list, cancel and watch, paging,
// idempotent and bad or oversized submissions, stop orders, logs relayed from a worker, what
// survives a SIGKILL of the coordinator, and queues with quotas (--queue_file) and their
// fair-share usage kept across a restart.


#include <signal.h>
#include <sqlite3.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tessera/v1/worker_service.grpc.pb.h"
#include "tests/coordinator_fixture.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

TEST_F(CoordinatorTest, SubmitGetListCancelWatch) {
  v1::Job job = Submit(ValidSpec("first"));
  ASSERT_FALSE(job.job_id().empty());
  EXPECT_EQ(job.state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(job.plan().world_size(), 2);
  EXPECT_EQ(job.plan().gradient_accumulation_steps(), 2);  // 8 / (2 x dp 2)

  v1::Job fetched;
  ASSERT_TRUE(Get(job.job_id(), &fetched).ok());
  EXPECT_EQ(fetched.spec().name(), "first");

  v1::CancelJobRequest cancel;
  cancel.set_job_id(job.job_id());
  cancel.set_reason("test");
  v1::CancelJobResponse cancelled;
  ASSERT_TRUE(stub_->CancelJob(Context().get(), cancel, &cancelled).ok());
  EXPECT_EQ(cancelled.job().state(), v1::JOB_STATE_CANCELLED);
  EXPECT_THAT(cancelled.job().reason(), HasSubstr("test"));
  // Cancelling again changes nothing.
  ASSERT_TRUE(stub_->CancelJob(Context().get(), cancel, &cancelled).ok());
  EXPECT_EQ(cancelled.job().state(), v1::JOB_STATE_CANCELLED);

  // The whole history, then the stream ends because the job is terminal.
  auto events = Watch(job.job_id(), 0);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].sequence(), 1);
  EXPECT_EQ(events[0].state_change().new_state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(events[1].sequence(), 2);
  EXPECT_EQ(events[1].state_change().new_state(), v1::JOB_STATE_CANCELLED);
  // Reconnecting after sequence 1 misses nothing and repeats nothing.
  auto rest = Watch(job.job_id(), 1);
  ASSERT_EQ(rest.size(), 1u);
  EXPECT_EQ(rest[0].sequence(), 2);

  v1::ListJobsRequest list;
  list.add_states(v1::JOB_STATE_CANCELLED);
  v1::ListJobsResponse listed;
  ASSERT_TRUE(stub_->ListJobs(Context().get(), list, &listed).ok());
  ASSERT_EQ(listed.jobs_size(), 1);
  EXPECT_EQ(listed.jobs(0).job_id(), job.job_id());
}

TEST_F(CoordinatorTest, WatchFollowsLiveChanges) {
  v1::Job job = Submit(ValidSpec("live"));
  v1::WatchJobRequest request;
  request.set_job_id(job.job_id());
  auto context = Context(30);
  auto reader = stub_->WatchJob(context.get(), request);
  v1::JobEvent event;
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.state_change().new_state(), v1::JOB_STATE_PENDING);
  // The stream stays open until something happens.
  v1::CancelJobRequest cancel;
  cancel.set_job_id(job.job_id());
  v1::CancelJobResponse cancelled;
  ASSERT_TRUE(stub_->CancelJob(Context().get(), cancel, &cancelled).ok());
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.state_change().new_state(), v1::JOB_STATE_CANCELLED);
  EXPECT_FALSE(reader->Read(&event));
  EXPECT_TRUE(reader->Finish().ok());
}

TEST_F(CoordinatorTest, PaginationVisitsEveryJobOnce) {
  std::set<std::string> submitted;
  for (int i = 0; i < 7; ++i) submitted.insert(Submit(ValidSpec(absl::StrCat("job-", i))).job_id());
  std::set<std::string> seen;
  std::string token;
  int pages = 0;
  do {
    v1::ListJobsRequest request;
    request.set_page_size(3);
    request.set_page_token(token);
    v1::ListJobsResponse response;
    ASSERT_TRUE(stub_->ListJobs(Context().get(), request, &response).ok());
    for (const auto& job : response.jobs()) EXPECT_TRUE(seen.insert(job.job_id()).second);
    token = response.next_page_token();
    ++pages;
  } while (!token.empty() && pages < 10);
  EXPECT_EQ(seen, submitted);
  EXPECT_EQ(pages, 3);
}

TEST_F(CoordinatorTest, IdempotentSubmission) {
  v1::Job a = Submit(ValidSpec("same"), "request-42");
  v1::Job b = Submit(ValidSpec("same"), "request-42");
  EXPECT_EQ(a.job_id(), b.job_id());
}

TEST_F(CoordinatorTest, BadInputGetsTheRightCode) {
  v1::SubmitJobRequest bad;
  *bad.mutable_spec() = ValidSpec("bad");
  bad.mutable_spec()->mutable_batch()->set_global_batch_size(7);
  v1::SubmitJobResponse response;
  grpc::Status status = stub_->SubmitJob(Context().get(), bad, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("batch.global_batch_size"));

  *bad.mutable_spec() = ValidSpec("bad");
  bad.mutable_spec()->mutable_model()->set_preset("gpt5");
  status = stub_->SubmitJob(Context().get(), bad, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("model.preset"));

  v1::Job job;
  EXPECT_EQ(Get("job-ffffffff", &job).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Get("", &job).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  v1::WatchJobRequest watch;
  watch.set_job_id("job-ffffffff");
  auto context = Context();
  auto reader = stub_->WatchJob(context.get(), watch);
  v1::JobEvent event;
  EXPECT_FALSE(reader->Read(&event));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::NOT_FOUND);

  v1::GetMetricsRequest metrics;
  metrics.set_job_id("job-ffffffff");
  v1::GetMetricsResponse metrics_response;
  EXPECT_EQ(stub_->GetMetrics(Context().get(), metrics, &metrics_response).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(CoordinatorTest, OversizedRequestsAreRefused) {
  v1::SubmitJobRequest huge;
  *huge.mutable_spec() = ValidSpec("huge");
  (*huge.mutable_spec()->mutable_labels())["blob"] = std::string(65 << 20, 'x');
  v1::SubmitJobResponse response;
  grpc::Status status = stub_->SubmitJob(Context(30).get(), huge, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  // The daemon is unharmed.
  v1::Job job = Submit(ValidSpec("after-huge"));
  EXPECT_FALSE(job.job_id().empty());
}

TEST_F(CoordinatorTest, CancelStopsTheTasks) {
  RegisterNode("cpu-node", 0, 2);
  v1::Job job = Submit(ValidSpec("to-cancel"));
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED);
  v1::HeartbeatResponse started = Heartbeat("cpu-node");
  ASSERT_EQ(started.start_size(), 1);
  EXPECT_EQ(started.start(0).trainers(0).assignment().device_type(), v1::DEVICE_TYPE_CPU);
  v1::CancelJobRequest cancel;
  cancel.set_job_id(job.job_id());
  v1::CancelJobResponse cancelled;
  ASSERT_TRUE(stub_->CancelJob(Context().get(), cancel, &cancelled).ok());
  // The next heartbeats carry the stop order.
  const bool stopped = testing::WaitUntil(
      [&] {
        v1::HeartbeatResponse response =
            Heartbeat("cpu-node", {Task(started.start(0), v1::TASK_STATE_RUNNING)});
        for (const auto& task : response.stop()) {
          if (task == started.start(0).task_id()) return true;
        }
        return false;
      },
      absl::Seconds(10), absl::Milliseconds(50));
  EXPECT_TRUE(stopped);
}

// A worker whose ReadLogs answers with two chunks naming what it was asked.
class FakeLogWorker final : public v1::Worker::Service {
 public:
  grpc::Status ReadLogs(grpc::ServerContext*, const v1::ReadLogsRequest* request,
                        grpc::ServerWriter<v1::LogChunk>* writer) override {
    for (int i = 0; i < 2; ++i) {
      v1::LogChunk chunk;
      chunk.set_job_id(request->job_id());
      chunk.set_attempt(request->attempt());
      chunk.set_rank(i);
      chunk.set_data(absl::StrCat("line ", i, " of ", request->job_id(), "\n"));
      writer->Write(chunk);
    }
    return grpc::Status::OK;
  }
};

TEST_F(CoordinatorTest, GetLogsRelaysFromTheWorkers) {
  FakeLogWorker worker;
  auto server = GrpcServer::Start({.listen_address = "127.0.0.1:0"},
                                  {{v1::Worker::service_full_name(), &worker}});
  ASSERT_THAT(server, IsOk());
  v1::RegisterNodeRequest node;
  node.set_node_id("logs-node");
  node.set_address((*server)->address());
  node.mutable_resources()->set_cpu_slots(2);
  v1::RegisterNodeResponse registered;
  ASSERT_TRUE(nodes_->RegisterNode(Context().get(), node, &registered).ok());

  v1::Job pending = Submit(GpuSpec("never-placed", 64, 64, 1));
  v1::GetLogsRequest request;
  request.set_job_id(pending.job_id());
  request.set_rank(-1);
  request.set_attempt(-1);
  {
    auto context = Context();
    auto reader = stub_->GetLogs(context.get(), request);
    v1::LogChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    grpc::Status status = reader->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(status.error_message(), HasSubstr("no trainer has been placed"));
  }

  v1::Job job = Submit(ValidSpec("with-logs"));
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED);
  request.set_job_id(job.job_id());
  auto context = Context();
  auto reader = stub_->GetLogs(context.get(), request);
  std::vector<v1::LogChunk> chunks;
  v1::LogChunk chunk;
  while (reader->Read(&chunk)) chunks.push_back(chunk);
  grpc::Status status = reader->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[0].data(), absl::StrCat("line 0 of ", job.job_id(), "\n"));
  EXPECT_EQ(chunks[1].node_id(), "logs-node");

  // A worker that is gone is named in the error.
  (*server)->Shutdown(absl::ZeroDuration());
  auto context2 = Context();
  auto reader2 = stub_->GetLogs(context2.get(), request);
  EXPECT_FALSE(reader2->Read(&chunk));
  status = reader2->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(status.error_message(), HasSubstr("worker logs-node"));
}

TEST_F(CoordinatorTest, EverythingSurvivesSigkill) {
  std::vector<std::string> ids;
  for (int i = 0; i < 3; ++i)
    ids.push_back(Submit(ValidSpec(absl::StrCat("durable-", i))).job_id());
  v1::CancelJobRequest cancel;
  cancel.set_job_id(ids[1]);
  v1::CancelJobResponse cancelled;
  ASSERT_TRUE(stub_->CancelJob(Context().get(), cancel, &cancelled).ok());

  auto exit = process_->Stop(SIGKILL);
  ASSERT_THAT(exit, IsOk());
  EXPECT_EQ(exit->signal, SIGKILL);
  process_.reset();
  Start();

  for (int i = 0; i < 3; ++i) {
    v1::Job job;
    ASSERT_TRUE(Get(ids[i], &job).ok()) << ids[i];
    EXPECT_EQ(job.spec().name(), absl::StrCat("durable-", i));
    EXPECT_EQ(job.state(), i == 1 ? v1::JOB_STATE_CANCELLED : v1::JOB_STATE_PENDING);
  }
  EXPECT_EQ(Watch(ids[1], 0).size(), 2u);
  // New ids keep counting after the restart: no reuse.
  v1::Job next = Submit(ValidSpec("after-restart"));
  for (const auto& id : ids) EXPECT_NE(next.job_id(), id);
}

TEST_F(CoordinatorTest, SigkillMidTrainingLosesNothingAndReconciles) {
  RegisterNode("node-a", 0, 2);
  v1::Job job = Submit(ValidSpec("mid-training"));
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED);
  v1::TaskAssignment assignment = Heartbeat("node-a").start(0);
  Heartbeat("node-a", {Task(assignment, v1::TASK_STATE_RUNNING)});
  job =
      WaitForJob(job.job_id(), [](const v1::Job& j) { return j.state() == v1::JOB_STATE_RUNNING; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  v1::ReportRequest report;
  report.set_node_id("node-a");
  report.set_task_id(assignment.task_id());
  report.set_first_sequence(1);
  for (int step = 1; step <= 5; ++step) {
    auto* r = report.add_reports();
    r->set_job_id(job.job_id());
    r->mutable_metrics()->set_step(step);
    r->mutable_metrics()->set_loss(6.0 - step);
  }
  auto* checkpoint = report.add_reports();
  checkpoint->set_job_id(job.job_id());
  checkpoint->mutable_checkpoint()->set_job_id(job.job_id());
  checkpoint->mutable_checkpoint()->set_step(5);
  checkpoint->mutable_checkpoint()->set_path("/ckpt/step-00000005");
  v1::ReportResponse acked;
  ASSERT_TRUE(nodes_->Report(Context().get(), report, &acked).ok());

  auto exit = process_->Stop(SIGKILL);
  ASSERT_THAT(exit, IsOk());
  process_.reset();
  Start();

  // Everything is still there.
  ASSERT_TRUE(Get(job.job_id(), &job).ok());
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.current_step(), 5);
  v1::GetMetricsRequest metrics;
  metrics.set_job_id(job.job_id());
  v1::GetMetricsResponse curve;
  ASSERT_TRUE(stub_->GetMetrics(Context().get(), metrics, &curve).ok());
  EXPECT_EQ(curve.points_size(), 5);
  v1::ListCheckpointsRequest list;
  list.set_job_id(job.job_id());
  v1::ListCheckpointsResponse checkpoints;
  ASSERT_TRUE(stub_->ListCheckpoints(Context().get(), list, &checkpoints).ok());
  ASSERT_EQ(checkpoints.checkpoints_size(), 1);
  EXPECT_EQ(checkpoints.checkpoints(0).path(), "/ckpt/step-00000005");

  // The worker's next heartbeat reconciles: the task keeps running, nothing
  // is started twice, and the job then finishes normally.
  v1::HeartbeatResponse again = Heartbeat("node-a", {Task(assignment, v1::TASK_STATE_RUNNING)});
  EXPECT_FALSE(again.reregister());
  EXPECT_EQ(again.start_size(), 0);
  EXPECT_EQ(again.stop_size(), 0);
  Heartbeat("node-a", {Task(assignment, v1::TASK_STATE_SUCCEEDED)});
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SUCCEEDED; });
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
}

// The coordinator with a queue file: jobs go to their queue, a job beyond its queue's quota waits
// with the reason though a node has room, an unknown queue is NOT_FOUND, and a bad new version of
// the file is refused while the previous one stays in force.
class CoordinatorQueuesTest : public CoordinatorTest {
 protected:
  static constexpr char kQueues[] = R"(
queues:
  - name: nlp
    nominal: {cpu_slots: 2}
  - name: vision
    nominal: {cpu_slots: 2}
default_queue: nlp
)";

  void SetUp() override {
    Write(kQueues);
    Start({"--queue_file=" + path_});
  }
  // Replaces the file (a new inode), as an editor or a ConfigMap update does.
  void Write(const std::string& text) {
    std::ofstream(path_ + ".next") << text;
    std::filesystem::rename(path_ + ".next", path_);
  }

  const std::string path_ = dir_.path() + "/queues.yaml";
};

TEST_F(CoordinatorQueuesTest, AJobBeyondItsQueuesQuotaWaitsWithTheReason) {
  RegisterNode("n1", 0, 8);
  const v1::Job first = Submit(ValidSpec("first"));
  EXPECT_EQ(first.queue(), "nlp");
  v1::Job job = WaitForJob(first.job_id(), [](const v1::Job& j) {
    return j.state() == v1::JOB_STATE_SCHEDULED;
  });
  EXPECT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();

  const v1::Job second = Submit(ValidSpec("second"));
  job = WaitForJob(second.job_id(), [](const v1::Job& j) {
    return absl::StrContains(j.reason(), "queue nlp");
  });
  EXPECT_EQ(job.state(), v1::JOB_STATE_PENDING);
  EXPECT_THAT(job.reason(), HasSubstr("queue nlp: 2 of 2 CPU slots in use, needs 2"));

  v1::JobSpec other = ValidSpec("other");
  other.set_queue("vision");
  const v1::Job third = Submit(other);
  EXPECT_EQ(third.queue(), "vision");
  job = WaitForJob(third.job_id(), [](const v1::Job& j) {
    return j.state() == v1::JOB_STATE_SCHEDULED;
  });
  EXPECT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();

  v1::SubmitJobRequest unknown;
  *unknown.mutable_spec() = ValidSpec("unknown");
  unknown.mutable_spec()->set_queue("robotics");
  v1::SubmitJobResponse response;
  const grpc::Status status = stub_->SubmitJob(Context().get(), unknown, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("queue 'robotics' does not exist"));
}

TEST_F(CoordinatorQueuesTest, ABadNewVersionIsRefusedAndThePreviousOneStays) {
  // A job runs when the bad version arrives.
  RegisterNode("n1", 0, 8);
  const v1::Job running = Submit(ValidSpec("running"));
  v1::Job job = WaitForJob(running.job_id(), [](const v1::Job& j) {
    return j.state() == v1::JOB_STATE_SCHEDULED;
  });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();
  v1::HeartbeatResponse orders = Heartbeat("n1");
  ASSERT_EQ(orders.start_size(), 1);
  const v1::TaskAssignment assignment = orders.start(0);
  Heartbeat("n1", {Task(assignment, v1::TASK_STATE_RUNNING)});

  // A bad new version: a negative quota.
  Write("queues:\n  - name: nlp\n    nominal: {cpu_slots: -1}\n");
  ASSERT_THAT(process_->WaitForStderrLine("keeping the previous queues", absl::Seconds(30)),
              testing::IsOk());
  EXPECT_THAT(process_->stderr_text(), HasSubstr("nominal.cpu_slots: must be >= 0, got -1"));
  v1::JobSpec spec = ValidSpec("still-routed");
  spec.set_queue("vision");
  const v1::Job routed = Submit(spec);
  EXPECT_EQ(routed.queue(), "vision");
  // Placed within the previous version's quota for vision: a pass ran after the bad version.
  job = WaitForJob(routed.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  EXPECT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();

  // Nothing running was disturbed: no stop, no checkpoint order, the same attempt.
  orders = Heartbeat("n1", {Task(assignment, v1::TASK_STATE_RUNNING)});
  EXPECT_EQ(orders.stop_size(), 0);
  EXPECT_EQ(orders.checkpoint_and_stop_size(), 0);
  ASSERT_TRUE(Get(running.job_id(), &job).ok());
  EXPECT_EQ(job.attempt(), 0);
  EXPECT_NE(job.state(), v1::JOB_STATE_PREEMPTED);
  EXPECT_TRUE(job.state() == v1::JOB_STATE_SCHEDULED || job.state() == v1::JOB_STATE_RUNNING)
      << v1::JobState_Name(job.state());
}

// A queue's saved fair-share usage (the queue_usage table of --state) as (cpu_slot_seconds,
// as_of_ns), read behind the coordinator's back; nullopt without a row.
std::optional<std::pair<double, int64_t>> SavedCpuUsage(const std::string& state,
                                                        const std::string& queue) {
  sqlite3* db = nullptr;
  std::optional<std::pair<double, int64_t>> usage;
  if (sqlite3_open_v2(state.c_str(), &db, SQLITE_OPEN_READONLY, nullptr) == SQLITE_OK) {
    sqlite3_busy_timeout(db, 10000);
    sqlite3_stmt* stmt = nullptr;
    if (sqlite3_prepare_v2(db,
                           "SELECT cpu_slot_seconds, as_of_ns FROM queue_usage WHERE queue = ?1",
                           -1, &stmt, nullptr) == SQLITE_OK) {
      sqlite3_bind_text(stmt, 1, queue.c_str(), -1, SQLITE_TRANSIENT);
      if (sqlite3_step(stmt) == SQLITE_ROW) {
        usage.emplace(sqlite3_column_double(stmt, 0), sqlite3_column_int64(stmt, 1));
      }
    }
    sqlite3_finalize(stmt);
  }
  sqlite3_close(db);
  return usage;
}

// The queues' fair-share usage survives a restart of the real coordinator: saved when it stops
// on SIGTERM, restored by the next one, which goes on from it (decayed over the downtime by the
// 7-day default half-life, i.e. not measurably) instead of from zero.
TEST_F(CoordinatorQueuesTest, FairShareUsageSurvivesARestart) {
  const std::string state = dir_.path() + "/state.db";
  RegisterNode("n1", 0, 8);
  v1::JobSpec spec = ValidSpec("busy");
  spec.set_queue("vision");
  const v1::Job busy = Submit(spec);
  v1::Job job = WaitForJob(busy.job_id(),
                           [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();
  // Its 2 slots held until the passes have counted more than 1 slot-second of use: vision's fair
  // share is its decayed slot-seconds over its 2 nominal slots (weight 1), so past 0.55.
  EXPECT_TRUE(testing::WaitUntil(
      [&] {
        v1::ListQueuesResponse queues;
        if (!stub_->ListQueues(Context().get(), {}, &queues).ok()) return false;
        for (const v1::QueueStatus& queue : queues.queues()) {
          if (queue.name() == "vision") return queue.fair_share() > 0.55;
        }
        return false;
      },
      absl::Seconds(30), absl::Milliseconds(50)))
      << "vision's use is never counted";
  v1::CancelJobRequest cancel;
  cancel.set_job_id(busy.job_id());
  v1::CancelJobResponse cancelled;
  ASSERT_TRUE(stub_->CancelJob(Context().get(), cancel, &cancelled).ok());

  auto exit = process_->Stop(SIGTERM);
  ASSERT_THAT(exit, testing::IsOk());
  process_.reset();
  const std::optional<std::pair<double, int64_t>> saved = SavedCpuUsage(state, "vision");
  ASSERT_TRUE(saved.has_value());
  EXPECT_GT(saved->first, 1.0);  // 2 slots x about 1 s, decayed by nothing to speak of
  EXPECT_FALSE(SavedCpuUsage(state, "nlp").has_value());

  // The restarted coordinator saves on its first pass: what it restored, nothing held since
  // (the job was cancelled, so nothing is recovered).
  ASSERT_NO_FATAL_FAILURE(Start({"--queue_file=" + path_}));
  std::optional<std::pair<double, int64_t>> restored;
  testing::WaitUntil(
      [&] {
        restored = SavedCpuUsage(state, "vision");
        return restored.has_value() && restored->second > saved->second;
      },
      absl::Seconds(10), absl::Milliseconds(50));
  ASSERT_TRUE(restored.has_value()) << "the restarted coordinator forgot vision's usage";
  ASSERT_GT(restored->second, saved->second) << "no save after the restart";
  EXPECT_NEAR(restored->first, saved->first, saved->first * 1e-3);
}

// ListQueues and `tessera queues` show each queue's quota, use and jobs as the passes count them.
TEST_F(CoordinatorQueuesTest, ListQueuesAndTheCliShowQuotaUseAndJobs) {
  RegisterNode("n1", 0, 8);
  const v1::Job first = Submit(ValidSpec("first"));
  const v1::Job second = Submit(ValidSpec("second"));
  WaitForJob(second.job_id(),
             [](const v1::Job& j) { return absl::StrContains(j.reason(), "queue nlp"); });
  v1::ListQueuesResponse response;
  testing::WaitUntil(
      [&] {
        response.Clear();
        return stub_->ListQueues(Context().get(), {}, &response).ok() &&
               response.queues_size() == 2 && response.queues(0).running_jobs() == 1 &&
               response.queues(0).pending_jobs() == 1;
      },
      absl::Seconds(10), absl::Milliseconds(50));
  EXPECT_EQ(response.queue_file(), path_);
  ASSERT_EQ(response.queues_size(), 2);
  const v1::QueueStatus& nlp = response.queues(0);
  EXPECT_EQ(nlp.name(), "nlp");
  EXPECT_EQ(nlp.nominal().cpu_slots(), 2);
  EXPECT_EQ(nlp.used().cpu_slots(), 2);
  EXPECT_EQ(nlp.running_jobs(), 1);
  EXPECT_EQ(nlp.pending_jobs(), 1);
  EXPECT_EQ(nlp.weight(), 1.0);
  EXPECT_EQ(response.queues(1).name(), "vision");
  EXPECT_EQ(response.queues(1).used().cpu_slots(), 0);

  auto cli = testing::RunCommand({BinDir() + "/tessera", "--coordinator=" + address_, "queues"});
  ASSERT_THAT(cli, IsOk());
  EXPECT_EQ(cli->exit.exit_code, 0) << cli->output;
  EXPECT_THAT(cli->output, HasSubstr("NAME"));
  EXPECT_THAT(cli->output, ::testing::ContainsRegex("nlp +- +0/0 +2/2 +- +1 +1 "));
  EXPECT_THAT(cli->output, HasSubstr("queue file: " + path_));
  auto json = testing::RunCommand(
      {BinDir() + "/tessera", "--coordinator=" + address_, "--output=json", "queues"});
  ASSERT_THAT(json, IsOk());
  EXPECT_EQ(json->exit.exit_code, 0) << json->output;
  EXPECT_THAT(json->output, HasSubstr("\"running_jobs\": 1"));
}

// Each GPU rank's placement names its device (UUID and model, from its node's inventory when it
// was placed): in GetJob, in `tessera get`'s table, and in `tessera get --output=json`, which is
// the job's protobuf JSON and nothing else, so a strict parser (unknown fields refused) reads it.
TEST_F(CoordinatorTest, TheCliShowsTheGpuUuidsOfAJobsRanks) {
  RegisterNode("node-a", 2, 0);
  RegisterNode("node-b", 2, 0);
  v1::Job job = Submit(GpuSpec("uuids", 4, 4, 1));
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();
  ASSERT_EQ(job.placements_size(), 4);
  std::set<std::string> uuids;
  for (const v1::RankPlacement& placement : job.placements()) {
    // The fake nodes' inventories name GPU i of node N "GPU-N-i".
    EXPECT_EQ(placement.gpu_uuid(),
              absl::StrCat("GPU-", placement.node_id(), "-", placement.gpu_index()));
    EXPECT_EQ(placement.gpu_name(), "NVIDIA H100 80GB HBM3");
    uuids.insert(placement.gpu_uuid());
  }
  EXPECT_EQ(uuids.size(), 4u) << "each rank holds a GPU of its own";

  auto json = testing::RunCommand(
      {BinDir() + "/tessera", "--coordinator=" + address_, "--output=json", "get", job.job_id()});
  ASSERT_THAT(json, IsOk());
  ASSERT_EQ(json->exit.exit_code, 0) << json->output;
  v1::Job parsed;
  google::protobuf::util::JsonParseOptions strict;
  strict.ignore_unknown_fields = false;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json->output, &parsed, strict).ok())
      << json->output;
  EXPECT_EQ(parsed.job_id(), job.job_id());
  ASSERT_EQ(parsed.placements_size(), 4);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(parsed.placements(i).gpu_uuid(), job.placements(i).gpu_uuid()) << i;
  }

  auto text = testing::RunCommand(
      {BinDir() + "/tessera", "--coordinator=" + address_, "get", job.job_id()});
  ASSERT_THAT(text, IsOk());
  ASSERT_EQ(text->exit.exit_code, 0) << text->output;
  for (const std::string& uuid : uuids) EXPECT_THAT(text->output, HasSubstr(uuid));
}

TEST(CoordinatorQueueFileTest, ABadFileStopsTheStartNamingTheField) {
  ScopedTempDir dir("coordinator_queues");
  const std::string path = dir.path() + "/queues.yaml";
  std::ofstream(path) << "queues:\n  - name: nlp\n    nominal: {gpus: 4}\n    colour: blue\n";
  auto process = Subprocess::Start({BinDir() + "/tessera-coordinator", "--listen=127.0.0.1:0",
                                    "--metrics_listen=", "--state=" + dir.path() + "/state.db",
                                    "--queue_file=" + path});
  ASSERT_THAT(process, testing::IsOk());
  auto exit = process->Wait(absl::Seconds(30));
  ASSERT_THAT(exit, testing::IsOk());
  EXPECT_NE(exit->exit_code, 0);
  EXPECT_THAT(process->stderr_text(), HasSubstr("--queue_file " + path));
  EXPECT_THAT(process->stderr_text(), HasSubstr("colour"));
}

}  // namespace
}  // namespace tessera
