// The newer layouts through the whole system: jobs with expert parallelism (a mixture of experts,
// dp 2 x ep 2, the router's load-balancing loss on), context parallelism (cp 2, ring attention)
// and an interleaved pipeline (pp 2 x 2 virtual stages) are submitted to a real coordinator,
// placed on a real worker and trained by real tessera-trainer processes, and each one's loss
// curve, as the coordinator recorded it, is one process's: the same spec on one CPU slot, through
// the same coordinator, to float32 reduction-order noise (the trainer-level tests,
// tests/trainer_*_test.cc, check the same layouts with the trainer alone).

#include <algorithm>
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "planner/model_config.h"
#include "tests/cluster_e2e_fixture.h"

namespace tessera {
namespace {

// Relative, per step: the trainer-level layout tests' bound.
constexpr double kTolerance = 1e-4;
constexpr int kSteps = 8;

class LayoutClusterTest : public ClusterTest {
 protected:
  // Spec(kSteps) with tiny-llama's dimensions spelled out (a spec names a preset or dimensions),
  // `layers` of them, and `experts` routed experts (top-2, load-balancing loss 0.05) when > 0.
  v1::JobSpec TinyLlama(int layers, int experts) {
    v1::JobSpec spec = Spec(kSteps);
    v1::ModelSpec preset;
    preset.set_preset("tiny-llama");
    absl::StatusOr<v1::ModelSummary> resolved =
        planner::ResolveModel(preset, spec.data().seq_len());
    EXPECT_TRUE(resolved.ok()) << resolved.status();
    if (!resolved.ok()) return spec;
    spec.mutable_model()->clear_preset();
    v1::ModelDims* dims = spec.mutable_model()->mutable_dims();
    *dims = resolved->dims();
    dims->set_num_layers(layers);
    if (experts > 0) {
      dims->set_num_experts(experts);
      dims->set_num_experts_per_token(2);
      dims->set_router_aux_loss_coef(0.05);
    }
    spec.mutable_checkpoint()->set_interval_steps(0);
    return spec;
  }

  static void SetLayout(v1::JobSpec& spec, int dp, int pp, int cp, int ep, int v) {
    v1::Layout* layout = spec.mutable_parallelism()->mutable_layout();
    layout->set_data_parallel(dp);
    layout->set_tensor_parallel(1);
    layout->set_pipeline_parallel(pp);
    layout->set_context_parallel(cp);
    layout->set_expert_parallel(ep);
    layout->set_pipeline_virtual_stages(v);
  }

  // Trains `spec` (its layout over the worker's 2 slots) and the same spec on one slot, one
  // process, each through the coordinator, and expects the same losses step by step. Returns the
  // layout job's record.
  v1::Job ExpectTrainsLikeOneProcess(const v1::JobSpec& spec, const std::string& name) {
    v1::Job job = WaitFor(Submit(spec), v1::JOB_STATE_SUCCEEDED, 240);
    EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << name << ": " << job.reason();
    v1::JobSpec one = spec;
    one.set_name("one-process");
    one.mutable_resources()->set_cpu_slots(1);
    SetLayout(one, 1, 1, 1, 1, 1);
    const v1::Job reference = WaitFor(Submit(one), v1::JOB_STATE_SUCCEEDED, 240);
    EXPECT_EQ(reference.state(), v1::JOB_STATE_SUCCEEDED) << reference.reason();
    const std::vector<v1::StepMetrics> curve = Curve(job.job_id());
    const std::vector<v1::StepMetrics> expected = Curve(reference.job_id());
    EXPECT_EQ(curve.size(), static_cast<size_t>(kSteps)) << name;
    EXPECT_EQ(expected.size(), static_cast<size_t>(kSteps)) << name;
    double worst = 0;
    for (size_t i = 0; i < std::min(curve.size(), expected.size()); ++i) {
      EXPECT_EQ(curve[i].step(), expected[i].step());
      const double relative =
          std::abs(curve[i].loss() - expected[i].loss()) / std::abs(expected[i].loss());
      worst = std::max(worst, relative);
      EXPECT_LE(relative, kTolerance)
          << name << ", step " << curve[i].step() << ": " << curve[i].loss() << " vs one process's "
          << expected[i].loss();
    }
    std::cout << name << ": max relative loss difference to one process " << worst << "\n";
    return job;
  }
};

TEST_F(LayoutClusterTest, AnExpertParallelJobTrainsLikeOneProcess) {
  v1::JobSpec spec = TinyLlama(/*layers=*/2, /*experts=*/8);
  SetLayout(spec, /*dp=*/2, /*pp=*/1, /*cp=*/1, /*ep=*/2, /*v=*/1);
  const v1::Job job = ExpectTrainsLikeOneProcess(spec, "dp2 x ep2");
  EXPECT_EQ(job.plan().layout().expert_parallel(), 2);
  // Rank 0's routing of its last micro-batch, every layer, as the coordinator keeps it.
  ASSERT_EQ(job.latest_metrics().expert_load_size(), 2);
  for (const v1::ExpertLoad& load : job.latest_metrics().expert_load()) {
    EXPECT_EQ(load.tokens_size(), 8);
    EXPECT_GE(load.imbalance(), 1.0);
  }
}

TEST_F(LayoutClusterTest, AContextParallelJobTrainsLikeOneProcess) {
  v1::JobSpec spec = TinyLlama(/*layers=*/2, /*experts=*/0);
  SetLayout(spec, /*dp=*/1, /*pp=*/1, /*cp=*/2, /*ep=*/1, /*v=*/1);
  const v1::Job job = ExpectTrainsLikeOneProcess(spec, "cp2");
  EXPECT_EQ(job.plan().layout().context_parallel(), 2);
}

TEST_F(LayoutClusterTest, AnInterleavedPipelineJobTrainsLikeOneProcess) {
  v1::JobSpec spec = TinyLlama(/*layers=*/4, /*experts=*/0);
  SetLayout(spec, /*dp=*/1, /*pp=*/2, /*cp=*/1, /*ep=*/1, /*v=*/2);
  const v1::Job job = ExpectTrainsLikeOneProcess(spec, "pp2 x v2");
  EXPECT_EQ(job.plan().layout().pipeline_virtual_stages(), 2);
}

// What the trainer does not run is refused at submission, naming the field, before any rank
// starts: a mixture of experts under context parallelism.
TEST_F(LayoutClusterTest, AMixtureOfExpertsUnderContextParallelismIsRefusedAtTheDoor) {
  v1::JobSpec spec = TinyLlama(/*layers=*/2, /*experts=*/8);
  SetLayout(spec, /*dp=*/1, /*pp=*/1, /*cp=*/2, /*ep=*/1, /*v=*/1);
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  v1::SubmitJobResponse response;
  const grpc::Status status = stub_->SubmitJob(Context().get(), request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("parallelism.layout.context_parallel: 2 with a "
                                        "mixture-of-experts model"),
            std::string::npos)
      << status.error_message();
}

}  // namespace
}  // namespace tessera
