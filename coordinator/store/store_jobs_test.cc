// The Store's jobs (store_jobs.cc): listings and their pages, the active jobs, request ids,
// updates that keep the indexed columns in step, and job ids (NextJobId, CommitNewJob).
//
// Thread safety: each test owns its store; the threads a test starts use it as the
// coordinator's threads do.
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/status_matchers.h"
#include "coordinator/store/store.h"
#include "coordinator/store/store_fixture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace tessera::coordinator {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::IsOkAndHolds;
using ::tessera::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

TEST_P(StoreBackendTest, ListJobsPaginatesNewestFirst) {
  std::unique_ptr<Store> store = OpenOrDie(location());
  ASSERT_NE(store, nullptr);
  // 25 jobs; jobs 20..24 share one create_time, so the job_id tie-break counts.
  std::vector<std::string> newest_first;
  for (int i = 0; i < 25; ++i) {
    const std::string id = absl::StrFormat("job-%08x", i);
    const v1::JobState state = i % 2 == 0 ? v1::JOB_STATE_RUNNING : v1::JOB_STATE_SUCCEEDED;
    SubmitJob(*store, MakeJob(id, state, i < 20 ? 1000 + i : 2000));
    newest_first.insert(newest_first.begin(), id);
  }

  std::vector<std::string> seen;
  std::string token;
  int pages = 0;
  do {
    absl::StatusOr<JobPage> page = store->ListJobs({}, 10, token);
    ASSERT_THAT(page, IsOk());
    ++pages;
    EXPECT_LE(page->jobs.size(), 10u);
    for (const std::string& id : JobIds(page->jobs)) seen.push_back(id);
    token = page->next_page_token;
    ASSERT_LE(pages, 3) << "the last page must return an empty token";
  } while (!token.empty());
  EXPECT_EQ(pages, 3);
  EXPECT_EQ(seen, newest_first);

  // Filtered: the 13 RUNNING jobs (even i), newest first, over two pages.
  absl::StatusOr<JobPage> running = store->ListJobs({v1::JOB_STATE_RUNNING}, 10, "");
  ASSERT_THAT(running, IsOk());
  ASSERT_THAT(running->jobs, SizeIs(10));
  for (const v1::Job& job : running->jobs) EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  absl::StatusOr<JobPage> rest =
      store->ListJobs({v1::JOB_STATE_RUNNING}, 10, running->next_page_token);
  ASSERT_THAT(rest, IsOk());
  EXPECT_THAT(rest->jobs, SizeIs(3));
  EXPECT_EQ(rest->next_page_token, "");
  EXPECT_EQ(rest->jobs.back().job_id(), "job-00000000");

  absl::StatusOr<JobPage> both =
      store->ListJobs({v1::JOB_STATE_RUNNING, v1::JOB_STATE_SUCCEEDED}, 0, "");
  ASSERT_THAT(both, IsOk());
  EXPECT_THAT(both->jobs, SizeIs(25));
  EXPECT_EQ(both->next_page_token, "");

  absl::StatusOr<JobPage> none = store->ListJobs({v1::JOB_STATE_CANCELLED}, 0, "");
  ASSERT_THAT(none, IsOk());
  EXPECT_THAT(none->jobs, IsEmpty());

  EXPECT_THAT(store->ListJobs({}, 10, "not a token!"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_token")));
  EXPECT_THAT(store->ListJobs({}, 10, "YWJj"),  // base64 of "abc"
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_token")));
}

TEST_P(StoreBackendTest, ListActiveJobsOldestFirst) {
  std::unique_ptr<Store> store = OpenOrDie(location());
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-run", v1::JOB_STATE_RUNNING, 30));
  SubmitJob(*store, MakeJob("job-done", v1::JOB_STATE_SUCCEEDED, 5));
  SubmitJob(*store, MakeJob("job-pend", v1::JOB_STATE_PENDING, 10));
  SubmitJob(*store, MakeJob("job-fail", v1::JOB_STATE_FAILED, 15));
  SubmitJob(*store, MakeJob("job-restart", v1::JOB_STATE_RESTARTING, 20));
  SubmitJob(*store, MakeJob("job-sched", v1::JOB_STATE_SCHEDULED, 25));
  SubmitJob(*store, MakeJob("job-cancel", v1::JOB_STATE_CANCELLED, 1));

  absl::StatusOr<std::vector<v1::Job>> active = store->ListActiveJobs();
  ASSERT_THAT(active, IsOk());
  EXPECT_THAT(JobIds(*active), ElementsAre("job-pend", "job-restart", "job-sched", "job-run"));

  // A state change moves a job out of the active set.
  JobWrite finish;
  finish.job_id = "job-run";
  finish.job = MakeJob("job-run", v1::JOB_STATE_SUCCEEDED, 30);
  ASSERT_THAT(store->Commit(finish), IsOk());
  active = store->ListActiveJobs();
  ASSERT_THAT(active, IsOk());
  EXPECT_THAT(JobIds(*active), ElementsAre("job-pend", "job-restart", "job-sched"));
}

TEST_P(StoreBackendTest, FindsJobByRequestId) {
  std::unique_ptr<Store> store = OpenOrDie(location());
  ASSERT_NE(store, nullptr);
  JobWrite submit;
  submit.job_id = "job-a";
  submit.job = MakeJob("job-a", v1::JOB_STATE_PENDING, 1);
  submit.request_id = "req-1";
  ASSERT_THAT(store->Commit(submit), IsOk());
  SubmitJob(*store, MakeJob("job-b", v1::JOB_STATE_PENDING, 2));  // No request id.

  absl::StatusOr<std::optional<v1::Job>> found = store->FindJobByRequestId("req-1");
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->job_id(), "job-a");

  // A later upsert without a request id keeps the recorded one.
  JobWrite update;
  update.job_id = "job-a";
  update.job = MakeJob("job-a", v1::JOB_STATE_RUNNING, 1);
  ASSERT_THAT(store->Commit(update), IsOk());
  found = store->FindJobByRequestId("req-1");
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->state(), v1::JOB_STATE_RUNNING);

  found = store->FindJobByRequestId("req-2");
  ASSERT_THAT(found, IsOk());
  EXPECT_FALSE(found->has_value());
  found = store->FindJobByRequestId("");
  ASSERT_THAT(found, IsOk());
  EXPECT_FALSE(found->has_value());

  JobWrite duplicate;
  duplicate.job_id = "job-c";
  duplicate.job = MakeJob("job-c", v1::JOB_STATE_PENDING, 3);
  duplicate.request_id = "req-1";
  EXPECT_THAT(store->Commit(duplicate),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("job-c")));
}

// Updates write only the columns that may change, except when a write changes what they left
// alone: a new create_time reorders the job, a request id given later is recorded.
TEST_P(StoreBackendTest, UpdatesKeepTheIndexedColumnsInStep) {
  std::unique_ptr<Store> store = OpenOrDie(location());
  ASSERT_NE(store, nullptr);
  JobWrite submit;
  submit.job_id = "job-a";
  submit.job = MakeJob("job-a", v1::JOB_STATE_PENDING, 10);
  submit.request_id = "req-a";
  ASSERT_THAT(store->Commit(submit), IsOk());
  SubmitJob(*store, MakeJob("job-b", v1::JOB_STATE_PENDING, 20));

  JobWrite later;  // A create_time moved past job-b's.
  later.job_id = "job-a";
  later.job = MakeJob("job-a", v1::JOB_STATE_RUNNING, 30);
  ASSERT_THAT(store->Commit(later), IsOk());
  absl::StatusOr<JobPage> page = store->ListJobs({}, 10, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_THAT(JobIds(page->jobs), ElementsAre("job-a", "job-b"));
  page = store->ListJobs({v1::JOB_STATE_RUNNING}, 10, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_THAT(JobIds(page->jobs), ElementsAre("job-a"));
  absl::StatusOr<std::optional<v1::Job>> found = store->FindJobByRequestId("req-a");
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->create_time().seconds(), 30);

  JobWrite keyed;  // A request id recorded by an update, with the create_time unchanged.
  keyed.job_id = "job-b";
  keyed.job = MakeJob("job-b", v1::JOB_STATE_SCHEDULED, 20);
  keyed.request_id = "req-b";
  ASSERT_THAT(store->Commit(keyed), IsOk());
  found = store->FindJobByRequestId("req-b");
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->state(), v1::JOB_STATE_SCHEDULED);
  page = store->ListJobs({v1::JOB_STATE_PENDING}, 10, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_THAT(page->jobs, IsEmpty());

  // The same state again: the job's other fields change, its create_time only with a full
  // update.
  JobWrite same;
  same.job_id = "job-b";
  same.job = MakeJob("job-b", v1::JOB_STATE_SCHEDULED, 20);
  same.job->mutable_spec()->set_name("renamed");
  ASSERT_THAT(store->Commit(same), IsOk());
  absl::StatusOr<v1::Job> job = store->GetJob("job-b");
  ASSERT_THAT(job, IsOk());
  EXPECT_EQ(job->spec().name(), "renamed");
  same.job = MakeJob("job-b", v1::JOB_STATE_SCHEDULED, 35);
  ASSERT_THAT(store->Commit(same), IsOk());
  page = store->ListJobs({}, 10, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_THAT(JobIds(page->jobs), ElementsAre("job-b", "job-a"));
  page = store->ListJobs({v1::JOB_STATE_SCHEDULED}, 10, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_THAT(JobIds(page->jobs), ElementsAre("job-b"));
  same.job = MakeJob("job-b", v1::JOB_STATE_SCHEDULED, 20);
  ASSERT_THAT(store->Commit(same), IsOk());

  keyed.request_id = "req-a";  // Taken by job-a, on both update paths.
  EXPECT_THAT(store->Commit(keyed), StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("job-b")));
  keyed.job = MakeJob("job-b", v1::JOB_STATE_SCHEDULED, 40);
  EXPECT_THAT(store->Commit(keyed), StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("job-b")));
  found = store->FindJobByRequestId("req-b");
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->create_time().seconds(), 20);
}

TEST_P(StoreBackendTest, NextJobIdIsUniqueAndMonotonicAcrossReopen) {
  const std::string& path = location();
  std::vector<std::string> ids;
  for (int round = 0; round < 3; ++round) {
    std::unique_ptr<Store> store = OpenOrDie(path);
    ASSERT_NE(store, nullptr);
    for (int i = 0; i < 5; ++i) {
      absl::StatusOr<std::string> id = store->NextJobId();
      ASSERT_THAT(id, IsOk());
      EXPECT_THAT(*id, ::testing::MatchesRegex("job-[0-9a-f]{8}"));
      ids.push_back(*id);
    }
  }
  EXPECT_EQ(ids.front(), "job-00000001");
  EXPECT_EQ(ids.back(), "job-0000000f");
  for (size_t i = 1; i < ids.size(); ++i) EXPECT_LT(ids[i - 1], ids[i]);
  EXPECT_EQ(std::set<std::string>(ids.begin(), ids.end()).size(), ids.size());

  // An id already used by a stored job is skipped.
  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-00000010", v1::JOB_STATE_PENDING, 1));
  EXPECT_THAT(store->NextJobId(), ::tessera::testing::IsOkAndHolds("job-00000011"));
}

TEST_P(StoreBackendTest, CommitNewJobAllocatesTheIdInItsOwnTransaction) {
  const std::string& path = location();
  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  auto new_job = [](const std::string& request_id) {
    JobWrite write;
    write.job = MakeJob("", v1::JOB_STATE_PENDING, 1);
    write.request_id = request_id;
    write.events.push_back(StateEvent(v1::JOB_STATE_UNSPECIFIED, v1::JOB_STATE_PENDING));
    return write;
  };
  JobWrite first = new_job("req-1");
  ASSERT_THAT(store->CommitNewJob(&first), IsOk());
  EXPECT_EQ(first.job_id, "job-00000001");
  EXPECT_EQ(first.job->job_id(), "job-00000001");
  absl::StatusOr<v1::Job> stored = store->GetJob("job-00000001");
  ASSERT_THAT(stored, IsOk());
  EXPECT_EQ(stored->job_id(), "job-00000001");
  absl::StatusOr<std::vector<v1::JobEvent>> events = store->ReadEvents("job-00000001", 0, 0);
  ASSERT_THAT(events, IsOk());
  ASSERT_THAT(*events, SizeIs(1));
  EXPECT_EQ((*events)[0].job_id(), "job-00000001");
  EXPECT_THAT(
      store->FindJobByRequestId("req-1"),
      IsOkAndHolds(::testing::Optional(::testing::Property(&v1::Job::job_id, "job-00000001"))));

  // Shares the counter with NextJobId.
  EXPECT_THAT(store->NextJobId(), IsOkAndHolds("job-00000002"));
  // A write that fails (a request id already taken) consumes no id and leaves the write unnamed.
  JobWrite duplicate = new_job("req-1");
  EXPECT_THAT(store->CommitNewJob(&duplicate),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("job-00000003")));
  EXPECT_EQ(duplicate.job_id, "");
  EXPECT_EQ(duplicate.job->job_id(), "");
  EXPECT_THAT(store->GetJob("job-00000003"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("job-00000003")));
  JobWrite next = new_job("");
  ASSERT_THAT(store->CommitNewJob(&next), IsOk());
  EXPECT_EQ(next.job_id, "job-00000003");

  // A write that names a job, or has none, is refused before anything is stored.
  JobWrite named = new_job("");
  named.job_id = "job-x";
  EXPECT_THAT(store->CommitNewJob(&named),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job_id")));
  JobWrite named_event = new_job("");
  named_event.events[0].set_job_id("job-x");
  EXPECT_THAT(store->CommitNewJob(&named_event),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job_id")));
  JobWrite no_job;
  EXPECT_THAT(store->CommitNewJob(&no_job),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job_id")));

  // The counter is durable: a reopened store goes on from it.
  store.reset();
  store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  JobWrite after_reopen = new_job("");
  ASSERT_THAT(store->CommitNewJob(&after_reopen), IsOk());
  EXPECT_EQ(after_reopen.job_id, "job-00000004");
}

INSTANTIATE_TEST_SUITE_P(Backends, StoreBackendTest, kStoreBackends, StoreBackendName);

}  // namespace
}  // namespace tessera::coordinator
