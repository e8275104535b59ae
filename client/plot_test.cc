#include "client/plot.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::client {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

int Count(const std::string& text, const std::string& needle) {
  int count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
    ++count;
  }
  return count;
}

TEST(PlotTest, DrawsBothCurvesAndTheEvaluations) {
  v1::GetMetricsResponse metrics;
  for (int step = 1; step <= 50; ++step) {
    auto* p = metrics.add_points();
    p->set_step(step);
    p->set_loss(5.5 * std::exp(-step / 20.0) + 2);
    p->set_tokens_per_second(40000 + step);
  }
  for (int step : {25, 50}) {
    auto* e = metrics.add_evals();
    e->set_step(step);
    e->set_loss(3.0);
  }
  std::string svg = RenderTrainingPlot("job-1 <tiny & fast>", metrics);
  EXPECT_TRUE(svg.starts_with("<svg "));
  EXPECT_TRUE(svg.ends_with("</svg>\n"));
  EXPECT_EQ(Count(svg, "<polyline"), 2);
  EXPECT_EQ(Count(svg, "<circle"), 2);
  // 50 points per curve.
  size_t start = svg.find("points='") + 8;
  std::string first = svg.substr(start, svg.find('\'', start) - start);
  EXPECT_EQ(std::count(first.begin(), first.end(), ','), 50);
  EXPECT_THAT(svg, HasSubstr("job-1 &lt;tiny &amp; fast&gt;"));
  EXPECT_THAT(svg, Not(HasSubstr("<tiny")));
  EXPECT_THAT(svg, HasSubstr("throughput (tokens/s)"));
}

TEST(PlotTest, EmptyAndFlatCurvesStillRender) {
  v1::GetMetricsResponse metrics;
  std::string empty = RenderTrainingPlot("empty", metrics);
  EXPECT_TRUE(empty.ends_with("</svg>\n"));
  auto* p = metrics.add_points();
  p->set_step(1);
  p->set_loss(2.0);
  std::string one = RenderTrainingPlot("one", metrics);
  EXPECT_THAT(one, Not(HasSubstr("nan")));
  EXPECT_THAT(one, Not(HasSubstr("inf")));
}

}  // namespace
}  // namespace tessera::client
