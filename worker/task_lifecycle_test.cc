// The task lifecycle's transition table and the states heartbeats derive from it.
#include "worker/task_lifecycle.h"

#include <optional>
#include <vector>

#include "gtest/gtest.h"

namespace tessera::worker {
namespace {

using P = TaskPhase;
using E = TaskEvent;

constexpr P kAllPhases[] = {P::kPending,       P::kStopBeforeLaunch, P::kRunning,
                            P::kCheckpointing, P::kStopping,         P::kEnded,
                            P::kEndAnnounced,  P::kEndSent};
constexpr E kAllEvents[] = {E::kLaunched, E::kStopOrdered, E::kCheckpointOrdered,
                            E::kJudged,   E::kEndReady,    E::kEndSent};

struct Transition {
  P from;
  E event;
  P to;
};

// Every transition there is; any other (phase, event) pair leaves the phase alone.
const std::vector<Transition>& AllowedTransitions() {
  static const auto* transitions = new std::vector<Transition>{
      {P::kPending, E::kLaunched, P::kRunning},
      {P::kPending, E::kStopOrdered, P::kStopBeforeLaunch},
      {P::kPending, E::kCheckpointOrdered, P::kStopBeforeLaunch},
      {P::kPending, E::kJudged, P::kEnded},
      {P::kStopBeforeLaunch, E::kJudged, P::kEnded},
      {P::kRunning, E::kStopOrdered, P::kStopping},
      {P::kRunning, E::kCheckpointOrdered, P::kCheckpointing},
      {P::kRunning, E::kJudged, P::kEnded},
      {P::kCheckpointing, E::kJudged, P::kEnded},
      {P::kStopping, E::kJudged, P::kEnded},
      {P::kEnded, E::kEndReady, P::kEndAnnounced},
      {P::kEnded, E::kEndSent, P::kEndSent},
      {P::kEndAnnounced, E::kEndSent, P::kEndSent},
  };
  return *transitions;
}

TEST(NextPhaseTest, FollowsTheTableAndIgnoresEveryOtherEvent) {
  for (P from : kAllPhases) {
    for (E event : kAllEvents) {
      std::optional<P> expected;
      for (const Transition& t : AllowedTransitions()) {
        if (t.from == from && t.event == event) expected = t.to;
      }
      EXPECT_EQ(NextPhase(from, event), expected)
          << TaskPhaseName(from) << " on event " << static_cast<int>(event);
    }
  }
}

TEST(NextPhaseTest, AnEndedTaskNeverRunsAgain) {
  for (P from : {P::kEnded, P::kEndAnnounced, P::kEndSent}) {
    for (E event : kAllEvents) {
      std::optional<P> next = NextPhase(from, event);
      if (!next) continue;
      EXPECT_TRUE(*next == P::kEndAnnounced || *next == P::kEndSent) << TaskPhaseName(from);
    }
  }
}

TEST(TaskLifecycleTest, RunsToSuccessAndIsSent) {
  TaskLifecycle task;
  EXPECT_EQ(task.state(), v1::TASK_STATE_STARTING);
  EXPECT_TRUE(task.unlaunched());
  EXPECT_FALSE(task.on_its_way_out());
  ASSERT_TRUE(task.Launched());
  EXPECT_EQ(task.state(), v1::TASK_STATE_RUNNING);
  EXPECT_TRUE(task.judging());
  EXPECT_FALSE(task.on_its_way_out());
  EXPECT_FALSE(task.Launched()) << "launched twice";
  ASSERT_TRUE(task.Judged(v1::TASK_STATE_SUCCEEDED));
  EXPECT_TRUE(task.ended());
  EXPECT_TRUE(task.on_its_way_out());
  EXPECT_FALSE(task.judging());
  EXPECT_EQ(task.state(), v1::TASK_STATE_SUCCEEDED);
  EXPECT_FALSE(task.Judged(v1::TASK_STATE_FAILED)) << "a verdict is final";
  EXPECT_EQ(task.verdict(), v1::TASK_STATE_SUCCEEDED);
  EXPECT_FALSE(task.StopOrdered()) << "a stop order for an ended task changes nothing";
  ASSERT_TRUE(task.EndReady());
  EXPECT_EQ(task.phase(), P::kEndAnnounced);
  EXPECT_FALSE(task.EndReady());
  ASSERT_TRUE(task.EndSent());
  EXPECT_EQ(task.phase(), P::kEndSent);
  EXPECT_EQ(task.state(), v1::TASK_STATE_SUCCEEDED);
}

TEST(TaskLifecycleTest, AVerdictMustBeAnEnd) {
  TaskLifecycle task;
  task.Launched();
  EXPECT_FALSE(task.Judged(v1::TASK_STATE_RUNNING));
  EXPECT_FALSE(task.Judged(v1::TASK_STATE_UNSPECIFIED));
  EXPECT_EQ(task.phase(), P::kRunning);
}

TEST(TaskLifecycleTest, ACheckpointOrderKeepsItsDeadlineAndALaterStopDoesNotCutIt) {
  const absl::Time deadline = absl::FromUnixSeconds(100);
  TaskLifecycle task;
  task.Launched();
  ASSERT_TRUE(task.CheckpointOrdered(deadline));
  EXPECT_EQ(task.phase(), P::kCheckpointing);
  EXPECT_EQ(task.checkpoint_deadline(), deadline);
  EXPECT_EQ(task.state(), v1::TASK_STATE_RUNNING);
  EXPECT_TRUE(task.on_its_way_out());
  EXPECT_FALSE(task.StopOrdered());
  EXPECT_FALSE(task.CheckpointOrdered(deadline + absl::Seconds(5)));
  EXPECT_EQ(task.checkpoint_deadline(), deadline);
  ASSERT_TRUE(task.Judged(v1::TASK_STATE_STOPPED));
  EXPECT_EQ(task.checkpoint_deadline(), std::nullopt);
}

TEST(TaskLifecycleTest, AStoppingTaskIgnoresACheckpointOrder) {
  TaskLifecycle task;
  task.Launched();
  ASSERT_TRUE(task.StopOrdered());
  EXPECT_EQ(task.state(), v1::TASK_STATE_RUNNING) << "the verdict waits for the next judgement";
  EXPECT_FALSE(task.CheckpointOrdered(absl::FromUnixSeconds(100)));
  EXPECT_EQ(task.checkpoint_deadline(), std::nullopt);
  ASSERT_TRUE(task.Judged(v1::TASK_STATE_FAILED));
  EXPECT_EQ(task.state(), v1::TASK_STATE_FAILED);
}

TEST(TaskLifecycleTest, AStopBeforeLaunchEndsUnlaunched) {
  TaskLifecycle task;
  ASSERT_TRUE(task.CheckpointOrdered(absl::FromUnixSeconds(100)));
  EXPECT_EQ(task.phase(), P::kStopBeforeLaunch);
  EXPECT_EQ(task.checkpoint_deadline(), std::nullopt) << "nothing to save";
  EXPECT_EQ(task.state(), v1::TASK_STATE_STARTING);
  EXPECT_TRUE(task.unlaunched());
  EXPECT_TRUE(task.on_its_way_out());
  EXPECT_FALSE(task.Launched()) << "a stopped task never launches";
  ASSERT_TRUE(task.Judged(v1::TASK_STATE_STOPPED));
  EXPECT_EQ(task.state(), v1::TASK_STATE_STOPPED);
}

TEST(TaskLifecycleTest, AnEndCanBeSentBeforeItIsReady) {
  // A rank that outlives its SIGKILL: the end goes out at its deadline, never announced.
  TaskLifecycle task;
  ASSERT_TRUE(task.Judged(v1::TASK_STATE_FAILED));  // e.g. a rank that could not be launched
  ASSERT_TRUE(task.EndSent());
  EXPECT_FALSE(task.EndReady());
  EXPECT_EQ(task.phase(), P::kEndSent);
}

}  // namespace
}  // namespace tessera::worker
