#include "coordinator/service/coordinator_daemon.h"

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "coordinator/ha/leader_guard.h"

namespace tessera::coordinator {
namespace {

// Keeps the per-job series of `metrics` (tessera_job_running, the last step and checkpoint
// timestamps) in step with the jobs' commits, and seeds them with the jobs already RUNNING: a
// stalled job reports nothing after a coordinator restart and must still show. The observer goes
// in first, so a commit racing the list is not lost (SeedRunningJobs skips the older copy).
absl::Status WatchRunningJobs(JobManager& jobs, CoordinatorMetrics& metrics) {
  jobs.SetCommitObserver([&metrics](const v1::Job& job) { metrics.ObserveJob(job); });
  std::vector<v1::Job> running;
  std::string page_token;
  do {
    ASSIGN_OR_RETURN(JobPage page, jobs.List({v1::JOB_STATE_RUNNING}, 0, page_token));
    for (v1::Job& job : page.jobs) running.push_back(std::move(job));
    page_token = page.next_page_token;
  } while (!page_token.empty());
  metrics.SeedRunningJobs(running);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorDaemon>> CoordinatorDaemon::Start(
    const CoordinatorOptions& options) {
  std::unique_ptr<CoordinatorDaemon> daemon(new CoordinatorDaemon());
  for (const auto& [flag, value] : {std::pair<const char*, int>{"--client_call_threads",
                                                                  options.client_call_threads},
                                     std::pair<const char*, int>{"--node_call_threads",
                                                                  options.node_call_threads},
                                     std::pair<const char*, int>{"--max_queued_client_calls",
                                                                  options.max_queued_client_calls}}) {
    if (value < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " ", value, ": must be 0 (the default) or more"));
    }
  }
  // Security first: a daemon with unusable certificates or auth file must not start at all.
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> server_credentials,
                   DaemonServerCredentials("tessera-coordinator", options.listen_address,
                                           options.security, ClientCertPolicy::kRequestAndVerify));
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> worker_credentials,
                   DaemonChannelCredentials(options.security));
  ASSIGN_OR_RETURN(daemon->authenticator_,
                   Authenticator::Create({.auth_file = options.auth_file}));
  if (daemon->authenticator_->open() && !IsLoopbackAddress(options.listen_address)) {
    std::cerr << "tessera-coordinator: WARNING: no --auth_file: every caller that reaches "
              << options.listen_address << " may submit, cancel and register nodes\n";
  }
  daemon->limits_ = std::make_unique<ClientLimits>(options.limits);
  ASSIGN_OR_RETURN(daemon->store_,
                   Store::Open(options.state_path,
                               StoreOptions{.password_file = options.database_password_file}));
  if (LeaderElection* election = options.election; election != nullptr) {
    // Before the first write (Recover may write): a deposed leader stores nothing.
    daemon->store_->SetWriteFence(
        [election](DbConnection& writer) { return election->Fence(writer); });
  }
  // A bad queue file stops the daemon here; later versions that are bad are refused and logged.
  ASSIGN_OR_RETURN(daemon->queues_, QueueFile::Create({.path = options.queue_file,
                                                       .clock = options.cluster.clock}));
  daemon->jobs_ = std::make_unique<JobManager>(daemon->store_.get(), options.cluster.clock,
                                               daemon->queues_.get());
  ClusterOptions cluster = options.cluster;
  cluster.queues = daemon->queues_.get();
  // Each attempt's trainers run in a directory of their own: a relative root would give every
  // attempt a checkpoint directory of its own and hide earlier checkpoints from a restart.
  std::error_code error;
  std::filesystem::path root = std::filesystem::absolute(cluster.checkpoint_root, error);
  if (error) {
    return absl::InvalidArgumentError(
        absl::StrCat("--checkpoint_root ", cluster.checkpoint_root, ": ", error.message()));
  }
  cluster.checkpoint_root = root.lexically_normal().string();
  daemon->cluster_ =
      std::make_unique<Cluster>(daemon->store_.get(), daemon->jobs_.get(), std::move(cluster));
  RETURN_IF_ERROR(daemon->cluster_->Recover());
  daemon->notifier_ = std::make_unique<AssignmentNotifier>();
  daemon->cluster_->SetAssignmentNotifier(daemon->notifier_.get());
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  // Client calls at nice 10: under load, waiting submitters yield to heartbeats and the pass.
  // Beyond max_queued_client_calls waiting, clients are told to retry instead of queued.
  daemon->client_calls_ = std::make_unique<CallExecutor>(
      options.client_call_threads > 0 ? options.client_call_threads : std::max(16, 2 * cores),
      "client-calls", 10, options.max_queued_client_calls);
  // Node calls mostly wait for group commits, and a commit shared by more of them is cheaper
  // per call: at 10,000 simulated nodes on 2 cores, 64 threads placed 610-636 jobs/s and 16
  // threads 455-509 (docs/performance.md).
  daemon->node_calls_ = std::make_unique<CallExecutor>(
      options.node_call_threads > 0 ? options.node_call_threads : std::max(64, 8 * cores),
      "node-calls");
  daemon->coordinator_service_ = std::make_unique<CoordinatorService>(
      daemon->jobs_.get(), daemon->cluster_.get(), daemon->authenticator_.get(),
      daemon->limits_.get(),
      WorkerChannelSecurity{.credentials = std::move(worker_credentials),
                            .tls_server_name = options.worker_tls_server_name},
      daemon->client_calls_.get());
  daemon->cluster_->SetFollowUpExecutor(daemon->node_calls_.get());
  daemon->node_service_ =
      std::make_unique<NodeService>(daemon->cluster_.get(), daemon->authenticator_.get(),
                                    daemon->notifier_.get(), daemon->node_calls_.get());
  const int64_t epoch = options.election != nullptr ? options.election->epoch() : 0;
  daemon->node_service_->set_leader_epoch(epoch);

  // The metrics object needs the exposer's registry, and the gRPC server
  // needs its interceptor: DaemonServers hands over the registry in between.
  CoordinatorDaemon* raw = daemon.get();
  LeaderElection* const election = options.election;
  auto make_interceptors = [raw, epoch, election](prometheus::Registry* registry) {
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
        interceptors;
    if (election != nullptr) {
      interceptors.push_back(MakeLeadershipInterceptorFactory(
          [election] { return election->Valid(); }, election->advertise_address()));
    }
    if (registry == nullptr) return interceptors;
    raw->metrics_ = std::make_unique<CoordinatorMetrics>(*registry);
    raw->leadership_ = std::make_unique<LeadershipGauges>(*registry);
    raw->leadership_->Set(true, epoch);
    interceptors.push_back(raw->metrics_->MakeInterceptorFactory());
    return interceptors;
  };
  ASSIGN_OR_RETURN(daemon->servers_,
                   DaemonServers::Start(
                       {.component = "coordinator",
                        .listen_address = options.listen_address,
                        .metrics_listen_address = options.metrics_listen_address,
                        .health_listen_address = options.health_listen_address,
                        .credentials = std::move(server_credentials),
                        .max_message_bytes = options.max_request_bytes,
                        .async_hosts = {daemon->node_service_.get()}},
                       {{v1::Coordinator::service_full_name(), daemon->coordinator_service_.get()},
                        {v1::NodeService::service_full_name(), daemon->node_service_.get()}},
                       make_interceptors));

  CoordinatorMetrics* metrics = daemon->metrics_.get();
  if (metrics == nullptr) {
    daemon->cluster_->Start(nullptr);
    return daemon;
  }
  daemon->servers_->RegisterCollectable(metrics->job_series());
  daemon->executor_metrics_ = std::make_shared<ExecutorMetrics>(
      std::vector<const CallExecutor*>{daemon->client_calls_.get(), daemon->node_calls_.get()});
  daemon->servers_->RegisterCollectable(daemon->executor_metrics_);
  RETURN_IF_ERROR(WatchRunningJobs(*daemon->jobs_, *metrics));
  daemon->store_->SetWriteObserver([metrics](const StoreWriteStats& stats) {
    metrics->ObserveStoreWrite(stats.seconds, stats.cpu_seconds, stats.writes);
  });
  daemon->cluster_->SetSchedulingLatencyObserver(
      [metrics](double seconds) { metrics->ObserveSchedulingLatency(seconds); });
  daemon->cluster_->SetQueueWaitObserver([metrics](const std::string& queue, double seconds) {
    metrics->ObserveQueueWait(queue, seconds);
  });
  daemon->cluster_->Start([metrics](const ClusterStats& stats, double seconds) {
    metrics->ObserveSchedulingPass(seconds);
    metrics->ObserveSchedulingPassLock(stats.lock_held_seconds, stats.longest_lock_hold_seconds);
    metrics->ObserveSchedulingPassPhases(stats.phase_seconds);
    // An early pass (a job was submitted) leaves the cluster-wide figures to the regular ones.
    if (!stats.counted) return;
    metrics->SetJobCounts(stats.jobs);
    metrics->SetNodeCounts(stats.nodes);
    metrics->SetGpus(stats.gpus_total, stats.gpus_allocated);
    metrics->SetCpuSlots(stats.cpu_slots_total, stats.cpu_slots_allocated);
    metrics->SetRestarts(stats.restarts);
    metrics->SetFailures(stats.failures);
    metrics->SetOldestPendingSeconds(stats.oldest_pending_seconds);
    metrics->SetStragglers(stats.stragglers);
    metrics->SetQueues(stats.queues);
    metrics->SetTopology(stats.topology);
  });
  return daemon;
}

void CoordinatorDaemon::PrepareShutdown() {
  jobs_->CloseWatches();
  notifier_->Close();
}

CoordinatorDaemon::~CoordinatorDaemon() {
  if (cluster_) cluster_->Stop();
}

}  // namespace tessera::coordinator
