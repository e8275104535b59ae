// The environment contract between a worker and the trainer processes it launches: the names of
// the variables the worker sets for each rank (worker/worker_agent.cc) and the trainer reads
// (trainer/parallel/distributed.cc's ResolveRankAssignment), in torchrun's spelling so that a trainer
// started by torchrun joins the same way. Values are decimal integers unless said otherwise; in
// the trainer they override the matching RankAssignment fields of its task file. Header-only and
// dependency-free so both sides include it.
#pragma once

#include <csignal>

namespace tessera {

// Global rank of the process in its job, in [0, WORLD_SIZE).
inline constexpr char kRankEnv[] = "RANK";
// Number of processes in the job.
inline constexpr char kWorldSizeEnv[] = "WORLD_SIZE";
// Rank among the job's processes on this node, in [0, LOCAL_WORLD_SIZE).
inline constexpr char kLocalRankEnv[] = "LOCAL_RANK";
// Number of the job's processes on this node.
inline constexpr char kLocalWorldSizeEnv[] = "LOCAL_WORLD_SIZE";
// Host name or address of rank 0's TCPStore (the rendezvous point); also the address Gloo binds.
inline constexpr char kMasterAddrEnv[] = "MASTER_ADDR";
// TCP port of rank 0's TCPStore, in [1, 65535].
inline constexpr char kMasterPortEnv[] = "MASTER_PORT";
// The port a trainer uses when neither MASTER_PORT nor its task gives one (torchrun's default).
inline constexpr int kDefaultMasterPort = 29500;
// Read by the CUDA runtime, not by the trainer: the worker sets it to the one GPU index the rank
// owns (and rewrites the task's gpu_index to 0, the only device the process then sees), or to ""
// for a CPU rank, which hides every GPU.
inline constexpr char kCudaVisibleDevicesEnv[] = "CUDA_VISIBLE_DEVICES";
// Intra-op threads of the rank's OpenMP and MKL pools, which LibTorch sizes from them; the worker
// sets both to its share of the node's cores (torchrun sets OMP_NUM_THREADS=1 when it starts
// several ranks on a node), so that ranks do not oversubscribe the cores.
inline constexpr char kOmpNumThreadsEnv[] = "OMP_NUM_THREADS";
inline constexpr char kMklNumThreadsEnv[] = "MKL_NUM_THREADS";
// Tessera's own, not torchrun's: the pid of the worker that launched the trainer. A trainer that
// finds it set asks the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG) and exits at
// once if its parent is already another process, so no trainer outlives its worker. Unset for
// standalone and torchrun launches.
inline constexpr char kWorkerPidEnv[] = "TESSERA_WORKER_PID";
// Fault injection for tests of alerting and failure handling, never set in production: a step
// number N; from step N on the trainer's loss reads NaN, so it reports that step with loss NaN
// and fails with FAILURE_KIND_NAN_LOSS as a diverged run would. Trainers inherit it from their
// worker's environment.
inline constexpr char kFaultNanLossAtStepEnv[] = "TESSERA_FAULT_NAN_LOSS_AT_STEP";
// Fault injection for tests of the loss-spike guard (JobSpec.guard), never set in production: a
// global batch number N (from 1: the batch step N draws when no data is skipped); the loss of the
// step that trains that batch reads 1000 times its value, as if the batch were poisoned. A
// rollback that skips the batch therefore gets past it, and one that does not meets it again.
inline constexpr char kFaultLossSpikeAtBatchEnv[] = "TESSERA_FAULT_LOSS_SPIKE_AT_BATCH";
// Fault injection, never set in production: a step number N; the background write of step N's
// checkpoint cuts the rank's shard to half its size and the process kills itself with SIGKILL
// before the commit, as a machine dying in the middle of an asynchronous save would.
inline constexpr char kFaultKillInCheckpointAtStepEnv[] = "TESSERA_FAULT_KILL_IN_CHECKPOINT_AT_STEP";
// Fault injection, never set in production: "1" makes the trainer ignore kCheckpointAndStopSignal,
// as a hung or old trainer would; the worker stops it once the order's deadline has passed.
inline constexpr char kFaultIgnoreCheckpointSignalEnv[] = "TESSERA_FAULT_IGNORE_CHECKPOINT_SIGNAL";

// Not an environment variable: the signal a worker sends each rank
// of a task the coordinator asked to checkpoint and stop (HeartbeatResponse.checkpoint_and_stop,
// a drained node). The ranks agree on a step, save a checkpoint of it and exit 0; the worker
// reports the task STOPPED.
inline constexpr int kCheckpointAndStopSignal = SIGUSR1;

}  // namespace tessera
