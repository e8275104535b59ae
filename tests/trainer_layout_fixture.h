// What the layout-equivalence suites share (trainer_moe_layouts_test, trainer_moe_tp_test,
// trainer_moe_pp_test, trainer_expert_parallel_test, trainer_moe_lora_test,
// trainer_lora_tp_test): a one-process reference run kept for the suite, the tiny MoE model, and
// the check that a layout over several ranks trains like the reference (rank 0's losses and
// router losses step by step, the exported weights or LoRA adapters of the last step).
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <map>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "tests/trainer_training_fixture.h"

namespace tessera::testing {

class LayoutTrainingTest : public TrainerTrainingTest {
 protected:
  // Turns BaseFlags' model into the suites' tiny MoE: tiny-llama with 8 experts, top-2 routing
  // and router loss weight `aux_loss_coef`.
  static void UseTinyMoe(std::vector<std::string>& flags, const std::string& aux_loss_coef) {
    for (std::string& flag : flags) {
      if (flag == "--set=model.preset=tiny-gpt2") flag = "--set=model.preset=tiny-llama";
    }
    double coef = 0;
    ASSERT_TRUE(absl::SimpleAtod(aux_loss_coef, &coef)) << aux_loss_coef;
    ChangeModelDims(flags, [coef](v1::ModelDims& dims) {
      dims.set_num_experts(8);
      dims.set_num_experts_per_token(2);
      dims.set_router_aux_loss_coef(coef);
    });
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

  // What a layout's run is held to against the one-process reference.
  struct LayoutExpectation {
    int world = 1;  // processes
    int steps = 0;
    // Relative, for each step's loss, the router loss and the tensors compared after the last
    // step.
    double tolerance = 0;
    // Rank 0's router loss against the reference's, step by step: with one data-parallel
    // replica, whose rank 0 sees one process's last micro-batch.
    bool compare_router_loss = false;
    // Compare the PEFT adapter of the last step's checkpoint instead of its safetensors export.
    bool adapters = false;
    // Tensors that must be among the reference's compared ones.
    std::vector<std::string> expected_tensors;
    std::string name;  // printed with the worst differences
  };

  // Token slots a layer's routing reports (StepMetrics.expert_load).
  static int64_t SlotsOf(const v1::ExpertLoad& load) {
    return std::accumulate(load.tokens().begin(), load.tokens().end(), int64_t{0});
  }
  // The MoE layers the first step report of `reports` covers; every step reports all of them.
  static int ExpertLayers(const std::vector<v1::TrainerReport>& reports) {
    for (const auto& report : reports) {
      if (report.has_metrics()) return report.metrics().expert_load_size();
    }
    return 0;
  }

  // The PEFT adapter of the checkpoint a LoRA run with `checkpoint_dir` wrote at `step`.
  static std::map<std::string, std::vector<float>> ReadStepAdapter(
      const std::string& checkpoint_dir, int64_t step) {
    return ReadExport(
        absl::StrFormat("%s/step-%08d/adapter/adapter_model.safetensors", checkpoint_dir, step));
  }

  // Trains `flags` (writing checkpoints to `dir`, exporting safetensors or LoRA adapters) over
  // `expect.world` ranks and expects it to train as `reference` did for `expect.steps` steps:
  // rank 0's loss at each step, with `compare_router_loss` its router loss, and the weights (or
  // adapters) of the last step, each within `expect.tolerance` relative. A model with experts
  // must report a router loss at every step. Prints the worst differences under `expect.name`;
  // the ranks' runs go to `runs` for a suite's own checks.
  static void ExpectLayoutTrainsLike(const Reference& reference,
                                     const std::vector<std::string>& flags, const std::string& dir,
                                     const LayoutExpectation& expect,
                                     std::vector<TrainerRun>* runs = nullptr) {
    ASSERT_EQ(reference.run.exit_code, 0) << reference.run.output;
    ASSERT_EQ(reference.run.losses.size(), static_cast<size_t>(expect.steps));
    std::vector<TrainerRun> ranks;
    ASSERT_NO_FATAL_FAILURE(RunRanksToSuccess(flags, expect.world, &ranks));
    double worst_loss = 0, worst_aux = 0;
    ASSERT_NO_FATAL_FAILURE(ExpectLossesMatch(ranks[0], reference.run, 1, expect.steps,
                                              expect.tolerance, &worst_loss));
    // A model with experts reports a router loss at every step, whatever the layout.
    const bool has_router_loss =
        std::any_of(reference.run.reports.begin(), reference.run.reports.end(),
                    [](const auto& r) { return r.has_metrics() && r.metrics().router_aux_loss() > 0; });
    int aux_compared = 0;
    for (const auto& report : ranks[0].reports) {
      if (!report.has_metrics()) continue;
      const int64_t step = report.metrics().step();
      if (has_router_loss) {
        EXPECT_GT(report.metrics().router_aux_loss(), 0) << "step " << step;
        // The same micro-batch's routing, every MoE layer of the model (every stage's under
        // pipeline parallelism): each layer routes the same tokens, top-k slots each.
        const auto& loads = report.metrics().expert_load();
        const int layers = ExpertLayers(reference.run.reports);
        EXPECT_GT(layers, 0) << "the reference reports no routing";
        EXPECT_EQ(loads.size(), layers) << "step " << step;
        for (const v1::ExpertLoad& load : loads) {
          EXPECT_EQ(SlotsOf(load), SlotsOf(loads[0]))
              << "step " << step << ", layer " << load.layer();
          EXPECT_GE(load.imbalance(), 1.0) << "step " << step << ", layer " << load.layer();
        }
        if (!loads.empty()) {
          EXPECT_GT(SlotsOf(loads[0]), 0) << "step " << step;
        }
      }
      if (!expect.compare_router_loss) continue;
      for (const auto& expected_report : reference.run.reports) {
        if (!expected_report.has_metrics() || expected_report.metrics().step() != step) continue;
        const double want = expected_report.metrics().router_aux_loss();
        ASSERT_GT(want, 0);
        // A report of one chunk or one stage only would be about 1/(pp x v) of this.
        const double aux_relative = std::abs(report.metrics().router_aux_loss() - want) / want;
        EXPECT_LE(aux_relative, expect.tolerance) << "router loss, step " << step;
        worst_aux = std::max(worst_aux, aux_relative);
        ++aux_compared;
      }
    }
    if (expect.compare_router_loss) {
      EXPECT_EQ(aux_compared, expect.steps);
    }
    const auto read = expect.adapters ? ReadStepAdapter : ReadStepExport;
    const auto tensors = read(dir, expect.steps);
    const auto want_tensors = read(reference.dir, expect.steps);
    ASSERT_FALSE(want_tensors.empty()) << reference.dir;
    ASSERT_EQ(tensors.size(), want_tensors.size()) << dir;
    for (const std::string& tensor : expect.expected_tensors) {
      ASSERT_TRUE(want_tensors.contains(tensor)) << tensor;
    }
    const double difference = MaxRelativeDifference(tensors, want_tensors);
    std::cout << expect.name << ": max relative loss difference " << worst_loss;
    if (has_router_loss) std::cout << ", router loss " << worst_aux;
    std::cout << ", max relative " << (expect.adapters ? "adapter" : "weight") << " difference "
              << difference << "\n";
    EXPECT_LE(difference, expect.tolerance);
    if (runs != nullptr) *runs = std::move(ranks);
  }
};

}  // namespace tessera::testing
