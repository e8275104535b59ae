// What the layout-equivalence suites share (trainer_moe_layouts_test, trainer_moe_tp_test,
// trainer_moe_pp_test): a one-process reference run kept for the suite, the tiny MoE model, and
// the check that a layout over several ranks trains like the reference (rank 0's losses and
// router losses step by step, the exported weights of the last step).
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/trainer_training_fixture.h"

namespace tessera::testing {

class LayoutTrainingTest : public TrainerTrainingTest {
 protected:
  // Turns BaseFlags' model into the suites' tiny MoE: tiny-llama with 8 experts, top-2 routing
  // and router loss weight `aux_loss_coef`.
  static void UseTinyMoe(std::vector<std::string>& flags, const std::string& aux_loss_coef) {
    for (std::string& flag : flags) {
      if (flag == "--preset=tiny-gpt2") flag = "--preset=tiny-llama";
    }
    flags.push_back("--num_experts=8");
    flags.push_back("--experts_per_token=2");
    flags.push_back(absl::StrCat("--router_aux_loss_coef=", aux_loss_coef));
  }

  struct Reference {
    TrainerRun run;
    std::string dir;  // its checkpoint directory (the exports of its steps)
  };
  // The one-process run of `flags(dir)`, trained once per `name` for the whole test program.
  static const Reference& SuiteReference(
      const std::string& name,
      const std::function<std::vector<std::string>(const std::string& dir)>& flags) {
    static auto* references = new std::map<std::string, Reference>;
    auto it = references->find(name);
    if (it == references->end()) {
      Reference reference;
      reference.dir = MakeTempDir(name);
      reference.run = RunTrainer(flags(reference.dir));
      it = references->emplace(name, std::move(reference)).first;
    }
    return it->second;
  }

  // Trains `flags` (writing to `dir`, exporting safetensors) over `world` ranks and expects it to
  // train as `reference` did for `steps` steps: rank 0's loss at each step and, with
  // `compare_router_loss` (one data-parallel replica, whose rank 0 sees one process's last
  // micro-batch), its router loss, and the weights exported at the last step, each within
  // `tolerance` relative. `expected_weights` must be among the reference's tensors. Prints the
  // worst differences under `name`.
  static void ExpectLayoutTrainsLike(const Reference& reference, const std::vector<std::string>& flags,
                                     const std::string& dir, int world, int steps, double tolerance,
                                     bool compare_router_loss,
                                     const std::vector<std::string>& expected_weights,
                                     const std::string& name) {
    ASSERT_EQ(reference.run.exit_code, 0) << reference.run.output;
    ASSERT_EQ(reference.run.losses.size(), static_cast<size_t>(steps));
    std::vector<TrainerRun> runs = RunRanks(flags, world);
    ASSERT_EQ(runs.size(), static_cast<size_t>(world));
    for (int rank = 0; rank < world; ++rank) {
      ASSERT_EQ(runs[rank].exit_code, 0) << "rank " << rank << ":\n" << runs[rank].output;
    }
    ASSERT_EQ(runs[0].losses.size(), static_cast<size_t>(steps));
    // A model with experts reports a router loss at every step, whatever the layout.
    const bool has_router_loss =
        std::any_of(reference.run.reports.begin(), reference.run.reports.end(),
                    [](const auto& r) { return r.has_metrics() && r.metrics().router_aux_loss() > 0; });
    double worst_loss = 0, worst_aux = 0;
    int aux_compared = 0;
    for (const auto& report : runs[0].reports) {
      if (!report.has_metrics()) continue;
      const int64_t step = report.metrics().step();
      const double expected = reference.run.losses.at(step);
      const double relative = std::abs(report.metrics().loss() - expected) / expected;
      EXPECT_LE(relative, tolerance) << "step " << step;
      worst_loss = std::max(worst_loss, relative);
      if (has_router_loss) EXPECT_GT(report.metrics().router_aux_loss(), 0) << "step " << step;
      if (!compare_router_loss) continue;
      for (const auto& expected_report : reference.run.reports) {
        if (!expected_report.has_metrics() || expected_report.metrics().step() != step) continue;
        const double want = expected_report.metrics().router_aux_loss();
        ASSERT_GT(want, 0);
        // A report of one chunk or one stage only would be about 1/(pp x v) of this.
        const double aux_relative = std::abs(report.metrics().router_aux_loss() - want) / want;
        EXPECT_LE(aux_relative, tolerance) << "router loss, step " << step;
        worst_aux = std::max(worst_aux, aux_relative);
        ++aux_compared;
      }
    }
    if (compare_router_loss) EXPECT_EQ(aux_compared, steps);
    const auto weights = ReadStepExport(dir, steps);
    const auto want_weights = ReadStepExport(reference.dir, steps);
    for (const std::string& tensor : expected_weights) {
      ASSERT_TRUE(want_weights.contains(tensor)) << tensor;
    }
    const double weight_difference = MaxRelativeDifference(weights, want_weights);
    std::cout << name << ": max relative loss difference " << worst_loss << ", router loss "
              << worst_aux << ", max relative weight difference " << weight_difference << "\n";
    EXPECT_LE(weight_difference, tolerance);
  }
};

}  // namespace tessera::testing
