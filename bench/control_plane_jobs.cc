#include "bench/control_plane_jobs.h"

#include <algorithm>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tessera::bench {
namespace {

// Sequences per rank per pass, and passes per optimizer step.
constexpr int kMicroBatch = 4;
constexpr int kGradientAccumulation = 2;

}  // namespace

v1::JobSpec BenchJobSpec(int gpus, int64_t sequence, const std::string& queue) {
  v1::JobSpec spec;
  spec.set_name(absl::StrCat("bench-", gpus, "gpu-", sequence));
  spec.mutable_model()->set_preset("gpt2-124m");
  spec.mutable_data()->add_train_shards("/datasets/bench/train-*.bin");
  spec.mutable_data()->add_validation_shards("/datasets/bench/val-*.bin");
  spec.mutable_data()->set_seq_len(1024);
  spec.mutable_batch()->set_micro_batch_size(kMicroBatch);
  spec.mutable_batch()->set_global_batch_size(int64_t{kMicroBatch} * gpus * kGradientAccumulation);
  v1::Layout* layout = spec.mutable_parallelism()->mutable_layout();
  layout->set_data_parallel(gpus);
  layout->set_tensor_parallel(1);
  layout->set_pipeline_parallel(1);
  v1::OptimizerSpec* optimizer = spec.mutable_optimizer();
  optimizer->mutable_schedule()->set_peak_learning_rate(6e-4);
  optimizer->mutable_schedule()->set_warmup_steps(100);
  optimizer->mutable_schedule()->set_min_lr_ratio(0.1);
  optimizer->set_weight_decay(0.1);
  optimizer->set_grad_clip_norm(1.0);
  spec.set_precision(v1::PRECISION_BF16);
  spec.set_max_steps(5000);
  spec.mutable_checkpoint()->set_interval_steps(1000);
  spec.mutable_resources()->set_gpus(gpus);
  spec.mutable_resources()->set_gpu_type("H100");
  (*spec.mutable_labels())["bench"] = "control-plane";
  if (!queue.empty()) spec.set_queue(queue);
  return spec;
}

JobStream::JobStream(std::shared_ptr<grpc::Channel> channel, JobStreamOptions options)
    : options_(std::move(options)), stub_(v1::Coordinator::NewStub(std::move(channel))) {
  for (int gpus : options_.gpu_sizes) latency_by_size_[gpus];
}

JobStream::~JobStream() { Stop(); }

void JobStream::Start() {
  thread_ = std::thread([this] { SubmitLoop(); });
}

void JobStream::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_.joinable()) thread_.join();
  // Every call ends by its deadline.
  while (in_flight_.load(std::memory_order_acquire) > 0) absl::SleepFor(absl::Milliseconds(1));
}

const LatencyRecorder& JobStream::scheduling_latency(int gpus) const {
  static const LatencyRecorder* const kEmpty = new LatencyRecorder();
  auto it = latency_by_size_.find(gpus);
  return it == latency_by_size_.end() ? *kEmpty : it->second;
}

JobStreamCounters JobStream::counters() const {
  JobStreamCounters counters;
  counters.submitted = submitted_.load();
  counters.submit_failures = submit_failures_.load();
  counters.skipped_in_flight = skipped_in_flight_.load();
  counters.skipped_backlog = skipped_backlog_.load();
  absl::MutexLock lock(&mu_);
  counters.delivered = delivered_;
  counters.backlog = static_cast<int64_t>(tracked_.size());
  counters.first_error = first_error_;
  return counters;
}

void JobStream::SubmitLoop() {
  std::mt19937_64 random(options_.seed);
  std::discrete_distribution<size_t> pick_size(options_.weights.begin(), options_.weights.end());
  std::mt19937_64 queue_random(options_.seed + 1);
  std::discrete_distribution<size_t> pick_queue(options_.queue_weights.begin(),
                                                options_.queue_weights.end());
  const std::chrono::nanoseconds period =
      absl::ToChronoNanoseconds(absl::Seconds(1) / options_.jobs_per_second);
  Clock::time_point next = Clock::now();
  int64_t sequence = 0;
  while (!stop_.WaitForNotificationWithTimeout(
      std::max(absl::ZeroDuration(), absl::FromChrono(next - Clock::now())))) {
    next += period;
    const int gpus = options_.gpu_sizes[pick_size(random) % options_.gpu_sizes.size()];
    const std::string queue =
        options_.queues.empty()
            ? std::string()
            : options_.queues[pick_queue(queue_random) % options_.queues.size()];
    if (in_flight_.load() >= options_.max_submits_in_flight) {
      skipped_in_flight_.fetch_add(1);
      continue;
    }
    int64_t backlog;
    {
      absl::MutexLock lock(&mu_);
      backlog = static_cast<int64_t>(tracked_.size());
    }
    if (backlog + in_flight_.load() >= options_.max_backlog) {
      skipped_backlog_.fetch_add(1);
      continue;
    }
    Submit(gpus, ++sequence, queue);
  }
}

void JobStream::Submit(int gpus, int64_t sequence, const std::string& queue) {
  struct Call {
    grpc::ClientContext context;
    v1::SubmitJobRequest request;
    v1::SubmitJobResponse response;
    Clock::time_point sent;
  };
  auto call = std::make_shared<Call>();
  call->context.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  *call->request.mutable_spec() = BenchJobSpec(gpus, sequence, queue);
  call->sent = Clock::now();
  in_flight_.fetch_add(1);
  stub_->async()->SubmitJob(
      &call->context, &call->request, &call->response, [this, gpus, call](grpc::Status status) {
        const Clock::time_point done = Clock::now();
        if (status.ok()) {
          submit_latency_.Record(done, SecondsBetween(call->sent, done));
          submitted_.fetch_add(1);
          absl::MutexLock lock(&mu_);
          const std::string& job_id = call->response.job().job_id();
          Tracked& job = tracked_[job_id];
          job.gpus = gpus;
          job.submitted = done;
          SettleLocked(job_id);
        } else {
          submit_failures_.fetch_add(1);
          absl::MutexLock lock(&mu_);
          if (first_error_.empty()) {
            first_error_ =
                absl::StrCat("SubmitJob: ", status.error_code(), " ", status.error_message());
          }
        }
        in_flight_.fetch_sub(1, std::memory_order_release);
      });
}

void JobStream::OnDelivered(const std::string& job_id, int ranks, int world_size,
                            Clock::time_point at) {
  absl::MutexLock lock(&mu_);
  Tracked& job = tracked_[job_id];
  job.ranks_delivered += ranks;
  job.world_size = world_size;
  job.last_delivery = std::max(job.last_delivery, at);
  SettleLocked(job_id);
}

void JobStream::SettleLocked(const std::string& job_id) {
  auto it = tracked_.find(job_id);
  if (it == tracked_.end()) return;
  const Tracked& job = it->second;
  if (!job.submitted.has_value() || job.world_size == 0 || job.ranks_delivered < job.world_size) {
    return;
  }
  const double seconds = SecondsBetween(*job.submitted, job.last_delivery);
  scheduling_latency_.Record(job.last_delivery, seconds);
  if (auto by_size = latency_by_size_.find(job.gpus); by_size != latency_by_size_.end()) {
    by_size->second.Record(job.last_delivery, seconds);
  }
  ++delivered_;
  tracked_.erase(it);
}

}  // namespace tessera::bench
