#include "trainer/report/tensorboard_reports.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/text_format.h"

namespace tessera::trainer {
namespace {

// A message as a markdown code block (TensorBoard's text dashboard renders markdown).
std::string AsCodeBlock(const google::protobuf::Message& message) {
  std::string text;
  google::protobuf::TextFormat::PrintToString(message, &text);
  return absl::StrCat("```\n", text, "```");
}

// Rank 0's step breakdown (StepMetrics.breakdown): one scalar per phase and per collective
// kind and dimension.
void WriteBreakdown(const v1::StepTimeBreakdown& b, int64_t step, TensorBoardWriter& writer) {
  writer.AddScalar("breakdown/forward_seconds", step, b.forward_seconds());
  writer.AddScalar("breakdown/backward_seconds", step, b.backward_seconds());
  writer.AddScalar("breakdown/optimizer_seconds", step, b.optimizer_seconds());
  writer.AddScalar("breakdown/data_wait_seconds", step, b.data_wait_seconds());
  writer.AddScalar("breakdown/checkpoint_blocked_seconds", step, b.checkpoint_blocked_seconds());
  writer.AddScalar("breakdown/other_seconds", step, b.other_seconds());
  for (const v1::CollectiveTime& c : b.collectives()) {
    writer.AddScalar(absl::StrCat("breakdown/collective/", c.kind(), "_", c.dim(), "_seconds"),
                     step, c.seconds());
  }
}

}  // namespace

void WriteToTensorBoard(const v1::TrainerReport& report, TensorBoardWriter& writer) {
  if (report.has_metrics()) {
    const v1::StepMetrics& m = report.metrics();
    const int64_t step = m.step();
    writer.AddScalar("train/loss", step, m.loss());
    writer.AddScalar("train/learning_rate", step, m.learning_rate());
    writer.AddScalar("train/grad_norm", step, m.grad_norm());
    writer.AddScalar("train/tokens_per_second", step, m.tokens_per_second());
    writer.AddScalar("train/samples_per_second", step, m.samples_per_second());
    writer.AddScalar("train/step_time_seconds", step, m.step_time_seconds());
    writer.AddScalar("train/tokens_seen", step, static_cast<double>(m.tokens_seen()));
    // Zero where the device's peak is unknown (CPU) or nothing was measured: no series then.
    if (m.mfu() > 0) writer.AddScalar("train/mfu", step, m.mfu());
    if (m.peak_memory_bytes() > 0) {
      writer.AddScalar("train/peak_memory_bytes", step, static_cast<double>(m.peak_memory_bytes()));
    }
    if (m.checkpoint_blocked_seconds() > 0) {
      writer.AddScalar("train/checkpoint_blocked_seconds", step, m.checkpoint_blocked_seconds());
    }
    if (m.router_aux_loss() > 0) writer.AddScalar("train/router_aux_loss", step, m.router_aux_loss());
    if (m.epoch() > 0) writer.AddScalar("train/epoch", step, m.epoch());
    if (m.has_breakdown()) WriteBreakdown(m.breakdown(), step, writer);
  }
  if (report.has_eval()) {
    const v1::EvalMetrics& e = report.eval();
    writer.AddScalar("eval/loss", e.step(), e.loss());
    writer.AddScalar("eval/perplexity", e.step(), e.perplexity());
  }
  if (report.has_checkpoint()) {
    const v1::Checkpoint& c = report.checkpoint();
    writer.AddScalar("checkpoint/write_seconds", c.step(), c.write_seconds());
    writer.AddScalar("checkpoint/size_bytes", c.step(), static_cast<double>(c.size_bytes()));
  }
}

void WriteTaskText(const v1::TrainerTask& task, int64_t step, TensorBoardWriter& writer) {
  writer.AddText("job/spec", step, AsCodeBlock(task.spec()));
  writer.AddText("job/plan", step, AsCodeBlock(task.plan()));
}

}  // namespace tessera::trainer
