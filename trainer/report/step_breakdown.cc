#include "trainer/report/step_breakdown.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace tessera::trainer {
namespace {

v1::CollectiveTime* FindOrAdd(v1::StepTimeBreakdown* breakdown, const v1::CollectiveTime& like) {
  for (v1::CollectiveTime& c : *breakdown->mutable_collectives()) {
    if (c.kind() == like.kind() && c.dim() == like.dim()) return &c;
  }
  v1::CollectiveTime* added = breakdown->add_collectives();
  added->set_kind(like.kind());
  added->set_dim(like.dim());
  return added;
}

std::string Percent(double seconds, double wall_seconds) {
  return absl::StrCat(static_cast<int64_t>(std::lround(100.0 * seconds / wall_seconds)), "%");
}

}  // namespace

void AddBreakdown(const v1::StepTimeBreakdown& step, v1::StepTimeBreakdown* sum) {
  sum->set_forward_seconds(sum->forward_seconds() + step.forward_seconds());
  sum->set_backward_seconds(sum->backward_seconds() + step.backward_seconds());
  sum->set_optimizer_seconds(sum->optimizer_seconds() + step.optimizer_seconds());
  sum->set_data_wait_seconds(sum->data_wait_seconds() + step.data_wait_seconds());
  sum->set_checkpoint_blocked_seconds(sum->checkpoint_blocked_seconds() +
                                      step.checkpoint_blocked_seconds());
  sum->set_other_seconds(sum->other_seconds() + step.other_seconds());
  for (const v1::CollectiveTime& c : step.collectives()) {
    v1::CollectiveTime* total = FindOrAdd(sum, c);
    total->set_seconds(total->seconds() + c.seconds());
    total->set_peer_wait_seconds(total->peer_wait_seconds() + c.peer_wait_seconds());
    total->set_calls(total->calls() + c.calls());
    total->set_bytes(total->bytes() + c.bytes());
  }
}

v1::StepTimeBreakdown MeanBreakdown(const v1::StepTimeBreakdown& sum, int64_t steps) {
  v1::StepTimeBreakdown mean;
  if (steps <= 0) return mean;
  const double n = static_cast<double>(steps);
  mean.set_forward_seconds(sum.forward_seconds() / n);
  mean.set_backward_seconds(sum.backward_seconds() / n);
  mean.set_optimizer_seconds(sum.optimizer_seconds() / n);
  mean.set_data_wait_seconds(sum.data_wait_seconds() / n);
  mean.set_checkpoint_blocked_seconds(sum.checkpoint_blocked_seconds() / n);
  mean.set_other_seconds(sum.other_seconds() / n);
  for (const v1::CollectiveTime& c : sum.collectives()) {
    v1::CollectiveTime* m = mean.add_collectives();
    m->set_kind(c.kind());
    m->set_dim(c.dim());
    m->set_seconds(c.seconds() / n);
    m->set_peer_wait_seconds(c.peer_wait_seconds() / n);
    m->set_calls(std::llround(static_cast<double>(c.calls()) / n));
    m->set_bytes(std::llround(static_cast<double>(c.bytes()) / n));
  }
  SortCollectives(&mean);
  return mean;
}

void SortCollectives(v1::StepTimeBreakdown* breakdown) {
  auto* collectives = breakdown->mutable_collectives();
  std::sort(collectives->begin(), collectives->end(),
            [](const v1::CollectiveTime& a, const v1::CollectiveTime& b) {
              return std::make_tuple(-a.seconds(), a.kind(), a.dim()) <
                     std::make_tuple(-b.seconds(), b.kind(), b.dim());
            });
}

std::string BreakdownSummary(const v1::StepTimeBreakdown& breakdown, double wall_seconds,
                             int max_collectives) {
  if (wall_seconds <= 0) return "";
  std::string summary =
      absl::StrCat("fwd ", Percent(breakdown.forward_seconds(), wall_seconds), " bwd ",
                   Percent(breakdown.backward_seconds(), wall_seconds), " opt ",
                   Percent(breakdown.optimizer_seconds(), wall_seconds), " data ",
                   Percent(breakdown.data_wait_seconds(), wall_seconds), " ckpt ",
                   Percent(breakdown.checkpoint_blocked_seconds(), wall_seconds), " other ",
                   Percent(breakdown.other_seconds(), wall_seconds));
  const int shown = std::min(max_collectives, breakdown.collectives_size());
  for (int i = 0; i < shown; ++i) {
    const v1::CollectiveTime& c = breakdown.collectives(i);
    absl::StrAppend(&summary, i == 0 ? " | " : " ", c.kind(), "/", c.dim(), " ",
                    Percent(c.seconds(), wall_seconds));
    if (c.peer_wait_seconds() > 0) {
      absl::StrAppend(&summary, " (+", Percent(c.peer_wait_seconds(), wall_seconds), " wait)");
    }
  }
  return summary;
}

}  // namespace tessera::trainer
