#include "client/progress_line.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "client/text_format.h"

namespace tessera::client {

void ProgressLine::Add(const v1::StepMetrics& metrics) {
  // A job that trains for `epochs` learns its step count from its trainer.
  if (metrics.max_steps() > 0) max_steps_ = metrics.max_steps();
  last_ = metrics;
  has_last_ = true;
  if (metrics.step_time_seconds() > 0) {
    window_.push_back({.seconds = metrics.step_time_seconds(),
                       .tokens = metrics.tokens_per_second() * metrics.step_time_seconds()});
    if (window_.size() > kProgressWindow) window_.pop_front();
  }
  losses_.push_back(metrics.loss());
  if (losses_.size() > kSparklineLength) losses_.pop_front();
}

double ProgressLine::WindowTokensPerSecond() const {
  double seconds = 0, tokens = 0;
  for (const Step& step : window_) {
    seconds += step.seconds;
    tokens += step.tokens;
  }
  return seconds > 0 ? tokens / seconds : 0;
}

double ProgressLine::WindowSecondsPerStep() const {
  if (window_.empty()) return 0;
  double seconds = 0;
  for (const Step& step : window_) seconds += step.seconds;
  return seconds / static_cast<double>(window_.size());
}

std::string ProgressLine::Render(int columns, bool chart) const {
  if (!has_last_) return "";
  const int64_t remaining = std::max<int64_t>(0, max_steps_ - last_.step());
  const double eta = WindowSecondsPerStep() * static_cast<double>(remaining);
  const std::string step = absl::StrFormat(" step %d/%d  loss %.4f  %s tok/s", last_.step(),
                                           max_steps_, last_.loss(),
                                           FormatRate(WindowTokensPerSecond()));
  const std::string eta_text =
      absl::StrCat("  ETA ", absl::FormatDuration(absl::Seconds(std::round(eta))));
  const std::string lr =
      absl::StrFormat("  lr %.2e", last_.learning_rate()) +
      (last_.epoch() > 0 ? absl::StrFormat("  epoch %.2f", last_.epoch()) : std::string());
  const std::string mfu = last_.mfu() > 0 ? absl::StrFormat("  MFU %.1f%%", 100 * last_.mfu()) : "";
  const std::string spark = chart ? "  " + Sparkline(losses_) : "";
  auto bar = [&](int width) {
    if (width <= 0) return std::string();
    const int filled =
        max_steps_ > 0 ? static_cast<int>(width * std::min(last_.step(), max_steps_) / max_steps_)
                       : 0;
    // Appended in place: GCC 12 reads "[" + std::string(...) as a possibly overlapping memcpy
    // (-Wrestrict, a false positive).
    std::string out = "[";
    out.append(filled, '#').append(width - filled, '.').append("]");
    return out;
  };
  // Most to least expendable.
  for (const auto& [bar_width, with_lr, with_mfu, with_spark] :
       std::initializer_list<std::tuple<int, bool, bool, bool>>{{30, true, true, true},
                                                                {30, true, true, false},
                                                                {30, true, false, false},
                                                                {30, false, false, false},
                                                                {20, false, false, false},
                                                                {10, false, false, false},
                                                                {0, false, false, false}}) {
    std::string line = bar(bar_width) + step + (with_lr ? lr : "") + eta_text +
                       (with_mfu ? mfu : "") + (with_spark ? spark : "");
    if (bar_width == 0 && !line.empty() && line[0] == ' ') line.erase(0, 1);
    if (DisplayWidth(line) <= columns || bar_width == 0) {
      // Still too wide: cut (the remaining text is ASCII).
      if (DisplayWidth(line) > columns) line.resize(static_cast<size_t>(std::max(columns, 0)));
      return line;
    }
  }
  return "";
}

int DisplayWidth(const std::string& text) {
  int width = 0;
  for (unsigned char c : text) width += (c & 0xC0) != 0x80;  // count lead bytes only
  return width;
}

std::string Sparkline(const std::deque<double>& values) {
  static const char* kBars[] = {"\u2581", "\u2582", "\u2583", "\u2584",
                                "\u2585", "\u2586", "\u2587", "\u2588"};
  double lo = INFINITY, hi = -INFINITY;
  for (double v : values) {
    if (!std::isfinite(v)) continue;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  std::string out;
  for (double v : values) {
    // A loss that is not finite (a diverged step) shows as the tallest bar.
    int level = !std::isfinite(v) ? 7 : hi > lo ? static_cast<int>((v - lo) / (hi - lo) * 7.0 + 0.5)
                                                : 0;
    out += kBars[std::clamp(level, 0, 7)];
  }
  return out;
}

}  // namespace tessera::client
