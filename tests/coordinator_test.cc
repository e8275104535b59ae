// Starts the real tessera-coordinator on 127.0.0.1:0 with a state file and
// drives tessera.v1.Coordinator over gRPC: submit, get, list, cancel, watch,
// metrics, bad input, and SIGKILL durability.

#include <signal.h>

#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/daemon/server.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"
#include "tests/util/subprocess.h"
#include "tests/util/temp_dir.h"

namespace tessera {
namespace {

using ::tessera::testing::BinDir;
using ::tessera::testing::IsOk;
using ::tessera::testing::ScopedTempDir;
using ::tessera::testing::Subprocess;
using ::testing::HasSubstr;

std::unique_ptr<grpc::ClientContext> Context(int seconds = 10) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  return context;
}

v1::JobSpec ValidSpec(const std::string& name) {
  v1::JobSpec spec;
  spec.set_name(name);
  spec.mutable_model()->set_preset("tiny-gpt2");
  spec.mutable_data()->add_train_shards("/data/train-*.bin");
  spec.mutable_data()->set_seq_len(64);
  spec.mutable_batch()->set_global_batch_size(8);
  spec.mutable_batch()->set_micro_batch_size(2);
  spec.mutable_optimizer()->mutable_schedule()->set_peak_learning_rate(1e-3);
  spec.set_max_steps(100);
  spec.mutable_resources()->set_cpu_slots(2);
  return spec;
}

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(); }

  void Start() {
    auto process = Subprocess::Start({BinDir() + "/tessera-coordinator", "--listen=127.0.0.1:0",
                                      "--metrics_listen=", "--state=" + dir_.path() + "/state.db"});
    ASSERT_THAT(process, IsOk());
    process_.emplace(std::move(*process));
    auto line = process_->WaitForStderrLine("serving gRPC on");
    ASSERT_THAT(line, IsOk());
    std::smatch match;
    ASSERT_TRUE(std::regex_search(*line, match, std::regex(R"(serving gRPC on (\S+:\d+))")));
    stub_ = v1::Coordinator::NewStub(MakeClientChannel(match[1]));
  }

  v1::Job Submit(const v1::JobSpec& spec, const std::string& request_id = "") {
    v1::SubmitJobRequest request;
    *request.mutable_spec() = spec;
    request.set_request_id(request_id);
    v1::SubmitJobResponse response;
    grpc::Status status = stub_->SubmitJob(Context().get(), request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.job();
  }

  grpc::Status Get(const std::string& job_id, v1::Job* job) {
    v1::GetJobRequest request;
    request.set_job_id(job_id);
    v1::GetJobResponse response;
    grpc::Status status = stub_->GetJob(Context().get(), request, &response);
    *job = response.job();
    return status;
  }

  std::vector<v1::JobEvent> Watch(const std::string& job_id, int64_t after) {
    v1::WatchJobRequest request;
    request.set_job_id(job_id);
    request.set_after_sequence(after);
    auto context = Context();
    auto reader = stub_->WatchJob(context.get(), request);
    std::vector<v1::JobEvent> events;
    v1::JobEvent event;
    while (reader->Read(&event)) events.push_back(event);
    grpc::Status status = reader->Finish();
    EXPECT_TRUE(status.ok()) << status.error_message();
    return events;
  }

  ScopedTempDir dir_{"coordinator_test"};
  std::optional<Subprocess> process_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

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

}  // namespace
}  // namespace tessera
