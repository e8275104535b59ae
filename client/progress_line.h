// The live line of `tessera watch`: progress bar, step, loss, throughput, learning rate, ETA, MFU
// and a loss sparkline, fitted to the terminal's width, with throughput and ETA averaged over the
// last steps so that they do not jump from one step to the next.
//
// Thread safety: a ProgressLine is used by one thread.
#pragma once

#include <cstdint>
#include <deque>
#include <string>

#include "tessera/v1/metrics.pb.h"

namespace tessera::client {

// Steps averaged for the displayed tokens/s and ETA.
inline constexpr size_t kProgressWindow = 20;
// Losses shown in the sparkline.
inline constexpr size_t kSparklineLength = 40;

class ProgressLine {
 public:
  explicit ProgressLine(int64_t max_steps) : max_steps_(max_steps) {}

  // Takes one step's metrics into the window and the sparkline.
  void Add(const v1::StepMetrics& metrics);

  // The line for the newest step, at most `columns` terminal columns wide: the sparkline goes
  // first, then MFU, the learning rate and the bar's width, then the bar, until it fits; what is
  // left is cut. Empty before the first Add.
  // `chart`: whether the sparkline may be shown at all.
  std::string Render(int columns, bool chart = true) const;

  // Tokens per second and seconds per step over the window (0 before the first Add).
  double WindowTokensPerSecond() const;
  double WindowSecondsPerStep() const;

 private:
  struct Step {
    double seconds = 0;
    double tokens = 0;
  };
  int64_t max_steps_;
  v1::StepMetrics last_;
  bool has_last_ = false;
  std::deque<Step> window_;
  std::deque<double> losses_;
};

// Terminal columns `text` takes: one per UTF-8 code point (the sparkline's blocks are one wide).
int DisplayWidth(const std::string& text);

// A one-line chart of `values` (high = tall), scaled to their own range.
std::string Sparkline(const std::deque<double>& values);

}  // namespace tessera::client
