#include "client/plot.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tessera::client {
namespace {

constexpr double kWidth = 900, kPanelHeight = 260, kLeft = 80, kRight = 30, kTop = 50;
constexpr double kGap = 60, kBottom = 50;
constexpr int kTicks = 5;

std::string Escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

struct Range {
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
  void Add(double v) {
    if (!std::isfinite(v)) return;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  void Settle() {
    if (!std::isfinite(lo)) lo = 0, hi = 1;
    if (hi - lo < 1e-12) hi = lo + 1;
  }
};

std::string Number(double v) {
  double a = std::abs(v);
  if (a >= 1e6) return absl::StrFormat("%.1fM", v / 1e6);
  if (a >= 1e3) return absl::StrFormat("%.1fk", v / 1e3);
  if (a >= 10 || v == std::round(v)) return absl::StrFormat("%.0f", v);
  return absl::StrFormat("%.2f", v);
}

// One panel: frame, gridlines with labels, and the caller's series.
void Panel(std::string& svg, double top, const std::string& label, const Range& x, const Range& y,
           const std::function<void(const std::function<double(double)>&,
                                    const std::function<double(double)>&)>& draw) {
  const double left = kLeft, right = kWidth - kRight, bottom = top + kPanelHeight;
  auto px = [&](double v) { return left + (v - x.lo) / (x.hi - x.lo) * (right - left); };
  auto py = [&](double v) { return bottom - (v - y.lo) / (y.hi - y.lo) * kPanelHeight; };
  absl::StrAppendFormat(&svg,
                        "<rect x='%.1f' y='%.1f' width='%.1f' height='%.1f' fill='#fff' "
                        "stroke='#999'/>\n",
                        left, top, right - left, kPanelHeight);
  for (int i = 0; i <= kTicks; ++i) {
    double yv = y.lo + (y.hi - y.lo) * i / kTicks, xv = x.lo + (x.hi - x.lo) * i / kTicks;
    absl::StrAppendFormat(&svg,
                          "<line x1='%.1f' x2='%.1f' y1='%.1f' y2='%.1f' stroke='#eee'/>"
                          "<text x='%.1f' y='%.1f' text-anchor='end' font-size='11'>%s</text>\n",
                          left, right, py(yv), py(yv), left - 6, py(yv) + 4, Number(yv));
    absl::StrAppendFormat(&svg,
                          "<text x='%.1f' y='%.1f' text-anchor='middle' font-size='11'>%s</text>\n",
                          px(xv), bottom + 16, Number(xv));
  }
  absl::StrAppendFormat(&svg,
                        "<text x='%.1f' y='%.1f' font-size='13' font-weight='bold'>%s</text>\n",
                        left, top - 8, Escape(label));
  draw(px, py);
}

}  // namespace

std::string RenderTrainingPlot(const std::string& title, const v1::GetMetricsResponse& metrics) {
  Range steps, loss, throughput;
  for (const auto& p : metrics.points()) {
    steps.Add(static_cast<double>(p.step()));
    loss.Add(p.loss());
    throughput.Add(p.tokens_per_second());
  }
  for (const auto& e : metrics.evals()) {
    steps.Add(static_cast<double>(e.step()));
    loss.Add(e.loss());
  }
  throughput.Add(0);
  steps.Settle();
  loss.Settle();
  throughput.Settle();
  const double height = kTop + 2 * kPanelHeight + kGap + kBottom;
  std::string svg = absl::StrFormat(
      "<svg xmlns='http://www.w3.org/2000/svg' width='%.0f' height='%.0f' "
      "font-family='sans-serif'>\n<rect width='100%%' height='100%%' fill='#fafafa'/>\n"
      "<text x='%.1f' y='24' font-size='16' font-weight='bold'>%s</text>\n",
      kWidth, height, kLeft, Escape(title));
  auto polyline = [&](const std::function<double(double)>& px,
                      const std::function<double(double)>& py,
                      const std::function<double(const v1::StepMetrics&)>& value,
                      const char* color) {
    std::string points;
    for (const auto& p : metrics.points()) {
      double v = value(p);
      if (!std::isfinite(v)) continue;
      absl::StrAppendFormat(&points, "%.1f,%.1f ", px(static_cast<double>(p.step())), py(v));
    }
    absl::StrAppendFormat(&svg,
                          "<polyline fill='none' stroke='%s' stroke-width='1.5' points='%s'/>\n",
                          color, points);
  };
  Panel(svg, kTop, "loss (nats/token): training line, evaluation dots", steps, loss,
        [&](const auto& px, const auto& py) {
          polyline(
              px, py, [](const v1::StepMetrics& p) { return p.loss(); }, "#1f77b4");
          for (const auto& e : metrics.evals()) {
            absl::StrAppendFormat(&svg, "<circle cx='%.1f' cy='%.1f' r='4' fill='#d62728'/>\n",
                                  px(static_cast<double>(e.step())), py(e.loss()));
          }
        });
  Panel(svg, kTop + kPanelHeight + kGap, "throughput (tokens/s)", steps, throughput,
        [&](const auto& px, const auto& py) {
          polyline(
              px, py, [](const v1::StepMetrics& p) { return p.tokens_per_second(); }, "#2ca02c");
        });
  absl::StrAppendFormat(&svg,
                        "<text x='%.1f' y='%.1f' text-anchor='middle' font-size='12'>step</text>\n",
                        (kLeft + kWidth - kRight) / 2, height - 12);
  svg += "</svg>\n";
  return svg;
}

}  // namespace tessera::client
