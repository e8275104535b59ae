#include "client/job_view.h"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace tessera::client {
namespace {

struct Phase {
  const char* name;
  const char* short_name;
  double seconds;
};

std::vector<Phase> Phases(const v1::StepTimeBreakdown& b) {
  return {{"forward", "fwd", b.forward_seconds()},
          {"backward", "bwd", b.backward_seconds()},
          {"optimizer", "opt", b.optimizer_seconds()},
          {"data wait", "data", b.data_wait_seconds()},
          {"checkpoint blocked", "ckpt", b.checkpoint_blocked_seconds()},
          {"other", "other", b.other_seconds()}};
}

double PhaseSum(const v1::StepTimeBreakdown& b) {
  double sum = 0;
  for (const Phase& phase : Phases(b)) sum += phase.seconds;
  return sum;
}

// What percentages are taken of: the step's wall time, or (a report without one) the phases'
// sum, which the proto defines to equal it.
double StepSeconds(double step_seconds, const v1::StepTimeBreakdown& b) {
  return step_seconds > 0 ? step_seconds : PhaseSum(b);
}

double Percent(double part, double whole) { return whole > 0 ? 100.0 * part / whole : 0.0; }

// The collectives by time, largest first (the proto promises that order; a sort keeps the view
// right for a sender that does not).
std::vector<v1::CollectiveTime> ByTime(const v1::StepTimeBreakdown& b) {
  std::vector<v1::CollectiveTime> out(b.collectives().begin(), b.collectives().end());
  std::stable_sort(out.begin(), out.end(),
                   [](const v1::CollectiveTime& x, const v1::CollectiveTime& y) {
                     return x.seconds() > y.seconds();
                   });
  return out;
}

std::string CollectiveName(const v1::CollectiveTime& c) {
  return c.dim().empty() ? c.kind() : absl::StrCat(c.kind(), "/", c.dim());
}

std::string FormatBytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) return absl::StrFormat("%.1f GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return absl::StrFormat("%.1f MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return absl::StrFormat("%.1f KiB", b / 1024.0);
  return absl::StrFormat("%d B", bytes);
}

}  // namespace

bool HasBreakdown(const v1::StepTimeBreakdown& breakdown) {
  return PhaseSum(breakdown) > 0 || breakdown.collectives_size() > 0;
}

std::string TimeBreakdownBlock(const v1::StepMetrics& metrics) {
  const v1::StepTimeBreakdown& b = metrics.breakdown();
  if (!HasBreakdown(b)) return "";
  const double step = StepSeconds(metrics.step_time_seconds(), b);
  std::string out =
      absl::StrFormat("  Where the time goes (rank 0, step %d, %.3f s):\n", metrics.step(), step);
  for (const Phase& phase : Phases(b)) {
    absl::StrAppendFormat(&out, "    %-20s %8.3f s %6.1f%%\n", phase.name, phase.seconds,
                          Percent(phase.seconds, step));
  }
  const std::vector<v1::CollectiveTime> collectives = ByTime(b);
  if (collectives.empty()) return out;
  // Collective time overlaps the phase that issues it, so these do not add to the phases.
  out += "    collectives (inside the phases above):\n";
  for (size_t i = 0; i < collectives.size() && i < static_cast<size_t>(kTopCollectives); ++i) {
    const v1::CollectiveTime& c = collectives[i];
    absl::StrAppendFormat(&out, "      %-18s %8.3f s %6.1f%%  %d calls  %s\n", CollectiveName(c),
                          c.seconds(), Percent(c.seconds(), step), c.calls(),
                          FormatBytes(c.bytes()));
  }
  if (collectives.size() > static_cast<size_t>(kTopCollectives)) {
    double rest = 0;
    for (size_t i = kTopCollectives; i < collectives.size(); ++i) rest += collectives[i].seconds();
    absl::StrAppendFormat(&out, "      %-18s %8.3f s %6.1f%%\n",
                          absl::StrCat(collectives.size() - kTopCollectives, " more"), rest,
                          Percent(rest, step));
  }
  return out;
}

std::string RankBreakdownTable(const v1::StragglerReport& straggler) {
  bool any = false;
  size_t node_width = 4;
  for (const v1::RankStepTime& rank : straggler.ranks()) {
    any |= HasBreakdown(rank.breakdown());
    node_width = std::max(node_width, rank.node_id().size());
  }
  if (!any) return "";
  const int width = static_cast<int>(node_width);
  std::string out = "  ranks (mean per step since each rank's last heartbeat):\n";
  absl::StrAppendFormat(&out, "    %4s  %-*s  %8s %8s %6s %6s %6s %6s  %s\n", "rank", width, "node",
                        "step s", "busy s", "fwd%", "bwd%", "opt%", "data%", "top collective");
  for (const v1::RankStepTime& rank : straggler.ranks()) {
    const v1::StepTimeBreakdown& b = rank.breakdown();
    absl::StrAppendFormat(&out, "    %4d  %-*s  %8.3f %8.3f", rank.rank(), width, rank.node_id(),
                          rank.step_seconds(), rank.busy_seconds());
    if (!HasBreakdown(b)) {
      absl::StrAppendFormat(&out, " %6s %6s %6s %6s  %s\n", "-", "-", "-", "-", "-");
      continue;
    }
    const double step = StepSeconds(rank.step_seconds(), b);
    absl::StrAppendFormat(&out, " %6.1f %6.1f %6.1f %6.1f", Percent(b.forward_seconds(), step),
                          Percent(b.backward_seconds(), step), Percent(b.optimizer_seconds(), step),
                          Percent(b.data_wait_seconds(), step));
    const std::vector<v1::CollectiveTime> collectives = ByTime(b);
    if (collectives.empty()) {
      out += "  -\n";
    } else {
      absl::StrAppendFormat(&out, "  %s %.3f s\n", CollectiveName(collectives[0]),
                            collectives[0].seconds());
    }
  }
  return out;
}

std::string BreakdownSummary(const v1::StepMetrics& metrics) {
  const v1::StepTimeBreakdown& b = metrics.breakdown();
  if (!HasBreakdown(b)) return "";
  const double step = StepSeconds(metrics.step_time_seconds(), b);
  std::string out;
  for (const Phase& phase : Phases(b)) {
    // Checkpoint blocking is the exception, not the rule: shown only on the steps it hits.
    if (std::string(phase.short_name) == "ckpt" && phase.seconds <= 0) continue;
    absl::StrAppendFormat(&out, "%s%s %.0f%%", out.empty() ? "" : " ", phase.short_name,
                          Percent(phase.seconds, step));
  }
  const std::vector<v1::CollectiveTime> collectives = ByTime(b);
  if (!collectives.empty()) {
    absl::StrAppendFormat(&out, " | top %s %.0f%%", CollectiveName(collectives[0]),
                          Percent(collectives[0].seconds(), step));
  }
  return out;
}

std::string ExpertLoadBlock(const v1::StepMetrics& metrics) {
  if (metrics.expert_load_size() == 0) return "";
  const v1::ExpertLoad* worst = &metrics.expert_load(0);
  double sum = 0;
  for (const v1::ExpertLoad& load : metrics.expert_load()) {
    sum += load.imbalance();
    if (load.imbalance() > worst->imbalance()) worst = &load;
  }
  std::string out = absl::StrFormat(
      "  experts (step %d): imbalance (busiest expert / mean) %.2f mean over %d layers, %.2f "
      "worst in layer %d\n",
      metrics.step(), sum / metrics.expert_load_size(), metrics.expert_load_size(),
      worst->imbalance(), worst->layer());
  int64_t slots = 0;
  std::vector<int> experts;
  for (int e = 0; e < worst->tokens_size(); ++e) {
    slots += worst->tokens(e);
    experts.push_back(e);
  }
  if (slots == 0) return out;
  constexpr size_t kBusiest = 3;
  std::stable_sort(experts.begin(), experts.end(),
                   [&](int a, int b) { return worst->tokens(a) > worst->tokens(b); });
  std::vector<std::string> busiest;
  for (size_t i = 0; i < std::min(kBusiest, experts.size()); ++i) {
    busiest.push_back(absl::StrFormat(
        "%d (%.0f%%)", experts[i],
        Percent(static_cast<double>(worst->tokens(experts[i])), static_cast<double>(slots))));
  }
  absl::StrAppendFormat(&out, "    layer %d's busiest experts, by share of its %d slots: %s\n",
                        worst->layer(), slots, absl::StrJoin(busiest, ", "));
  return out;
}

bool HoldsGpus(const v1::Job& job) {
  return std::any_of(job.placements().begin(), job.placements().end(),
                     [](const v1::RankPlacement& p) { return p.gpu_index() >= 0; });
}

v1::Job WithGpuIdentity(v1::Job job, const std::vector<v1::Node>& nodes) {
  std::map<std::pair<std::string, int>, const v1::GpuDevice*> devices;
  for (const v1::Node& node : nodes) {
    for (const v1::GpuDevice& gpu : node.resources().gpus()) {
      devices[{node.node_id(), gpu.index()}] = &gpu;
    }
  }
  for (v1::RankPlacement& p : *job.mutable_placements()) {
    if (p.gpu_index() < 0 || !p.gpu_uuid().empty()) continue;
    const auto it = devices.find({p.node_id(), p.gpu_index()});
    if (it == devices.end()) continue;
    p.set_gpu_uuid(it->second->uuid());
    p.set_gpu_name(it->second->name());
  }
  return job;
}

std::string GpuTable(const v1::Job& job) {
  if (!HoldsGpus(job)) return "";
  size_t node_width = 4;
  for (const v1::RankPlacement& p : job.placements()) {
    node_width = std::max(node_width, p.node_id().size());
  }
  const int width = static_cast<int>(node_width);
  std::string out = "  gpus:\n";
  absl::StrAppendFormat(&out, "    %4s  %-*s  %3s  %s\n", "rank", width, "node", "gpu", "uuid");
  for (const v1::RankPlacement& p : job.placements()) {
    if (p.gpu_index() < 0) continue;
    absl::StrAppendFormat(&out, "    %4d  %-*s  %3d  %s", p.rank(), width, p.node_id(),
                          p.gpu_index(), p.gpu_uuid().empty() ? "?" : p.gpu_uuid());
    if (!p.gpu_name().empty()) absl::StrAppendFormat(&out, "  %s", p.gpu_name());
    out += "\n";
  }
  return out;
}

std::string RollbackLine(const v1::Rollback& rollback) {
  const v1::LossSpike& spike = rollback.spike();
  // Without rank 0's report (it did not reach the coordinator) only the step and cause are known.
  const std::string figures =
      spike.loss() != 0 || spike.loss_median() != 0
          ? absl::StrFormat(" (loss %.4g, window median %.4g)", spike.loss(), spike.loss_median())
          : std::string();
  return absl::StrFormat(
      "rollback after step %d%s: resumes from step %d, skips %d global batch(es) at step %d: %s",
      spike.step(), figures, rollback.resume_step(), rollback.skipped().batches(),
      rollback.skipped().step(), spike.cause());
}

std::string RollbackBlock(const v1::Job& job) {
  if (!job.spec().has_guard()) return "";
  const int max_rollbacks =
      job.spec().guard().max_rollbacks() > 0 ? job.spec().guard().max_rollbacks() : 3;
  std::string block =
      absl::StrFormat("  rollbacks: %d of %d\n", job.rollbacks_size(), max_rollbacks);
  for (const v1::Rollback& rollback : job.rollbacks()) {
    absl::StrAppend(&block, "    ", RollbackLine(rollback), "\n");
  }
  return block;
}

}  // namespace tessera::client
