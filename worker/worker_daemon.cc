#include "worker/worker_daemon.h"

#include <unistd.h>

#include <iostream>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace tessera::worker {

absl::StatusOr<std::unique_ptr<WorkerDaemon>> WorkerDaemon::Start(const WorkerOptions& options) {
  std::unique_ptr<WorkerDaemon> daemon(new WorkerDaemon());
  std::string nvml_error;
  std::unique_ptr<GpuBackend> gpus = LoadNvml(&nvml_error);
  if (!gpus) std::cerr << "tessera-worker: no GPUs (" << nvml_error << ")" << std::endl;
  daemon->agent_ = std::make_unique<WorkerAgent>(options.agent, std::move(gpus));
  daemon->worker_service_ = std::make_unique<WorkerService>(daemon->agent_.get());
  ASSIGN_OR_RETURN(
      daemon->servers_,
      DaemonServers::Start({.component = "worker",
                            .listen_address = options.listen_address,
                            .metrics_listen_address = options.metrics_listen_address},
                           {{v1::Worker::service_full_name(), daemon->worker_service_.get()}}));
  if (prometheus::Registry* registry = daemon->servers_->registry(); registry != nullptr) {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    daemon->dcgm_ = std::make_unique<DcgmExporter>(*registry, name);
    daemon->training_ = std::make_unique<TrainingMetrics>(*registry);
    DcgmExporter* dcgm = daemon->dcgm_.get();
    TrainingMetrics* training = daemon->training_.get();
    daemon->agent_->SetGpuObserver(
        [dcgm](const std::vector<v1::GpuDevice>& devices, const std::vector<GpuSample>& samples) {
          dcgm->Update(devices, samples);
        });
    daemon->agent_->SetReportObserver(
        [training](const v1::TrainerReport& report) { training->Record(report); });
  }
  std::string address = daemon->servers_->address();
  std::string host = options.advertise_host;
  if (host.empty()) {
    host = address.substr(0, address.rfind(':'));
    if (host == "0.0.0.0" || host == "[::]") {
      char name[256] = {};
      gethostname(name, sizeof(name) - 1);
      host = name;
    }
  }
  RETURN_IF_ERROR(daemon->agent_->Start(absl::StrCat(host, address.substr(address.rfind(':')))));
  return daemon;
}

namespace {

prometheus::Family<prometheus::Gauge>& TrainingGauge(prometheus::Registry& registry,
                                                     const std::string& name,
                                                     const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(registry);
}

}  // namespace

// Series are labelled job_id, not job: Prometheus reserves `job` for the scrape job and would
// rename ours to exported_job.
TrainingMetrics::TrainingMetrics(prometheus::Registry& registry)
    : loss_(TrainingGauge(registry, "tessera_train_loss",
                          "Training loss (nats per token) of the newest step reported by a "
                          "trainer; NaN when the step's loss was not finite")),
      tokens_per_second_(TrainingGauge(registry, "tessera_train_tokens_per_second",
                                       "Training tokens per second of the whole job, newest step")),
      mfu_(TrainingGauge(registry, "tessera_train_mfu_ratio",
                         "Model FLOPs utilisation of the newest step, in [0, 1]")),
      step_time_(TrainingGauge(registry, "tessera_train_step_time_seconds",
                               "Wall time of the newest optimizer step")),
      grad_norm_(TrainingGauge(registry, "tessera_train_grad_norm",
                               "Global gradient norm of the newest step, before clipping")),
      learning_rate_(TrainingGauge(registry, "tessera_train_learning_rate",
                                   "Learning rate of the newest step")),
      step_(TrainingGauge(registry, "tessera_train_step", "Newest optimizer step reported")),
      eval_loss_(TrainingGauge(registry, "tessera_eval_loss",
                               "Validation loss (nats per token) of the newest evaluation")) {}

void TrainingMetrics::Record(const v1::TrainerReport& report) {
  const prometheus::Labels labels = {{"job_id", report.job_id()},
                                     {"rank", std::to_string(report.rank())}};
  if (report.has_eval()) eval_loss_.Add(labels).Set(report.eval().loss());
  if (!report.has_metrics()) return;
  const v1::StepMetrics& metrics = report.metrics();
  loss_.Add(labels).Set(metrics.loss());
  tokens_per_second_.Add(labels).Set(metrics.tokens_per_second());
  mfu_.Add(labels).Set(metrics.mfu());
  step_time_.Add(labels).Set(metrics.step_time_seconds());
  grad_norm_.Add(labels).Set(metrics.grad_norm());
  learning_rate_.Add(labels).Set(metrics.learning_rate());
  step_.Add(labels).Set(static_cast<double>(metrics.step()));
}

WorkerDaemon::~WorkerDaemon() {
  if (agent_) agent_->Stop();
}

}  // namespace tessera::worker
