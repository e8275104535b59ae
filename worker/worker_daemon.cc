#include "worker/worker_daemon.h"

#include <unistd.h>

#include <filesystem>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "common/security/tls.h"
#include "common/status_macros.h"
#include "worker/node_key.h"

namespace tessera::worker {
namespace {

// A job whose trainers finished needs no shards in memory any more (its last checkpoint is on
// storage); a job that failed keeps them until it restarts or the cap evicts them.
void ForgetFinishedJob(ShardCacheStore* store, const v1::TrainerReport& report) {
  if (store != nullptr && report.has_finished()) store->DropJob(report.job_id());
}

// Who may call the ShardCache service: the list given; by default, under TLS, this worker's own
// certificate CN (its peers are workers with the same kind of certificate); "*" alone: anyone
// the CA signed.
absl::StatusOr<std::vector<std::string>> ShardCacheCallers(const WorkerOptions& options) {
  const std::vector<std::string>& given = options.shard_cache_allowed_callers;
  if (given.size() == 1 && given.front() == "*") return std::vector<std::string>();
  if (!given.empty()) return given;
  if (options.security.tls.cert_file.empty()) return std::vector<std::string>();
  absl::StatusOr<std::string> own = CertificateCommonName(options.security.tls.cert_file);
  if (!own.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--shard_cache_allowed_callers is empty, so it defaults to this worker's certificate "
        "CN, which cannot be read: ",
        own.status().message()));
  }
  return std::vector<std::string>{*own};
}

}  // namespace

absl::Status WorkerDaemon::StartShardCache(const WorkerOptions& options,
                                           WorkerAgentOptions& agent) {
  if (options.shard_cache_bytes == 0) return absl::OkStatus();
  const int64_t capacity =
      options.shard_cache_bytes > 0 ? options.shard_cache_bytes : DefaultShardCacheBytes();
  shard_store_ = std::make_unique<ShardCacheStore>(capacity);
  // Peers are workers: the node certificate that this worker presents to the coordinator.
  shard_peers_ = std::make_unique<ShardCachePeers>(
      ShardCachePeersOptions{.credentials = agent.coordinator_credentials});
  ASSIGN_OR_RETURN(std::vector<std::string> allowed, ShardCacheCallers(options));
  shard_service_ = std::make_unique<ShardCacheService>(shard_store_.get(), std::move(allowed));
  const std::string socket_path = absl::StrCat(agent.work_dir, "/shard-cache.sock");
  std::error_code ignored;
  std::filesystem::create_directories(agent.work_dir, ignored);
  ASSIGN_OR_RETURN(shard_socket_, LocalShardCacheServer::Start(socket_path, shard_store_.get(),
                                                               shard_peers_.get(), nullptr));
  agent.shard_cache_socket = socket_path;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<WorkerDaemon>> WorkerDaemon::Start(const WorkerOptions& options) {
  std::unique_ptr<WorkerDaemon> daemon(new WorkerDaemon());
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> server_credentials,
                   DaemonServerCredentials("tessera-worker", options.listen_address,
                                           options.security, ClientCertPolicy::kRequireAndVerify));
  WorkerAgentOptions agent = options.agent;
  ASSIGN_OR_RETURN(agent.coordinator_credentials, DaemonChannelCredentials(options.security));
  ASSIGN_OR_RETURN(agent.node_key, LoadOrCreateNodeKey(agent.work_dir));
  std::string nvml_error;
  std::unique_ptr<GpuBackend> gpus = LoadNvml(&nvml_error);
  if (!gpus) std::cerr << "tessera-worker: no GPUs (" << nvml_error << ")" << std::endl;
  RETURN_IF_ERROR(daemon->StartShardCache(options, agent));
  daemon->agent_ = std::make_unique<WorkerAgent>(std::move(agent), std::move(gpus));
  daemon->worker_service_ = std::make_unique<WorkerService>(daemon->agent_.get(), options.allowed_callers);
  std::vector<NamedService> services = {{.name = v1::Worker::service_full_name(),
                                         .service = daemon->worker_service_.get(),
                                         .serving_at_start = false}};
  if (daemon->shard_service_ != nullptr) {
    services.push_back({.name = v1::ShardCache::service_full_name(),
                        .service = daemon->shard_service_.get(),
                        .serving_at_start = true});
  }
  ASSIGN_OR_RETURN(
      daemon->servers_,
      DaemonServers::Start({.component = "worker",
                            .listen_address = options.listen_address,
                            .metrics_listen_address = options.metrics_listen_address,
                            .health_listen_address = options.health_listen_address,
                            .credentials = std::move(server_credentials)},
                           services));
  // Readiness (the chart's probe asks for this service): serving once registered.
  DaemonServers* servers = daemon->servers_.get();
  daemon->agent_->SetRegistrationObserver([servers](bool registered) {
    servers->SetServing(v1::Worker::service_full_name(), registered);
  });
  if (prometheus::Registry* registry = daemon->servers_->registry(); registry != nullptr) {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    daemon->dcgm_ = std::make_unique<DcgmExporter>(*registry, name);
    daemon->training_ = std::make_shared<TrainingMetrics>();
    // Set before the first scrape can call Collect.
    WorkerAgent* agent = daemon->agent_.get();
    daemon->training_->SetRunningRanks(options.agent.node_id,
                                       [agent] { return agent->RunningRanks(); });
    daemon->servers_->RegisterCollectable(daemon->training_);
    daemon->contact_ =
        std::make_shared<CoordinatorContactMetrics>([agent] { return agent->Contact(); });
    daemon->servers_->RegisterCollectable(daemon->contact_);
    DcgmExporter* dcgm = daemon->dcgm_.get();
    TrainingMetrics* training = daemon->training_.get();
    daemon->agent_->SetGpuObserver(
        [dcgm](const std::vector<v1::GpuDevice>& devices, const std::vector<GpuSample>& samples) {
          dcgm->Update(devices, samples);
        });
    daemon->shard_metrics_ =
        daemon->shard_store_ != nullptr
            ? std::make_unique<ShardCacheMetrics>(*daemon->servers_->registry())
            : nullptr;
    ShardCacheMetrics* shard_metrics = daemon->shard_metrics_.get();
    if (daemon->shard_socket_ != nullptr) daemon->shard_socket_->SetMetrics(shard_metrics);
    ShardCacheStore* shard_store = daemon->shard_store_.get();
    daemon->agent_->SetReportObserver(
        [training, shard_metrics, shard_store](const v1::TrainerReport& report) {
          training->Record(report);
          if (shard_metrics != nullptr) shard_metrics->RecordReport(report);
          ForgetFinishedJob(shard_store, report);
        });
  } else if (daemon->shard_store_ != nullptr) {
    ShardCacheStore* shard_store = daemon->shard_store_.get();
    daemon->agent_->SetReportObserver(
        [shard_store](const v1::TrainerReport& report) { ForgetFinishedJob(shard_store, report); });
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

WorkerDaemon::~WorkerDaemon() {
  if (agent_) agent_->Stop();
}

}  // namespace tessera::worker
