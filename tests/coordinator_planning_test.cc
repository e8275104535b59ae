// The real tessera-coordinator planning and placing jobs for fake GPU and CPU nodes: gangs and
// their rendezvous, automatic layouts chosen by the planner (and why), PlanLayout for a
// hypothetical or the live cluster, the layouts the trainer runs or refuses, and specs planned
// from a Hugging Face config.


#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/coordinator_fixture.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

TEST_F(CoordinatorTest, SchedulesAGangOntoFakeNodesAndFollowsItToTheEnd) {
  RegisterNode("node-a", 4, 0);
  RegisterNode("node-b", 4, 0);
  v1::Job job = Submit(GpuSpec("gang", 8, 8, 1));
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();
  ASSERT_EQ(job.placements_size(), 8);

  // Each node gets its four ranks, with one rendezvous point for all.
  std::map<std::string, v1::TaskAssignment> assignments;
  for (const std::string node : {"node-a", "node-b"}) {
    v1::HeartbeatResponse response = Heartbeat(node);
    ASSERT_EQ(response.start_size(), 1) << node;
    assignments[node] = response.start(0);
    ASSERT_EQ(response.start(0).trainers_size(), 4);
  }
  std::set<int> ranks;
  std::string master;
  for (const auto& [node, assignment] : assignments) {
    for (int i = 0; i < assignment.trainers_size(); ++i) {
      const auto& task = assignment.trainers(i);
      ranks.insert(task.assignment().rank());
      EXPECT_EQ(task.assignment().world_size(), 8);
      EXPECT_EQ(task.assignment().local_world_size(), 4);
      EXPECT_EQ(task.assignment().device_type(), v1::DEVICE_TYPE_CUDA);
      EXPECT_EQ(task.spec().name(), "gang");
      if (master.empty())
        master =
            absl::StrCat(task.assignment().master_addr(), ":", task.assignment().master_port());
      EXPECT_EQ(absl::StrCat(task.assignment().master_addr(), ":", task.assignment().master_port()),
                master);
    }
  }
  EXPECT_EQ(ranks.size(), 8u);
  // A heartbeat delivers an assignment once.
  EXPECT_EQ(Heartbeat("node-a").start_size(), 0);

  Heartbeat("node-a", {Task(assignments["node-a"], v1::TASK_STATE_RUNNING)});
  Heartbeat("node-b", {Task(assignments["node-b"], v1::TASK_STATE_RUNNING)});
  job =
      WaitForJob(job.job_id(), [](const v1::Job& j) { return j.state() == v1::JOB_STATE_RUNNING; });
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);

  v1::ReportRequest report;
  report.set_node_id("node-a");
  report.set_task_id(assignments["node-a"].task_id());
  report.set_first_sequence(1);
  for (int step = 1; step <= 3; ++step) {
    auto* r = report.add_reports();
    r->set_job_id(job.job_id());
    r->mutable_metrics()->set_step(step);
    r->mutable_metrics()->set_loss(5.0 - step);
  }
  v1::ReportResponse acked;
  ASSERT_TRUE(nodes_->Report(Context().get(), report, &acked).ok());
  EXPECT_EQ(acked.acked_sequence(), 3);
  v1::GetMetricsRequest metrics;
  metrics.set_job_id(job.job_id());
  v1::GetMetricsResponse curve;
  ASSERT_TRUE(stub_->GetMetrics(Context().get(), metrics, &curve).ok());
  ASSERT_EQ(curve.points_size(), 3);
  EXPECT_DOUBLE_EQ(curve.points(2).loss(), 2.0);
  metrics.set_max_points(1);
  ASSERT_TRUE(stub_->GetMetrics(Context().get(), metrics, &curve).ok());
  ASSERT_EQ(curve.points_size(), 1);
  EXPECT_DOUBLE_EQ(curve.points(0).loss(), 3.0);  // mean of 4, 3, 2
  EXPECT_EQ(curve.points(0).step(), 3);

  Heartbeat("node-a", {Task(assignments["node-a"], v1::TASK_STATE_SUCCEEDED)});
  Heartbeat("node-b", {Task(assignments["node-b"], v1::TASK_STATE_SUCCEEDED)});
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SUCCEEDED; });
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(job.current_step(), 3);

  std::vector<v1::JobState> states;
  int metric_events = 0;
  for (const auto& event : Watch(job.job_id(), 0)) {
    if (event.has_state_change()) states.push_back(event.state_change().new_state());
    metric_events += event.has_metrics();
  }
  EXPECT_EQ(states, (std::vector<v1::JobState>{v1::JOB_STATE_PENDING, v1::JOB_STATE_SCHEDULED,
                                               v1::JOB_STATE_RUNNING, v1::JOB_STATE_SUCCEEDED}));
  EXPECT_EQ(metric_events, 3);

  // The GPUs are free again.
  v1::ListNodesResponse listed;
  ASSERT_TRUE(stub_->ListNodes(Context().get(), {}, &listed).ok());
  ASSERT_EQ(listed.nodes_size(), 2);
  EXPECT_EQ(listed.nodes(0).free_gpus_size(), 4);
}

TEST_F(CoordinatorTest, PendingReasonNamesTheShortfall) {
  RegisterNode("small", 4, 0);
  v1::Job job = Submit(GpuSpec("too-big", 8, 8, 1));
  job = WaitForJob(job.job_id(), [](const v1::Job& j) {
    return j.reason().find("needs 8 GPUs") != std::string::npos;
  });
  EXPECT_EQ(job.state(), v1::JOB_STATE_PENDING);
  EXPECT_THAT(job.reason(), HasSubstr("needs 8 GPUs"));
}

TEST_F(CoordinatorTest, AutoLayoutIsPlannedForTheRegisteredGpus) {
  RegisterNode("gpu-node", 8, 0);
  v1::Job job = Submit(AutoGpuSpec("auto-fits", "gpt2-124m", 8, 8));
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();
  // GetJob shows the plan the planner chose, and why.
  const v1::LayoutPlan& plan = job.plan();
  EXPECT_TRUE(plan.fits());
  EXPECT_EQ(plan.device().name(), "h100-sxm");
  EXPECT_EQ(plan.layout().data_parallel(), 8);
  EXPECT_EQ(plan.gradient_accumulation_steps(), 1);
  EXPECT_GT(plan.memory().total_bytes(), plan.memory().weights_bytes());
  EXPECT_LT(plan.memory().total_bytes(), plan.memory().usable_bytes());
  EXPECT_GT(plan.step_time().tokens_per_second(), 0);
  // gpt2-124m fits plain data parallelism: no ZeRO, no recomputation (ZeRO-3's estimated edge
  // is within the planner's margin; the explanation names it).
  EXPECT_EQ(plan.layout().zero_stage(), 0);
  EXPECT_EQ(plan.layout().activation_checkpointing_mode(), v1::ACTIVATION_CHECKPOINTING_NONE);
  EXPECT_THAT(plan.explanation(), HasSubstr("of the fastest"));
  EXPECT_THAT(plan.explanation(), HasSubstr("NVIDIA H100 80GB HBM3"));
  // The trainers get the same plan.
  v1::HeartbeatResponse started = Heartbeat("gpu-node");
  ASSERT_EQ(started.start_size(), 1);
  EXPECT_EQ(started.start(0).trainers(0).plan().explanation(), plan.explanation());
}

TEST_F(CoordinatorTest, AutoLayoutSplitsAModelThatDoesNotFitReplicated) {
  RegisterNode("gpu-node", 8, 0);
  // 8B parameters of AdamW state (16 bytes each, 128 GB) replicated on 80 GB GPUs do not fit.
  // Data parallelism alone fits only with ZeRO 2/3; splitting the model over tensor or pipeline
  // parallel ranks (with ZeRO 0 or 1, all the trainer runs next to them) is estimated faster.
  v1::Job job = Submit(AutoGpuSpec("auto-split", "llama3-8b", 8, 1));
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();
  const v1::LayoutPlan& plan = job.plan();
  EXPECT_TRUE(plan.fits());
  const v1::Layout& layout = plan.layout();
  EXPECT_GT(layout.tensor_parallel() * layout.pipeline_parallel(), 1) << plan.explanation();
  EXPECT_LE(layout.zero_stage(), 1) << plan.explanation();
  EXPECT_EQ(layout.data_parallel() * layout.tensor_parallel() * layout.pipeline_parallel(), 8);
  EXPECT_LE(plan.memory().total_bytes(), plan.memory().usable_bytes());
  EXPECT_THAT(plan.explanation(), HasSubstr("Chosen among the layouts this trainer runs"));
  v1::HeartbeatResponse started = Heartbeat("gpu-node");
  ASSERT_EQ(started.start_size(), 1);
  const v1::Layout& sent = started.start(0).trainers(0).plan().layout();
  EXPECT_EQ(sent.tensor_parallel(), layout.tensor_parallel());
  EXPECT_EQ(sent.pipeline_parallel(), layout.pipeline_parallel());
  EXPECT_EQ(sent.zero_stage(), layout.zero_stage());
}

TEST_F(CoordinatorTest, AutoLayoutLimitedToDataParallelShardsWithZero) {
  RegisterNode("gpu-node", 8, 0);
  // The spec's limits hold: data parallel only (tp and pp at most 1), where ZeRO 2 or 3 is what
  // makes 8B fit.
  v1::JobSpec spec = AutoGpuSpec("auto-dp-only", "llama3-8b", 8, 1);
  spec.mutable_parallelism()->mutable_auto_layout()->set_max_tensor_parallel(1);
  spec.mutable_parallelism()->mutable_auto_layout()->set_max_pipeline_parallel(1);
  v1::Job job = Submit(spec);
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();
  EXPECT_EQ(job.plan().layout().data_parallel(), 8);
  EXPECT_GE(job.plan().layout().zero_stage(), 2);
}

TEST_F(CoordinatorTest, AutoLayoutThatFitsNowhereWaitsWithThePlannersReason) {
  RegisterNode("gpu-node", 8, 0);
  // 70B parameters of AdamW state (16 bytes each) over 8 x 80 GB GPUs: 140 GB per GPU whether
  // sharded with ZeRO-3 or split 8 ways by tensor and pipeline parallelism, so nothing fits.
  v1::Job job = Submit(AutoGpuSpec("auto-too-big", "llama3-70b", 8, 1));
  job = WaitForJob(job.job_id(), [](const v1::Job& j) {
    return j.reason().find("No layout fits") != std::string::npos;
  });
  EXPECT_EQ(job.state(), v1::JOB_STATE_PENDING);
  EXPECT_THAT(job.reason(), HasSubstr("does not fit: needs"));
  EXPECT_THAT(job.reason(), HasSubstr("over by"));
  EXPECT_EQ(Heartbeat("gpu-node").start_size(), 0);
}

TEST_F(CoordinatorTest, CpuJobsArePlannedAgainstTheHostsMemoryPerSlot) {
  // 1 GiB shared by 2 slots: gpt2-124m's fp32 AdamW state alone is 2 GB per rank.
  RegisterNode("small-host", 0, 2, int64_t{1} << 30);
  v1::JobSpec big = ValidSpec("cpu-too-big");
  big.mutable_model()->set_preset("gpt2-124m");
  v1::Job job = Submit(big);
  job = WaitForJob(job.job_id(), [](const v1::Job& j) {
    return j.reason().find("No layout fits") != std::string::npos;
  });
  EXPECT_EQ(job.state(), v1::JOB_STATE_PENDING);
  EXPECT_THAT(job.reason(), HasSubstr("cpu (512.0 MiB)"));
  // The tiny model fits in the same slots.
  v1::Job small = Submit(ValidSpec("cpu-fits"));
  small = WaitForJob(small.job_id(),
                     [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  EXPECT_EQ(small.state(), v1::JOB_STATE_SCHEDULED) << small.reason();
  EXPECT_TRUE(small.plan().fits());
  EXPECT_EQ(small.plan().memory().device_capacity_bytes(), int64_t{512} << 20);
}

TEST_F(CoordinatorTest, PlanLayoutForAHypotheticalOrTheLiveCluster) {
  v1::PlanLayoutRequest request;
  *request.mutable_spec() = AutoGpuSpec("plan", "gpt2-124m", 8, 8);
  v1::PlanLayoutResponse response;
  // No GPU node registered: the live cluster cannot be planned for.
  grpc::Status status = stub_->PlanLayout(Context().get(), request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("name a device"));
  // A hypothetical cluster: 64 H200s, 8 per node.
  request.set_gpu_type("h200");
  request.set_gpus(64);
  request.set_max_candidates(5);
  status = stub_->PlanLayout(Context().get(), request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(response.plan().fits());
  EXPECT_EQ(response.plan().world_size(), 64);
  EXPECT_EQ(response.plan().device().name(), "h200");
  EXPECT_EQ(response.candidates_size(), 5);
  // The live cluster once a node registered.
  RegisterNode("gpu-node", 8, 0);
  request.clear_gpu_type();
  request.set_gpus(0);
  status = stub_->PlanLayout(Context().get(), request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.plan().world_size(), 8);
  EXPECT_EQ(response.plan().device().name(), "h100-sxm");
  // Bad input.
  request.set_gpu_type("tpu-v5");
  EXPECT_EQ(stub_->PlanLayout(Context().get(), request, &response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  request.clear_gpu_type();
  request.mutable_spec()->mutable_data()->set_seq_len(4096);
  status = stub_->PlanLayout(Context().get(), request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("data.seq_len"));
}

TEST_F(CoordinatorTest, SubmitRefusesLayoutsTheTrainerDoesNotRun) {
  v1::SubmitJobRequest request;
  v1::SubmitJobResponse response;
  // ZeRO 2 and 3 shard gradients (and weights) over dp: the trainer does that only without
  // tensor or pipeline parallelism.
  v1::JobSpec tensor = GpuSpec("tp-zero2", 8, 4, 2);
  tensor.mutable_parallelism()->mutable_layout()->set_zero_stage(2);
  v1::JobSpec pipeline = GpuSpec("pp-zero3", 8, 4, 1);
  pipeline.mutable_parallelism()->mutable_layout()->set_pipeline_parallel(2);
  pipeline.mutable_parallelism()->mutable_layout()->set_zero_stage(3);
  const std::vector<std::pair<v1::JobSpec, std::string>> cases = {
      {tensor, "parallelism.layout.zero_stage: 2 with tensor_parallel 2: "},
      {pipeline, "parallelism.layout.zero_stage: 3 with pipeline_parallel 2: "}};
  for (const auto& [spec, field] : cases) {
    *request.mutable_spec() = spec;
    grpc::Status status = stub_->SubmitJob(Context().get(), request, &response);
    // Well formed (INVALID_ARGUMENT is for malformed specs), but the trainer does not implement
    // it.
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << spec.name();
    EXPECT_THAT(status.error_message(), HasSubstr(field)) << spec.name();
    EXPECT_THAT(status.error_message(), HasSubstr("this trainer does not run")) << spec.name();
    EXPECT_THAT(status.error_message(), HasSubstr("set zero_stage to 1")) << spec.name();
  }
  // A malformed layout is reported as such first.
  request.mutable_spec()->mutable_parallelism()->mutable_layout()->set_pipeline_parallel(3);
  grpc::Status status = stub_->SubmitJob(Context().get(), request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("parallelism.layout"));
  // Nothing was admitted.
  v1::ListJobsResponse listed;
  ASSERT_TRUE(stub_->ListJobs(Context().get(), {}, &listed).ok());
  EXPECT_EQ(listed.jobs_size(), 0);
  // PlanLayout still estimates such a layout (for a hypothetical cluster here).
  v1::PlanLayoutRequest plan;
  *plan.mutable_spec() = cases[0].first;
  plan.set_gpu_type("h100-sxm");
  v1::PlanLayoutResponse planned;
  status = stub_->PlanLayout(Context().get(), plan, &planned);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(planned.plan().layout().tensor_parallel(), 2);
  EXPECT_EQ(planned.plan().layout().zero_stage(), 2);
}

TEST_F(CoordinatorTest, SubmitAcceptsZeroAndRecomputationLayouts) {
  // ZeRO-3 with full recomputation over data parallel: what the trainer runs.
  v1::JobSpec spec = GpuSpec("zero3-full", 8, 8, 1);
  v1::Layout* layout = spec.mutable_parallelism()->mutable_layout();
  layout->set_zero_stage(3);
  layout->set_activation_checkpointing_mode(v1::ACTIVATION_CHECKPOINTING_FULL);
  v1::Job job = Submit(spec);
  ASSERT_FALSE(job.job_id().empty());
  EXPECT_EQ(job.plan().layout().zero_stage(), 3);
  EXPECT_EQ(job.plan().layout().activation_checkpointing_mode(), v1::ACTIVATION_CHECKPOINTING_FULL);
  // ZeRO over one data-parallel rank shards over that rank: accepted, like NeMo's distributed
  // optimizer, not refused for having nothing to shard over.
  v1::JobSpec single = GpuSpec("zero2-one-rank", 1, 1, 1);
  single.mutable_parallelism()->mutable_layout()->set_zero_stage(2);
  EXPECT_FALSE(Submit(single).job_id().empty());
  // And it is planned, not refused, once a GPU is there.
  RegisterNode("gpu-node", 8, 0);
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  EXPECT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();
  EXPECT_TRUE(job.plan().fits()) << job.plan().explanation();
}

TEST_F(CoordinatorTest, SubmitAcceptsTensorPipelineAndSequenceParallelLayouts) {
  // dp 2 x tp 2 x pp 2 with sequence parallelism, ZeRO-1 and selective recomputation: Megatron's
  // kind of layout, which the trainer runs.
  v1::JobSpec spec = GpuSpec("tp-pp-sp", 8, 2, 2);
  v1::Layout* layout = spec.mutable_parallelism()->mutable_layout();
  layout->set_pipeline_parallel(2);
  layout->set_sequence_parallel(true);
  layout->set_zero_stage(1);
  layout->set_activation_checkpointing_mode(v1::ACTIVATION_CHECKPOINTING_SELECTIVE);
  v1::Job job = Submit(spec);
  ASSERT_FALSE(job.job_id().empty());
  EXPECT_EQ(job.plan().layout().tensor_parallel(), 2);
  EXPECT_EQ(job.plan().layout().pipeline_parallel(), 2);
  // Pipeline parallel alone, ZeRO-0.
  v1::JobSpec pipeline = GpuSpec("pp-only", 8, 4, 1);
  pipeline.mutable_parallelism()->mutable_layout()->set_pipeline_parallel(2);
  EXPECT_FALSE(Submit(pipeline).job_id().empty());
  // Scheduled once GPUs are there, and every trainer gets the layout.
  RegisterNode("gpu-node", 8, 0);
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();
  EXPECT_TRUE(job.plan().fits()) << job.plan().explanation();
  v1::HeartbeatResponse started = Heartbeat("gpu-node");
  ASSERT_EQ(started.start_size(), 1);
  ASSERT_EQ(started.start(0).trainers_size(), 8);
  for (const auto& trainer : started.start(0).trainers()) {
    EXPECT_EQ(trainer.plan().layout().tensor_parallel(), 2);
    EXPECT_EQ(trainer.plan().layout().pipeline_parallel(), 2);
    EXPECT_TRUE(trainer.plan().layout().sequence_parallel());
    EXPECT_EQ(trainer.plan().layout().zero_stage(), 1);
  }
}

TEST_F(CoordinatorTest, SubmitChecksContextExpertAndVirtualStageDegrees) {
  // dp 4 x cp 2 on 8 GPUs: context-parallel ranks count in the world size.
  v1::JobSpec context = GpuSpec("cp-ok", 8, 4, 1);
  context.mutable_data()->set_seq_len(64);
  context.mutable_parallelism()->mutable_layout()->set_context_parallel(2);
  const v1::Job job = Submit(context);
  ASSERT_FALSE(job.job_id().empty());
  EXPECT_EQ(job.plan().layout().context_parallel(), 2);
  EXPECT_EQ(job.plan().world_size(), 8);

  v1::JobSpec seq_len = GpuSpec("cp-seq", 8, 2, 1);
  seq_len.mutable_data()->set_seq_len(60);
  seq_len.mutable_parallelism()->mutable_layout()->set_context_parallel(4);
  v1::JobSpec world = GpuSpec("cp-world", 8, 8, 1);
  world.mutable_parallelism()->mutable_layout()->set_context_parallel(2);
  v1::JobSpec dense = GpuSpec("ep-dense", 8, 8, 1);
  dense.mutable_parallelism()->mutable_layout()->set_expert_parallel(2);
  v1::JobSpec no_pipeline = GpuSpec("v-no-pp", 8, 8, 1);
  no_pipeline.mutable_parallelism()->mutable_layout()->set_pipeline_virtual_stages(2);
  v1::JobSpec negative = GpuSpec("ep-negative", 8, 8, 1);
  negative.mutable_parallelism()->mutable_layout()->set_expert_parallel(-1);
  const std::vector<std::pair<v1::JobSpec, std::string>> cases = {
      {seq_len,
       "parallelism.layout.context_parallel: 4: 2 x context_parallel (8) does not divide "
       "data.seq_len 60"},
      {world,
       "parallelism.layout: data_parallel 8 x tensor_parallel 1 x pipeline_parallel 1 x "
       "context_parallel 2 = 16 != resources.gpus 8"},
      {dense, "parallelism.layout.expert_parallel: 2 with a dense model (num_experts 0)"},
      {no_pipeline, "parallelism.layout.pipeline_virtual_stages: 2 needs pipeline_parallel > 1"},
      {negative, "parallelism.layout.expert_parallel: must be >= 0 (0 means 1), got -1"}};
  for (const auto& [spec, message] : cases) {
    v1::SubmitJobRequest request;
    *request.mutable_spec() = spec;
    v1::SubmitJobResponse response;
    grpc::Status status = stub_->SubmitJob(Context().get(), request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << spec.name();
    EXPECT_THAT(status.error_message(), HasSubstr(message)) << spec.name();
  }
  // Only the valid job was admitted.
  v1::ListJobsResponse listed;
  ASSERT_TRUE(stub_->ListJobs(Context().get(), {}, &listed).ok());
  EXPECT_EQ(listed.jobs_size(), 1);
}

TEST_F(CoordinatorTest, RotaryModelsMayTrainPastTheirPresetsMaxSeqLen) {
  // tiny-llama's preset context is 256 tokens; rotary positions extend, and the plan's model
  // (which the trainer builds from) covers the training length.
  v1::JobSpec spec = ValidSpec("long-context");
  spec.mutable_model()->set_preset("tiny-llama");
  spec.mutable_data()->set_seq_len(1024);
  v1::Job job = Submit(spec);
  ASSERT_FALSE(job.job_id().empty());
  EXPECT_EQ(job.plan().model().dims().max_seq_len(), 1024);
  // Learned positions (GPT-2) have no rows past theirs: INVALID_ARGUMENT naming the field.
  v1::SubmitJobRequest request;
  *request.mutable_spec() = ValidSpec("too-long");
  request.mutable_spec()->mutable_data()->set_seq_len(1024);
  v1::SubmitJobResponse response;
  grpc::Status status = stub_->SubmitJob(Context().get(), request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(),
              HasSubstr("data.seq_len: 1024 exceeds model max_seq_len 256"));
}

// A spec naming a Hugging Face directory is planned from its config.json; a directory without
// one, or an architecture Tessera does not run, is refused at submission naming the field.
TEST_F(CoordinatorTest, FromPretrainedIsPlannedFromTheModelsConfig) {
  const std::string model_dir = dir_.path() + "/hf-llama";
  std::filesystem::create_directories(model_dir);
  std::ofstream(model_dir + "/config.json")
      << R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 128,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false})";
  v1::JobSpec spec = ValidSpec("from-hf");
  spec.mutable_model()->set_from_pretrained(model_dir);
  v1::Job job = Submit(spec);
  ASSERT_FALSE(job.job_id().empty());
  EXPECT_EQ(job.plan().model().dims().hidden_size(), 64);
  EXPECT_EQ(job.plan().model().dims().num_layers(), 2);
  EXPECT_EQ(job.plan().model().dims().vocab_size(), 320);

  v1::SubmitJobRequest bad;
  *bad.mutable_spec() = ValidSpec("no-config");
  bad.mutable_spec()->mutable_model()->set_from_pretrained(dir_.path() + "/nowhere");
  v1::SubmitJobResponse response;
  grpc::Status status = stub_->SubmitJob(Context().get(), bad, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("model.from_pretrained"));
  EXPECT_THAT(status.error_message(), HasSubstr("config.json"));
}

}  // namespace
}  // namespace tessera
