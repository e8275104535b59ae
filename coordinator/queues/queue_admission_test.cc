#include "coordinator/queues/queue_admission.h"

#include <algorithm>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

// Cohort lab: nlp (32 GPUs, may borrow 16) and vision (32 GPUs); shared (8 GPUs, 16 CPU slots)
// alone.
QueueConfig Config() {
  QueueConfig config;
  config.cohorts = {"lab"};
  config.queues = {
      {.name = "nlp", .cohort = "lab", .nominal = {.gpus = 32}, .borrowing_limit_gpus = 16},
      {.name = "vision", .cohort = "lab", .nominal = {.gpus = 32, .cpu_slots = 8}},
      {.name = "shared", .nominal = {.gpus = 8, .cpu_slots = 16}},
  };
  EXPECT_TRUE(ValidateQueueConfig(config).ok());
  return config;
}

QueuedRequest Gpu(std::string job_id, std::string queue, int64_t gpus, int priority = 0,
                  int64_t order = 0) {
  return {.job_id = std::move(job_id),
          .queue = std::move(queue),
          .priority = priority,
          .submit_order = order,
          .use_gpus = true,
          .devices = gpus};
}

QueuedRequest Cpu(std::string job_id, std::string queue, int64_t slots, int64_t order = 0) {
  return {.job_id = std::move(job_id),
          .queue = std::move(queue),
          .submit_order = order,
          .use_gpus = false,
          .devices = slots};
}

TEST(AdmitByQuotaTest, AdmitsWithinNominalAndNamesTheShortfall) {
  const QuotaAdmission result =
      AdmitByQuota(Config(), {{"shared", {.gpus = 4}}}, {},
                   {Gpu("small", "shared", 2, 0, 1), Gpu("big", "shared", 4, 0, 2)});
  EXPECT_THAT(result.admitted, ElementsAre("small"));
  EXPECT_THAT(result.borrowing, IsEmpty());
  EXPECT_EQ(result.held.at("big"), "queue shared: 6 of 8 GPUs in use, needs 4");
}

TEST(AdmitByQuotaTest, PriorityThenAgeInsideAQueueAndTheHeadHoldsBackLaterOnes) {
  const QuotaAdmission result =
      AdmitByQuota(Config(), {{"shared", {.gpus = 4}}}, {},
                   {Gpu("old-low", "shared", 1, 0, 1), Gpu("urgent", "shared", 2, 5, 9),
                    Gpu("huge", "shared", 4, 1, 3), Gpu("tiny", "shared", 1, 0, 2)});
  // urgent (priority 5) first, then huge (priority 1) blocks: old-low and tiny would fit but
  // wait behind it.
  EXPECT_THAT(result.admitted, ElementsAre("urgent"));
  EXPECT_EQ(result.held.at("huge"), "queue shared: 6 of 8 GPUs in use, needs 4");
  EXPECT_THAT(result.held.at("old-low"), HasSubstr("waiting behind huge"));
  EXPECT_THAT(result.held.at("tiny"), HasSubstr("waiting behind huge"));
}

TEST(AdmitByQuotaTest, GpuAndCpuQuotasAreSeparate) {
  const QuotaAdmission result =
      AdmitByQuota(Config(), {{"shared", {.gpus = 8, .cpu_slots = 10}}}, {},
                   {Gpu("gpu-job", "shared", 1, 0, 1), Cpu("cpu-job", "shared", 6, 2),
                    Cpu("cpu-2", "shared", 1, 3)});
  EXPECT_THAT(result.admitted, ElementsAre("cpu-job"));
  EXPECT_EQ(result.held.at("gpu-job"), "queue shared: 8 of 8 GPUs in use, needs 1");
  EXPECT_EQ(result.held.at("cpu-2"), "queue shared: 16 of 16 CPU slots in use, needs 1");
}

TEST(AdmitByQuotaTest, BorrowsTheCohortsUnusedQuotaUpToTheLimit) {
  // vision uses 8 of its 32: 24 unused to lend. nlp is full and may borrow 16.
  const QuotaAdmission result = AdmitByQuota(
      Config(), {{"nlp", {.gpus = 32}}, {"vision", {.gpus = 8}}}, {},
      {Gpu("b1", "nlp", 8, 0, 1), Gpu("b2", "nlp", 8, 0, 2), Gpu("b3", "nlp", 8, 0, 3)});
  EXPECT_THAT(result.admitted, ElementsAre("b1", "b2"));
  EXPECT_THAT(result.borrowing, UnorderedElementsAre("b1", "b2"));
  EXPECT_EQ(result.held.at("b3"),
            "queue nlp: 48 of 32 GPUs in use, needs 8; it may borrow at most 16 GPUs (borrowing "
            "16 now)");
}

TEST(AdmitByQuotaTest, BorrowingStopsAtTheCohortsUnusedQuota) {
  const QuotaAdmission result = AdmitByQuota(
      Config(), {{"nlp", {.gpus = 30}}, {"vision", {.gpus = 28}}}, {}, {Gpu("j", "nlp", 8)});
  EXPECT_THAT(result.admitted, IsEmpty());
  EXPECT_THAT(result.held.at("j"), HasSubstr("queue nlp: 30 of 32 GPUs in use, needs 8; cohort "
                                             "lab has 6 GPUs unused to lend"));
}

TEST(AdmitByQuotaTest, AQueueWithoutCohortNeverBorrows) {
  const QuotaAdmission result =
      AdmitByQuota(Config(), {}, {}, {Gpu("j", "shared", 6, 0, 1), Gpu("k", "shared", 4, 0, 2)});
  EXPECT_THAT(result.admitted, ElementsAre("j"));
  EXPECT_EQ(result.held.at("k"), "queue shared: 6 of 8 GPUs in use, needs 4");
}

TEST(AdmitByQuotaTest, NominalQuotaLentOutIsReservedAgainstBorrowers) {
  // nlp borrows 12 of vision's quota; vision (at 12 of 32) wants 20: within its nominal, but the
  // cohort has only 8 unused. It waits, and nlp may not borrow those 8 meanwhile.
  const QuotaAdmission result =
      AdmitByQuota(Config(), {{"nlp", {.gpus = 44}}, {"vision", {.gpus = 12}}}, {},
                   {Gpu("v", "vision", 20, 0, 1), Gpu("n", "nlp", 1, 0, 2)});
  EXPECT_THAT(result.admitted, IsEmpty());
  EXPECT_EQ(result.held.at("v"),
            "queue vision: 12 of 32 GPUs in use, needs 20, but cohort lab has lent its quota out: "
            "56 of 64 GPUs in use there (waits for borrowed GPUs to come back)");
  EXPECT_EQ(result.held.at("n"),
            "queue nlp: 44 of 32 GPUs in use, needs 1; cohort lab has 8 GPUs unused to lend and "
            "holds 20 for waiting jobs (it borrows next: the lowest fair share waiting)");
}

TEST(AdmitByQuotaTest, BorrowedCapacityGoesToTheLowestShareFirstAndIsReserved) {
  QueueConfig config;
  config.cohorts = {"lab"};
  for (const char* name : {"a", "b", "c"}) {
    config.queues.push_back({.name = name, .cohort = "lab", .nominal = {.gpus = 8}});
  }
  // a and b full, c has lent 6 of its 8. c's share is highest, b's lowest.
  const std::map<std::string, Resources> in_use = {
      {"a", {.gpus = 8}}, {"b", {.gpus = 8}}, {"c", {.gpus = 2}}};
  const std::map<std::string, double> shares = {{"a", 0.2}, {"b", 0.1}, {"c", 0.9}};
  QuotaAdmission result = AdmitByQuota(config, in_use, shares,
                                       {Gpu("a1", "a", 2, 0, 1), Gpu("a2", "a", 2, 0, 2),
                                        Gpu("b1", "b", 2, 0, 3), Gpu("b2", "b", 2, 0, 4)});
  // Turns by share: b1, a1, b2; a2 finds nothing left.
  EXPECT_THAT(result.admitted, ElementsAre("b1", "a1", "b2"));
  EXPECT_THAT(result.held.at("a2"), HasSubstr("cohort lab has 0 GPUs unused to lend"));

  // b's head is too big for what is unused: it reserves, and a may not take the 6 instead.
  result = AdmitByQuota(config, in_use, shares, {Gpu("a1", "a", 2, 0, 1), Gpu("b1", "b", 8, 0, 2)});
  EXPECT_THAT(result.admitted, IsEmpty());
  EXPECT_THAT(result.held.at("b1"), HasSubstr("it borrows next"));
  EXPECT_THAT(result.held.at("a1"), HasSubstr("b1 of queue b (lower fair share) borrows first"));

  // A head over its own borrowing limit reserves nothing: the next share may borrow.
  config.queues[1].borrowing_limit_gpus = 4;
  result = AdmitByQuota(config, in_use, shares, {Gpu("a1", "a", 2, 0, 1), Gpu("b1", "b", 6, 0, 2)});
  EXPECT_THAT(result.admitted, ElementsAre("a1"));
  EXPECT_THAT(result.held.at("b1"), HasSubstr("it may borrow at most 4 GPUs"));
}

TEST(AdmitByQuotaTest, NeverAdmissibleRequestsAreSkippedNotBlocking) {
  const QueueConfig config = Config();
  const QuotaAdmission result =
      AdmitByQuota(config, {}, {},
                   {Gpu("huge", "nlp", 49, 5, 1), Gpu("ok", "nlp", 8, 0, 2),
                    Gpu("lost", "speech", 1, 0, 3), Cpu("cpu", "nlp", 1, 4)});
  // nlp has no CPU quota of its own but borrows vision's unused slots.
  EXPECT_THAT(result.admitted, ElementsAre("ok", "cpu"));
  EXPECT_THAT(result.borrowing, ElementsAre("cpu"));
  EXPECT_EQ(result.held.at("huge"),
            "needs 49 GPUs but queue nlp may never use more than 48 (nominal 32 + borrowing limit "
            "16 GPUs)");
  EXPECT_THAT(result.held.at("lost"), HasSubstr("queue speech is not configured"));
  // nlp has no CPU quota, but its cohort lends vision's 8 slots.
  EXPECT_EQ(QuotaUnsatisfiable(config, Cpu("x", "nlp", 9)),
            "needs 9 CPU slots but queue nlp may never use more than 8 (cohort lab holds 8 CPU "
            "slots in all)");
  EXPECT_EQ(QuotaUnsatisfiable(config, Cpu("x", "nlp", 8)), std::nullopt);
  EXPECT_EQ(
      QuotaUnsatisfiable(config, Gpu("x", "shared", 9)),
      "needs 9 GPUs but queue shared may never use more than 8 (its nominal quota is 8 GPUs)");
}

TEST(AdmitByQuotaTest, WithoutQueuesEverythingIsAdmittedInPriorityAndAgeOrder) {
  const QuotaAdmission result = AdmitByQuota(
      QueueConfig{}, {{"default", {.gpus = 1000}}}, {},
      {Gpu("c", "default", 1, 0, 3), Gpu("a", "default", 1, 2, 9), Gpu("b", "default", 100, 0, 1)});
  EXPECT_THAT(result.admitted, ElementsAre("a", "b", "c"));
  EXPECT_THAT(result.held, IsEmpty());
}

TEST(AdmitByQuotaTest, ResultDoesNotDependOnRequestOrder) {
  std::vector<QueuedRequest> requests;
  for (int i = 0; i < 30; ++i) {
    requests.push_back(Gpu(absl::StrCat("j", i),
                           i % 3 == 0 ? "nlp" : (i % 3 == 1 ? "vision" : "shared"), 1 + i % 7,
                           i % 4, i / 2));
  }
  const std::map<std::string, Resources> in_use = {{"nlp", {.gpus = 20}}, {"vision", {.gpus = 5}}};
  const std::map<std::string, double> shares = {{"nlp", 0.5}, {"vision", 0.4}};
  const QuotaAdmission first = AdmitByQuota(Config(), in_use, shares, requests);
  std::mt19937 random(7);
  for (int round = 0; round < 5; ++round) {
    std::shuffle(requests.begin(), requests.end(), random);
    const QuotaAdmission again = AdmitByQuota(Config(), in_use, shares, requests);
    EXPECT_EQ(again.admitted, first.admitted);
    EXPECT_EQ(again.held, first.held);
  }
}

// Quota accounting, checked on random states: what a pass admits, added to what runs, never
// takes a queue past nominal + borrowing limit nor a cohort past the sum of its nominal quotas,
// and every request is either admitted or held with a reason.
TEST(AdmitByQuotaTest, NeverExceedsNominalPlusBorrowingLimitOrTheCohort) {
  const QueueConfig config = Config();
  std::mt19937 random(42);
  for (int trial = 0; trial < 500; ++trial) {
    std::map<std::string, Resources> in_use;
    // Start from a valid state: random running jobs admitted one by one.
    std::vector<QueuedRequest> requests;
    const char* names[] = {"nlp", "vision", "shared"};
    for (int i = 0; i < 12; ++i) {
      QueuedRequest request = Gpu(absl::StrCat("t", trial, "-", i), names[random() % 3],
                                  1 + random() % 12, static_cast<int>(random() % 3), i);
      if (random() % 4 == 0) {
        request.use_gpus = false;
        request.devices = 1 + random() % 6;
      }
      requests.push_back(request);
    }
    const QuotaAdmission first = AdmitByQuota(config, in_use, {}, requests);
    for (const auto& request : requests) {
      if (std::find(first.admitted.begin(), first.admitted.end(), request.job_id) !=
          first.admitted.end()) {
        Get(in_use[request.queue],
            request.use_gpus ? ResourceKind::kGpus : ResourceKind::kCpuSlots) += request.devices;
      }
    }
    // A second pass on top, with new requests and random shares.
    for (auto& request : requests) request.job_id += "-again";
    const std::map<std::string, double> shares = {{"nlp", (random() % 100) / 100.0},
                                                  {"vision", (random() % 100) / 100.0}};
    const QuotaAdmission second = AdmitByQuota(config, in_use, shares, requests);
    EXPECT_EQ(second.admitted.size() + second.held.size(), requests.size());
    for (const auto& request : requests) {
      if (std::find(second.admitted.begin(), second.admitted.end(), request.job_id) !=
          second.admitted.end()) {
        Get(in_use[request.queue],
            request.use_gpus ? ResourceKind::kGpus : ResourceKind::kCpuSlots) += request.devices;
      }
    }
    Resources lab;
    for (const QueueSpec& queue : config.queues) {
      const Resources used = in_use[queue.name];
      if (queue.cohort.empty()) {
        EXPECT_LE(used.gpus, queue.nominal.gpus);
        EXPECT_LE(used.cpu_slots, queue.nominal.cpu_slots);
      } else {
        lab += used;
        EXPECT_LE(used.gpus, queue.nominal.gpus + queue.borrowing_limit_gpus.value_or(1 << 30));
      }
    }
    EXPECT_LE(lab.gpus, 64);
    EXPECT_LE(lab.cpu_slots, 8);
  }
}

}  // namespace
}  // namespace tessera::coordinator
