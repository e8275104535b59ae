// tessera-trainer --job_spec: a spec file goes through the coordinator's validation, resolution
// and planning (coordinator::PlanJob) and trains the job they describe: the same losses, step for
// step, as the same job given by --set settings alone, and the settings given beside the file
// override it; a spec that asks for more ranks than this process is one of, and one the
// coordinator would refuse, are refused with the coordinator's reasons (exit 2).
#include <fstream>
#include <string>
#include <vector>

#include "tests/trainer_training_fixture.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

class TrainerJobSpecTest : public TrainerTrainingTest {
 protected:
  // A spec of BaseFlags' job.
  std::string WriteSpec(int steps, int cpu_slots, const std::string& micro_batch = "2") {
    const std::string path = MakeTempDir("spec") + "/job.yaml";
    std::ofstream out(path);
    out << "name: spec-run\n"
        << "model: {preset: tiny-gpt2}\n"
        << "data:\n"
        << "  train_shards: [\"" << *data_dir_ << "/train-*.bin\"]\n"
        << "  seq_len: 64\n"
        << "batch: {global_batch_size: 8, micro_batch_size: " << micro_batch << "}\n"
        << "optimizer:\n"
        << "  schedule: {peak_learning_rate: 3e-3, warmup_steps: 5, min_lr_ratio: 0.1, "
        << "decay_steps: " << steps << "}\n"
        << "  weight_decay: 0.1\n"
        << "  grad_clip_norm: 1.0\n"
        << "seed: 7\n"
        << "max_steps: " << steps << "\n"
        << "resources: {cpu_slots: " << cpu_slots << "}\n";
    return path;
  }
  TrainerRun RunSpec(const std::string& path) {
    return RunTrainer({Trainer(), "--job_spec=" + path});
  }
};

TEST_F(TrainerJobSpecTest, ASpecTrainsAsTheSameJobGivenBySettings) {
  constexpr int kSteps = 6;
  const TrainerRun by_settings = RunTrainer(BaseFlags(kSteps, "", kSteps));
  ASSERT_EQ(by_settings.exit_code, 0) << by_settings.output;
  const TrainerRun by_spec = RunSpec(WriteSpec(kSteps, /*cpu_slots=*/1));
  ASSERT_EQ(by_spec.exit_code, 0) << by_spec.output;
  ASSERT_EQ(by_spec.losses.size(), static_cast<size_t>(kSteps)) << by_spec.output;
  EXPECT_EQ(by_spec.losses, by_settings.losses);
}

TEST_F(TrainerJobSpecTest, SettingsBesideTheFileOverrideIt) {
  // The file's 2 ranks and 6 steps, set to 1 rank and 3 steps (the schedule stays the file's).
  const TrainerRun run = RunTrainer({Trainer(), "--job_spec=" + WriteSpec(6, /*cpu_slots=*/2),
                                     "--set", "resources.cpu_slots=1", "--set=max_steps=3"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_EQ(run.losses.size(), 3u) << run.output;
  const TrainerRun both = RunTrainer({Trainer(), "--task=/nonexistent", "--set=max_steps=3"});
  EXPECT_EQ(both.exit_code, 2);
  EXPECT_THAT(both.output, HasSubstr("--task is the whole job"));
  const TrainerRun bad = RunTrainer({Trainer(), "--set=max_steps=many"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.output, HasSubstr("max_steps"));
}

TEST_F(TrainerJobSpecTest, ASpecForMoreRanksThanThisProcessIsOneOfIsRefused) {
  const TrainerRun run = RunSpec(WriteSpec(4, /*cpu_slots=*/2));
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("the spec's resources ask for 2 rank(s)"));
  EXPECT_THAT(run.output, HasSubstr("torchrun --nproc_per_node=2"));
}

TEST_F(TrainerJobSpecTest, ASpecTheCoordinatorWouldRefuseIsRefusedForItsReason) {
  const TrainerRun run = RunSpec(WriteSpec(4, /*cpu_slots=*/1, /*micro_batch=*/"3"));
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("batch"));
  EXPECT_TRUE(run.losses.empty());
}

}  // namespace
}  // namespace tessera::testing
