// Layout evaluation, enumeration and choice (layout_planner.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "planner/devices.h"
#include "planner/layout_planner.h"
#include "planner/model_config.h"

namespace tessera::planner {
namespace {

constexpr v1::ActivationCheckpointing kNone = v1::ACTIVATION_CHECKPOINTING_NONE;
constexpr v1::ActivationCheckpointing kSelective = v1::ACTIVATION_CHECKPOINTING_SELECTIVE;
constexpr v1::ActivationCheckpointing kFull = v1::ACTIVATION_CHECKPOINTING_FULL;

// The estimates are uncalibrated (docs/planner.md): a higher ZeRO stage or more recomputation than
// another fitting layout of the same tp, pp and sp needs is chosen only when it is estimated more
// than this fraction faster. Small models on NVLink, for example, come out a few percent faster
// with ZeRO-3 (the optimizer steps a 1/dp shard) - within the model's error, not worth the extra
// collectives.
constexpr double kSimplerLayoutMargin = 0.10;

// Orders layouts from the simplest: lexicographic in ZeRO stage, recomputation, sp, pp, tp, then
// the newer splits (cp, virtual stages, ep; 0 and 1 alike mean none).
std::tuple<int, int, bool, int, int, int, int, int> Complexity(const v1::Layout& l) {
  return std::make_tuple(
      l.zero_stage(), static_cast<int>(l.activation_checkpointing_mode()), l.sequence_parallel(),
      l.pipeline_parallel(), l.tensor_parallel(), std::max(1, l.context_parallel()),
      std::max(1, l.pipeline_virtual_stages()), std::max(1, l.expert_parallel()));
}

// Whether two layouts split the model and the sequence the same way (all but ZeRO, recomputation
// and the micro-batch).
bool SameShape(const v1::Layout& a, const v1::Layout& b) {
  return a.tensor_parallel() == b.tensor_parallel() &&
         a.pipeline_parallel() == b.pipeline_parallel() &&
         a.sequence_parallel() == b.sequence_parallel() &&
         std::max(1, a.context_parallel()) == std::max(1, b.context_parallel()) &&
         std::max(1, a.expert_parallel()) == std::max(1, b.expert_parallel()) &&
         std::max(1, a.pipeline_virtual_stages()) == std::max(1, b.pipeline_virtual_stages());
}

std::vector<int> Divisors(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d) {
    if (n % d == 0) out.push_back(d);
  }
  return out;
}

const v1::MemoryEstimate& WorstStage(const std::vector<v1::MemoryEstimate>& stages) {
  return *std::max_element(stages.begin(), stages.end(),
                           [](const v1::MemoryEstimate& a, const v1::MemoryEstimate& b) {
                             return a.total_bytes() < b.total_bytes();
                           });
}

std::string DeviceLabel(const ClusterShape& cluster) {
  if (cluster.device.memory_bytes() <= 0)
    return absl::StrCat(cluster.device.name(), " (memory unknown)");
  return absl::StrCat(cluster.device.name(), " (", FormatBytes(cluster.device.memory_bytes()), ")");
}

// "peak 8.6 MiB of 70.9 GiB usable per device", or without the capacity when it is unknown.
std::string PeakLabel(const v1::MemoryEstimate& memory) {
  if (memory.usable_bytes() <= 0) {
    return absl::StrCat("peak ", FormatBytes(memory.total_bytes()),
                        " per device (memory not checked)");
  }
  return absl::StrCat("peak ", FormatBytes(memory.total_bytes()), " of ",
                      FormatBytes(memory.usable_bytes()), " usable per device");
}

// Evaluates `l` into `result`. A structural problem is the same for every zero/sp/ac/micro-batch
// variant of a shape: keep one of them so the list says why, not how many times.
// `structural` holds the reasons kept so far (a set: searches over hundreds of devices evaluate
// tens of thousands of layouts).
void AddCandidate(const Workload& w, const LayoutChoice& l, const ClusterShape& c,
                  absl::flat_hash_set<std::string>& structural, SearchResult& result) {
  v1::LayoutCandidate candidate = EvaluateLayout(w, l, c);
  if (!candidate.rejected_reason().empty() && !candidate.plan().has_memory() &&
      !structural.insert(candidate.rejected_reason()).second) {
    return;
  }
  result.candidates.push_back(std::move(candidate));
}

// Why the chosen layout `l` uses context parallelism, expert parallelism or virtual stages: for
// each degree above 1, how the fastest fitting layout without it compares, or that nothing fits
// without it (with the closest miss).
void AppendSplitReasons(const SearchResult& result, const LayoutChoice& l,
                        std::string& explanation) {
  const struct {
    const char* name;
    int degree;
    int (v1::Layout::*field)() const;
  } splits[] = {{"context_parallel", l.cp, &v1::Layout::context_parallel},
                {"expert_parallel", l.ep, &v1::Layout::expert_parallel},
                {"pipeline_virtual_stages", l.v, &v1::Layout::pipeline_virtual_stages}};
  const double chosen_speed = [&] {
    for (const v1::LayoutCandidate& x : result.candidates) {
      if (x.plan().fits() && FromProto(x.plan().layout(), x.plan().micro_batch_size()) == l) {
        return x.plan().step_time().tokens_per_second();
      }
    }
    return 0.0;
  }();
  for (const auto& split : splits) {
    if (split.degree <= 1) continue;
    // Candidates are ranked: the first one without the split is the best of them (fastest
    // fitting, or the closest miss when none fits).
    const auto without = std::find_if(
        result.candidates.begin(), result.candidates.end(), [&](const v1::LayoutCandidate& x) {
          return x.plan().has_memory() && (x.plan().layout().*split.field)() <= 1;
        });
    if (without == result.candidates.end()) {
      absl::StrAppend(&explanation, " ", split.name, " ", split.degree,
                      ": no layout without it was considered.");
      continue;
    }
    const v1::LayoutPlan& other = without->plan();
    const std::string other_layout = Describe(FromProto(other.layout(), other.micro_batch_size()));
    if (!other.fits()) {
      absl::StrAppend(&explanation, " ", split.name, " ", split.degree,
                      ": without it no layout fits (closest: ", other_layout, " ",
                      without->rejected_reason(), ").");
    } else if (chosen_speed > 0) {
      // Slower happens when a simpler layout of the split's shape was preferred to its fastest.
      const double gain = chosen_speed / other.step_time().tokens_per_second() - 1;
      absl::StrAppendFormat(&explanation,
                            " %s %d: %.1f%% %s than the fastest layout without it (%s at %.0f "
                            "tokens/s).",
                            split.name, split.degree, 100 * std::abs(gain),
                            gain >= 0 ? "faster" : "slower", other_layout,
                            other.step_time().tokens_per_second());
    }
  }
}

}  // namespace

std::string ActivationCheckpointingName(v1::ActivationCheckpointing ac) {
  switch (ac) {
    case kSelective:
      return "selective";
    case kFull:
      return "full";
    default:
      return "none";
  }
}

std::string FormatBytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (std::abs(b) >= static_cast<double>(int64_t{1} << 30))
    return absl::StrFormat("%.1f GiB", b / (1 << 30));
  if (std::abs(b) >= static_cast<double>(1 << 20))
    return absl::StrFormat("%.1f MiB", b / (1 << 20));
  return absl::StrFormat("%.1f KiB", b / 1024);
}

std::string Describe(const LayoutChoice& l) {
  std::string out =
      absl::StrCat("dp=", l.dp, " tp=", l.tp, " pp=", l.pp, " zero=", l.zero, " mb=", l.micro_batch,
                   " sp=", l.sp ? "on" : "off", " ac=", ActivationCheckpointingName(l.ac));
  if (l.cp > 1) absl::StrAppend(&out, " cp=", l.cp);
  if (l.ep > 1) absl::StrAppend(&out, " ep=", l.ep);
  if (l.v > 1) absl::StrAppend(&out, " v=", l.v);
  return out;
}

LayoutChoice FromProto(const v1::Layout& layout, int micro_batch) {
  LayoutChoice l;
  l.dp = layout.data_parallel();
  l.tp = std::max(1, layout.tensor_parallel());
  l.pp = std::max(1, layout.pipeline_parallel());
  l.zero = layout.zero_stage();
  l.sp = layout.sequence_parallel();
  l.micro_batch = micro_batch;
  l.cp = std::max(1, layout.context_parallel());
  l.ep = std::max(1, layout.expert_parallel());
  l.v = std::max(1, layout.pipeline_virtual_stages());
  l.ac = layout.activation_checkpointing_mode();
  if (l.ac == v1::ACTIVATION_CHECKPOINTING_UNSPECIFIED) {
    l.ac = layout.activation_checkpointing() ? kFull : kNone;
  }
  return l;
}

v1::Layout ToProto(const LayoutChoice& l) {
  v1::Layout layout;
  layout.set_data_parallel(l.dp);
  layout.set_tensor_parallel(l.tp);
  layout.set_pipeline_parallel(l.pp);
  layout.set_zero_stage(l.zero);
  layout.set_sequence_parallel(l.sp);
  layout.set_activation_checkpointing_mode(l.ac);
  layout.set_activation_checkpointing(l.ac == kFull);
  // Left unset at 1 (0 means 1), so plain layouts are stored as before.
  if (l.cp > 1) layout.set_context_parallel(l.cp);
  if (l.ep > 1) layout.set_expert_parallel(l.ep);
  if (l.v > 1) layout.set_pipeline_virtual_stages(l.v);
  return layout;
}

v1::LayoutCandidate EvaluateLayout(const Workload& w, const LayoutChoice& l,
                                   const ClusterShape& c) {
  v1::LayoutCandidate candidate;
  v1::LayoutPlan& plan = *candidate.mutable_plan();
  *plan.mutable_layout() = ToProto(l);
  plan.set_world_size(l.world());
  plan.set_micro_batch_size(l.micro_batch);
  plan.set_gradient_accumulation_steps(static_cast<int32_t>(GradientAccumulation(w, l)));
  *plan.mutable_model()->mutable_dims() = w.dims;
  plan.mutable_model()->set_num_parameters(CountParameters(w.dims));
  plan.mutable_model()->set_num_active_parameters(CountActiveParameters(w.dims));
  plan.mutable_model()->set_flops_per_token(FlopsPerToken(w.dims, w.seq_len));
  *plan.mutable_device() = c.device;
  plan.set_devices_per_node(c.gpus_per_node);
  plan.set_lora_rank(w.lora_rank);
  plan.set_precision(w.precision);
  if (auto invalid = InvalidReason(w, l, c)) {
    candidate.set_rejected_reason(*invalid);
    return candidate;
  }
  std::vector<v1::MemoryEstimate> stages = EstimateMemory(w, l, c);
  *plan.mutable_memory() = WorstStage(stages);
  if (stages.size() > 1) {
    for (auto& stage : stages) *plan.add_stage_memory() = std::move(stage);
  }
  *plan.mutable_step_time() = EstimateStepTime(w, l, c);
  const v1::MemoryEstimate& mem = plan.memory();
  // A device of unknown memory (a CPU slot without an override) is not checked.
  const bool known = c.device.memory_bytes() > 0;
  plan.set_fits(!known || mem.total_bytes() <= mem.usable_bytes());
  if (!plan.fits()) {
    candidate.set_rejected_reason(
        absl::StrCat("does not fit: needs ", FormatBytes(mem.total_bytes()), " per device",
                     l.pp > 1 ? absl::StrCat(" (pipeline stage ", mem.pipeline_stage(), ")") : "",
                     ", ", FormatBytes(mem.usable_bytes()), " usable on ", DeviceLabel(c),
                     " (over by ", FormatBytes(mem.total_bytes() - mem.usable_bytes()), ")"));
  }
  return candidate;
}

std::vector<int> MicroBatchChoices(int64_t per_rank) {
  std::vector<int> out;
  for (int64_t m = 1; m <= per_rank && m <= (1 << 20); m *= 2) {
    if (per_rank % m == 0) out.push_back(static_cast<int>(m));
  }
  if (per_rank > 0 && per_rank <= (1 << 20) &&
      std::find(out.begin(), out.end(), per_rank) == out.end()) {
    out.push_back(static_cast<int>(per_rank));
  }
  if (out.empty()) out.push_back(1);  // reported as indivisible by InvalidReason
  return out;
}

void RankCandidates(SearchResult& result) {
  auto rank = [](const v1::LayoutCandidate& x) {
    const v1::LayoutPlan& p = x.plan();
    const int group = p.fits() ? 0 : (p.has_memory() ? 1 : 2);
    const double speed = group == 0 ? -p.step_time().tokens_per_second() : 0;
    const int64_t over = group == 1 ? p.memory().total_bytes() - p.memory().usable_bytes() : 0;
    // Equal speed: the simpler layout (less sharding, recomputation, parallelism), then less
    // memory.
    return std::make_tuple(group, speed, over, Complexity(p.layout()), p.memory().total_bytes());
  };
  std::stable_sort(result.candidates.begin(), result.candidates.end(),
                   [&](const v1::LayoutCandidate& a, const v1::LayoutCandidate& b) {
                     return rank(a) < rank(b);
                   });
  result.fitting =
      static_cast<int>(std::count_if(result.candidates.begin(), result.candidates.end(),
                                     [](const v1::LayoutCandidate& x) { return x.plan().fits(); }));
}

SearchResult SearchLayouts(const Workload& w, const ClusterShape& c, const SearchLimits& limits) {
  std::vector<v1::ActivationCheckpointing> recompute{kNone};
  if (limits.allow_activation_checkpointing) {
    recompute.push_back(kSelective);
    recompute.push_back(kFull);
  }
  SearchResult result;
  absl::flat_hash_set<std::string> structural;
  const bool moe = w.dims.num_experts() > 0;
  auto within = [](int degree, int limit) { return limit <= 0 || degree <= limit; };
  for (int cp : Divisors(c.gpus)) {
    // Context parallelism splits each sequence into 2 x cp chunks: degrees that cannot are not
    // layouts of this workload at all.
    if (!within(cp, limits.max_cp) || (cp > 1 && w.seq_len % (2 * cp) != 0)) continue;
    if (cp > 1 && moe && !limits.context_parallel_with_experts) continue;
    for (int tp : Divisors(c.gpus / cp)) {
      if (!within(tp, limits.max_tp)) continue;
      for (int pp : Divisors(c.gpus / cp / tp)) {
        if (!within(pp, limits.max_pp)) continue;
        const int dp = c.gpus / cp / tp / pp;
        // Expert parallelism for a mixture of experts only, at degrees that split both its experts
        // and the data-parallel group; virtual stages only in a pipeline, dividing its layers.
        std::vector<int> eps{1};
        if (moe) {
          for (int ep : Divisors(dp)) {
            if (ep > 1 && within(ep, limits.max_ep) && w.dims.num_experts() % ep == 0) {
              eps.push_back(ep);
            }
          }
        }
        std::vector<int> virtual_stages{1};
        if (pp > 1 && w.dims.num_layers() % pp == 0) {
          for (int v : Divisors(w.dims.num_layers() / pp)) {
            if (v > 1 && within(v, limits.max_v)) virtual_stages.push_back(v);
          }
        }
        std::vector<int> micro_batches;
        if (limits.micro_batch > 0) {
          micro_batches.push_back(limits.micro_batch);
        } else {
          micro_batches = MicroBatchChoices(w.global_batch / dp);
        }
        // ZeRO over one data-parallel rank shards nothing: only stage 0 is a distinct layout.
        // Context-parallel ranks hold whole layers and shard with the data-parallel ones (over
        // dp x cp), so only tp and pp (and ep, below) take the model-parallel ZeRO cap.
        const bool model_parallel = tp > 1 || pp > 1;
        const int max_zero =
            dp * cp > 1 ? std::min({3, limits.max_zero,
                                    model_parallel ? limits.max_zero_with_model_parallel : 3})
                        : 0;
        for (int ep : eps) {
          const int max_zero_here =
              ep > 1 ? std::min(max_zero, limits.max_zero_with_model_parallel) : max_zero;
          for (int v : virtual_stages) {
            for (int micro : micro_batches) {
              for (int zero = 0; zero <= max_zero_here; ++zero) {
                for (bool sp : {false, true}) {
                  if (sp && (tp == 1 || !limits.allow_sequence_parallel)) continue;
                  for (v1::ActivationCheckpointing ac : recompute) {
                    LayoutChoice l{dp, tp, pp, zero, micro, sp, ac, cp, ep, v};
                    AddCandidate(w, l, c, structural, result);
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  RankCandidates(result);
  return result;
}

v1::LayoutPlan ChoosePlan(const SearchResult& result, const ClusterShape& c) {
  if (result.candidates.empty()) {
    v1::LayoutPlan plan;
    plan.set_fits(false);
    plan.set_explanation("no layout was considered");
    return plan;
  }
  // The fastest fitting layout, or the one with the least ZeRO and recomputation among those of
  // its tp, pp and sp within kSimplerLayoutMargin of it.
  size_t chosen = 0;
  const v1::LayoutPlan& fastest = result.candidates.front().plan();
  if (fastest.fits()) {
    const double floor = (1 - kSimplerLayoutMargin) * fastest.step_time().tokens_per_second();
    const v1::Layout& shape = fastest.layout();
    for (size_t i = 1; i < static_cast<size_t>(result.fitting); ++i) {
      const v1::LayoutPlan& p = result.candidates[i].plan();
      if (p.step_time().tokens_per_second() < floor) break;
      const v1::Layout& l = p.layout();
      if (!SameShape(l, shape)) continue;
      if (Complexity(l) < Complexity(result.candidates[chosen].plan().layout())) chosen = i;
    }
  }
  const v1::LayoutCandidate& best = result.candidates[chosen];
  v1::LayoutPlan plan = best.plan();
  const LayoutChoice l = FromProto(plan.layout(), plan.micro_batch_size());
  const int considered = static_cast<int>(result.candidates.size());
  if (plan.fits()) {
    const v1::StepTimeEstimate& t = plan.step_time();
    const std::string why =
        chosen == 0 ? absl::StrFormat("fastest of %d fitting layouts (%d considered)",
                                      result.fitting, considered)
                    : absl::StrFormat(
                          "simplest of the layouts within %.0f%% of the fastest (%d fitting, %d "
                          "considered)",
                          100 * kSimplerLayoutMargin, result.fitting, considered);
    std::string explanation = absl::StrFormat(
        "%s, gradient accumulation %d: %s on %d x %s, %d per node: est. %.0f tokens/s, %.3f "
        "s/step, MFU %.1f%%, %s.",
        Describe(l), plan.gradient_accumulation_steps(), why, c.gpus, DeviceLabel(c),
        c.gpus_per_node, t.tokens_per_second(), t.step_seconds(), 100 * t.mfu(),
        PeakLabel(plan.memory()));
    // The fastest when a simpler layout was preferred, else the next fastest.
    const size_t other = chosen != 0 ? 0 : 1;
    if (static_cast<int>(other) < result.fitting) {
      const v1::LayoutPlan& next = result.candidates[other].plan();
      const double ratio = next.step_time().tokens_per_second() / t.tokens_per_second();
      absl::StrAppendFormat(
          &explanation, " %s: %s at %.0f tokens/s (%.1f%% %s).",
          chosen != 0 ? "Fastest" : "Runner-up",
          Describe(FromProto(next.layout(), next.micro_batch_size())),
          next.step_time().tokens_per_second(), 100 * std::abs(1 - ratio),
          chosen != 0 ? "faster in estimate: too little for the added machinery" : "slower");
    }
    AppendSplitReasons(result, l, explanation);
    plan.set_explanation(explanation);
  } else if (plan.has_memory()) {
    plan.set_explanation(absl::StrCat("No layout fits (", considered, " considered). Closest: ",
                                      Describe(l), " ", best.rejected_reason(),
                                      ". More devices, a larger ZeRO stage or activation "
                                      "checkpointing (if allowed), or a smaller micro-batch or "
                                      "sequence would help."));
  } else {
    plan.set_explanation(absl::StrCat("No valid layout (", considered,
                                      " considered): ", best.rejected_reason(), "."));
  }
  return plan;
}

}  // namespace tessera::planner
