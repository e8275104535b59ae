#include "coordinator/queues/queue_config.h"

#include <string>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::IsOkAndHolds;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kConfig[] = R"(
cohorts:
  - name: research
queues:
  - name: nlp
    cohort: research
    nominal: {gpus: 32, cpu_slots: 4}
    borrowing_limit: {gpus: 16}
    weight: 2.5
    submitters: {users: [alice, bob], groups: [nlp-team]}
    default_for: {users: [alice], groups: [nlp-team], labels: {team: nlp}}
  - name: vision
    cohort: research
    nominal: {gpus: 32}
    default_for: {groups: [vision-team]}
  - name: shared
    nominal: {gpus: 8, cpu_slots: 64}
default_queue: shared
fair_share: {half_life: 12h}
preemption: {checkpoint_deadline: 90s}
)";

QueueConfig Parsed() {
  auto config = ParseQueueConfig(kConfig);
  EXPECT_THAT(config, IsOk());
  return config.ok() ? *config : QueueConfig{};
}

TEST(ParseQueueConfigTest, ReadsEveryField) {
  const QueueConfig config = Parsed();
  ASSERT_EQ(config.queues.size(), 3u);
  EXPECT_EQ(config.cohorts, std::vector<std::string>{"research"});
  const QueueSpec& nlp = config.queues[0];
  EXPECT_EQ(nlp.name, "nlp");
  EXPECT_EQ(nlp.cohort, "research");
  EXPECT_EQ(nlp.nominal, (Resources{.gpus = 32, .cpu_slots = 4}));
  EXPECT_EQ(nlp.borrowing_limit_gpus, 16);
  EXPECT_EQ(nlp.borrowing_limit_cpu_slots, std::nullopt);
  EXPECT_DOUBLE_EQ(nlp.weight, 2.5);
  EXPECT_EQ(nlp.submitters.users, (std::vector<std::string>{"alice", "bob"}));
  EXPECT_EQ(nlp.submitters.groups, std::vector<std::string>{"nlp-team"});
  EXPECT_EQ(nlp.default_for.labels, (std::map<std::string, std::string>{{"team", "nlp"}}));
  EXPECT_DOUBLE_EQ(config.queues[1].weight, 1.0);
  EXPECT_EQ(config.queues[1].nominal, (Resources{.gpus = 32, .cpu_slots = 0}));
  EXPECT_EQ(config.default_queue, "shared");
  EXPECT_EQ(config.fair_share_half_life, absl::Hours(12));
  EXPECT_EQ(config.preemption_checkpoint_deadline, absl::Seconds(90));
  EXPECT_EQ(config.CohortNominal(nlp), (Resources{.gpus = 64, .cpu_slots = 4}));
  EXPECT_EQ(config.CohortNominal(config.queues[2]), (Resources{.gpus = 8, .cpu_slots = 64}));
}

TEST(ParseQueueConfigTest, EmptyFileMeansTheImplicitQueue) {
  auto config = ParseQueueConfig("");
  ASSERT_THAT(config, IsOk());
  EXPECT_TRUE(config->implicit());
  EXPECT_EQ(config->fair_share_half_life, kDefaultFairShareHalfLife);
  EXPECT_EQ(config->preemption_checkpoint_deadline, kDefaultPreemptionCheckpointDeadline);
}

struct BadCase {
  std::string yaml;
  std::string message;
};

TEST(ParseQueueConfigTest, RefusesBadFilesNamingEntryAndField) {
  const std::vector<BadCase> cases = {
      {"queues: [{name: a, nominal: {gpus: 1}}, {name: b}, {name: c, nominal: {gpus: -4}}]",
       "queues[2] (c).nominal.gpus: must be >= 0, got -4"},
      {"queues: [{name: a, nominal: {gpus: 1, tpus: 2}}]",
       "queues[0] (a).nominal: unknown key 'tpus' (gpus, cpu_slots)"},
      {"queues: [{name: a, colour: red}]", "queues[0]: unknown key 'colour'"},
      {"queus: []", "top level: unknown key 'queus'"},
      {"queues: [{name: Big_Queue}]", "queues[0].name: 'Big_Queue' must be 1-63 characters"},
      {"queues: [{name: " + std::string(64, 'a') + "}]", "must be 1-63 characters"},
      {"queues: [{nominal: {gpus: 1}}]", "queues[0].name: required"},
      {"queues: [{name: a}, {name: a}]", "queues[1].name: queue 'a' is listed twice"},
      {"queues: [{name: a, cohort: lab}]", "queues[0] (a).cohort: unknown cohort 'lab'"},
      {"cohorts: [{name: lab}, {name: lab}]\nqueues: [{name: a, cohort: lab}]",
       "cohorts[1].name: cohort 'lab' is listed twice"},
      {"cohorts: [{name: lab}]\nqueues: [{name: a}]", "cohorts: cohort 'lab' has no queue"},
      {"cohorts: [{name: lab}]\nqueues: [{name: a, cohort: lab, borrowing_limit: {cpu_slots: -1}}]",
       "queues[0] (a).borrowing_limit.cpu_slots: must be >= 0, got -1"},
      {"queues: [{name: a, borrowing_limit: {gpus: 2}}]",
       "queues[0] (a).borrowing_limit: set without a cohort"},
      {"queues: [{name: a, weight: 0}]", "queues[0] (a).weight: must be > 0, got 0"},
      {"queues: [{name: a, weight: -1.5}]", "queues[0] (a).weight: must be > 0, got -1.5"},
      {"queues: [{name: a, weight: heavy}]", "queues[0] (a).weight: expected a number"},
      {"queues: [{name: a, nominal: {gpus: 2.5}}]",
       "queues[0] (a).nominal.gpus: expected a whole number, got '2.5'"},
      {"queues: [{name: a, default_for: {users: [alice]}}, {name: b, default_for: {users: "
       "[alice]}}]",
       "queues[1] (b).default_for.users: user 'alice' is already defaulted to queue a"},
      {"queues: [{name: a, default_for: {groups: [g]}}, {name: b, default_for: {groups: [g]}}]",
       "queues[1] (b).default_for.groups: group 'g' is already defaulted to queue a"},
      {"queues: [{name: a, default_for: {labels: {t: x}}}, {name: b, default_for: {labels: {t: "
       "x}}}]",
       "queues[1] (b).default_for.labels: labels {t=x} already default to queue a"},
      {"queues: [{name: a, submitters: {users: [bob]}, default_for: {users: [alice]}}]",
       "queues[0] (a).default_for.users: user 'alice' is defaulted here but not listed"},
      {"queues: [{name: a, submitters: {users: [bob], groups: [g]}, default_for: {users: "
       "[alice]}}, "
       "{name: b, weight: 0}]",
       "queues[1] (b).weight"},  // alice may be in group g: accepted, the next error shows
      {"queues: [{name: a, submitters: {labels: {t: x}}}]",
       "queues[0] (a).submitters: unknown key 'labels' (users, groups)"},
      {"queues: [{name: a, submitters: {users: alice}}]",
       "queues[0] (a).submitters.users: expected a list"},
      {"queues: [{name: a}]\ndefault_queue: b", "default_queue: unknown queue 'b'"},
      {"queues: [{name: a}]\nfair_share: {half_life: 7 days}",
       "fair_share.half_life: expected a positive duration"},
      {"queues: [{name: a}]\nfair_share: {half_life: -2h}", "fair_share.half_life"},
      {"queues: [{name: a}]\npreemption: {checkpoint_deadline: soon}",
       "preemption.checkpoint_deadline"},
      {"queues: [{name: a}]\npreemption: {deadline: 2m}",
       "preemption: unknown key 'deadline' (checkpoint_deadline)"},
      {"queues: {name: a}", "queues: expected a list"},
      {"queues: [a, b", "not YAML"},
  };
  for (const BadCase& bad : cases) {
    SCOPED_TRACE(bad.yaml);
    EXPECT_THAT(ParseQueueConfig(bad.yaml),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(bad.message)));
  }
}

TEST(ParseConfigDurationTest, AcceptsEachUnit) {
  EXPECT_THAT(ParseConfigDuration("90s"), IsOkAndHolds(absl::Seconds(90)));
  EXPECT_THAT(ParseConfigDuration("30m"), IsOkAndHolds(absl::Minutes(30)));
  EXPECT_THAT(ParseConfigDuration("1.5h"), IsOkAndHolds(absl::Minutes(90)));
  EXPECT_THAT(ParseConfigDuration("7d"), IsOkAndHolds(absl::Hours(168)));
  EXPECT_THAT(ParseConfigDuration("0d"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'0d'")));
  EXPECT_THAT(ParseConfigDuration("7"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unit")));
  EXPECT_THAT(ParseConfigDuration("d"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'d'")));
}

Submission Job(std::string owner, std::string queue = "", std::vector<std::string> groups = {},
               std::map<std::string, std::string> labels = {}) {
  return Submission{.owner = std::move(owner),
                    .groups = std::move(groups),
                    .labels = std::move(labels),
                    .requested_queue = std::move(queue)};
}

TEST(QueueForTest, NamedQueueNeedsPermission) {
  const QueueConfig config = Parsed();
  EXPECT_THAT(QueueFor(config, Job("bob", "nlp")), IsOkAndHolds("nlp"));
  EXPECT_THAT(QueueFor(config, Job("carol", "nlp", {"nlp-team"})), IsOkAndHolds("nlp"));
  EXPECT_THAT(QueueFor(config, Job("carol", "nlp", {"other"})),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("user carol may not submit to queue nlp (named; open to users "
                                 "alice, bob and groups nlp-team)")));
  // Labels route, they never grant.
  EXPECT_THAT(QueueFor(config, Job("carol", "nlp", {}, {{"team", "nlp"}})),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("queue nlp")));
  // No submitters: open to anyone.
  EXPECT_THAT(QueueFor(config, Job("carol", "vision")), IsOkAndHolds("vision"));
  EXPECT_THAT(QueueFor(config, Job("carol", "speech")),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("queue 'speech' does not exist (queues: nlp, vision, shared)")));
}

TEST(QueueForTest, DefaultsByUserThenGroupThenLabelsThenDefaultQueue) {
  const QueueConfig config = Parsed();
  EXPECT_THAT(QueueFor(config, Job("alice", "", {"vision-team"})), IsOkAndHolds("nlp"));
  EXPECT_THAT(QueueFor(config, Job("dave", "", {"vision-team"}, {{"team", "nlp"}})),
              IsOkAndHolds("vision"));
  // Two matching groups: the first queue in file order.
  EXPECT_THAT(QueueFor(config, Job("carol", "", {"vision-team", "nlp-team"})), IsOkAndHolds("nlp"));
  EXPECT_THAT(QueueFor(config, Job("erin")), IsOkAndHolds("shared"));
  // Routed by label into a queue it may not submit to: denied, saying how it got there.
  EXPECT_THAT(QueueFor(config, Job("erin", "", {}, {{"team", "nlp"}})),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("the default queue for the job's labels")));
}

TEST(QueueForTest, NoDefaultAsksToNameAQueue) {
  auto config = ParseQueueConfig("queues: [{name: a}, {name: b}]");
  ASSERT_THAT(config, IsOk());
  EXPECT_THAT(QueueFor(*config, Job("erin")),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("name one")));
  EXPECT_THAT(QueueFor(*config, Job("erin", "b")), IsOkAndHolds("b"));
}

TEST(QueueForTest, WithoutQueuesEverythingGoesToTheImplicitOne) {
  const QueueConfig config;
  EXPECT_THAT(QueueFor(config, Job("erin")), IsOkAndHolds(std::string(kImplicitQueue)));
  EXPECT_THAT(QueueFor(config, Job("erin", "default")), IsOkAndHolds(std::string(kImplicitQueue)));
  EXPECT_THAT(QueueFor(config, Job("erin", "nlp")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no queues are configured")));
}

TEST(ValidateQueueConfigTest, ChecksConfigsBuiltInCode) {
  QueueConfig config;
  config.queues.push_back({.name = "a", .nominal = {.gpus = 4}});
  EXPECT_THAT(ValidateQueueConfig(config), IsOk());
  config.queues[0].nominal.cpu_slots = -1;
  EXPECT_THAT(ValidateQueueConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("queues[0] (a).nominal.cpu_slots: must be >= 0, got -1")));
}

}  // namespace
}  // namespace tessera::coordinator
