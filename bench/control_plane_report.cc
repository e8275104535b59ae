#include "bench/control_plane_report.h"

#include <fstream>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/control_plane_backends.h"
#include "bench/control_plane_queues.h"
#include "common/errno_status.h"
#include "nlohmann/json.hpp"

namespace tessera::bench {
namespace {

using nlohmann::json;

constexpr double kMiB = 1024.0 * 1024.0;

double Ms(double seconds) { return seconds * 1e3; }

// Heartbeat p50 over health-check p50: what the per-heartbeat logic costs
// in units of a no-op RPC on the same connections; 0 when unknown.
double HeartbeatToHealthRatio(const ScaleResult& result) {
  return result.health.p50 > 0 ? result.heartbeat.p50 / result.health.p50 : 0;
}

Spread WindowSpread(const ScaleResult& result,
                    const std::function<double(const WindowFigures&)>& of) {
  std::vector<double> values;
  for (const WindowFigures& window : result.windows) values.push_back(of(window));
  return SpreadOf(std::move(values));
}

// "median [min..max]" with `decimals` digits after the point.
std::string FormatSpread(const Spread& spread, int decimals) {
  return absl::StrFormat("%.*f [%.*f..%.*f]", decimals, spread.median, decimals, spread.min,
                         decimals, spread.max);
}

json LatencyJson(const LatencySummary& summary) {
  return {{"count", summary.count},    {"p50_ms", Ms(summary.p50)}, {"p99_ms", Ms(summary.p99)},
          {"min_ms", Ms(summary.min)}, {"max_ms", Ms(summary.max)}, {"mean_ms", Ms(summary.mean)}};
}

// {"phase": ms per pass, ...}.
json PhasesJson(const std::vector<std::pair<std::string, double>>& phases) {
  json out = json::object();
  for (const auto& [phase, seconds] : phases) out[phase] = Ms(seconds);
  return out;
}

// The GPUs were nearly all held while jobs waited for them.
bool GpuBound(const ClusterOccupancy& occupancy) {
  return occupancy.samples > 0 && occupancy.mean_gpus_allocated_share >= 0.9 &&
         occupancy.mean_pending_jobs >= 1;
}

// "10000", or "10000 queues" for a run of a scenario other than the single pool.
// With " pg" after it for a run on PostgreSQL.
std::string ScaleLabel(const ScaleResult& r) {
  return absl::StrCat(r.nodes,
                      r.scenario.empty() || r.scenario == "single-pool" ? "" : " " + r.scenario,
                      r.backend == kPostgresBackend ? " pg" : "");
}

json SpreadJson(const Spread& spread) {
  return {{"median", spread.median}, {"min", spread.min}, {"max", spread.max}};
}

json ScaleJson(const ScaleResult& r) {
  json windows = json::array();
  for (const WindowFigures& w : r.windows) {
    windows.push_back({{"heartbeat_p50_ms", Ms(w.heartbeat.p50)},
                       {"heartbeat_p99_ms", Ms(w.heartbeat.p99)},
                       {"health_check_p50_ms", Ms(w.health.p50)},
                       {"heartbeats_per_second", w.heartbeats_per_second},
                       {"jobs_placed_per_second", w.jobs_placed_per_second},
                       {"coordinator_cores", w.coordinator_cores}});
  }
  auto ms_spread = [&](const std::function<double(const WindowFigures&)>& of) {
    Spread spread = WindowSpread(r, of);
    return SpreadJson({Ms(spread.median), Ms(spread.min), Ms(spread.max)});
  };
  json by_gpus = json::object();
  for (const auto& [gpus, summary] : r.scheduling_by_gpus) {
    by_gpus[std::to_string(gpus)] = LatencyJson(summary);
  }
  json internals = nullptr;
  if (r.internals_available) {
    const CoordinatorInternals& in = r.internals;
    internals = {
        {"scheduler_passes_per_second", in.passes_per_second},
        {"scheduler_pass_mean_ms", Ms(in.mean_pass_seconds)},
        {"scheduler_pass_share_of_wall", in.pass_duty},
        {"scheduler_pass_lock_held_mean_ms", Ms(in.mean_lock_held_seconds)},
        {"scheduler_pass_longest_lock_hold_mean_ms", Ms(in.mean_longest_lock_hold_seconds)},
        {"cluster_lock_share_of_wall", in.lock_duty},
        {"scheduler_pass_phase_mean_ms", PhasesJson(in.pass_phase_seconds)},
        {"store_writes_per_second", in.store_writes_per_second},
        {"store_write_mean_ms", Ms(in.mean_store_write_seconds)},
        {"store_writer_cores", in.store_writer_cores},
        {"store_cpu_per_write_us", 1e6 * in.store_cpu_per_write_seconds},
        {"server_heartbeat_mean_ms", Ms(in.mean_heartbeat_seconds)},
        {"server_health_check_mean_ms", Ms(in.mean_health_seconds)},
        {"server_submit_mean_ms", Ms(in.mean_submit_seconds)},
        // Timed by the coordinator from Job.create_time.
        {"coordinator_submit_to_scheduled_mean_ms", Ms(in.mean_submit_to_scheduled_seconds)},
        {"jobs_scheduled_per_second", in.jobs_scheduled_per_second}};
  }
  const FleetCounters& f = r.fleet;
  const JobStreamCounters& j = r.jobs;
  return {
      {"scenario", r.scenario},
      {"backend", r.backend},
      {"nodes", r.nodes},
      {"window_seconds", r.window_seconds},
      {"registration",
       {{"nodes_registered", r.registered},
        {"wall_seconds", r.register_seconds},
        {"register_latency", LatencyJson(r.register_latency)},
        {"coordinator_rss_mib_after", r.coordinator_rss_after_register_bytes / kMiB}}},
      {"heartbeat_latency", LatencyJson(r.heartbeat)},
      {"heartbeat_p50_ms_windows",
       ms_spread([](const WindowFigures& w) { return w.heartbeat.p50; })},
      {"heartbeat_p99_ms_windows",
       ms_spread([](const WindowFigures& w) { return w.heartbeat.p99; })},
      {"health_check_latency", LatencyJson(r.health)},
      {"health_check_p50_ms_windows",
       ms_spread([](const WindowFigures& w) { return w.health.p50; })},
      {"heartbeat_p50_over_health_check_p50", HeartbeatToHealthRatio(r)},
      {"heartbeats_per_second", r.heartbeats_per_second},
      {"heartbeats_per_second_windows",
       SpreadJson(WindowSpread(r, [](const WindowFigures& w) { return w.heartbeats_per_second; }))},
      {"heartbeats_expected_per_second", r.heartbeats_expected_per_second},
      {"submit_latency", LatencyJson(r.submit)},
      {"submit_to_all_ranks_delivered_latency", LatencyJson(r.scheduling)},
      {"submit_to_all_ranks_delivered_latency_by_gpus", by_gpus},
      {"report_latency", LatencyJson(r.report)},
      {"jobs_offered_per_second", r.offered_jobs_per_second},
      {"jobs_submitted_per_second", r.jobs_submitted_per_second},
      {"jobs_placed_per_second", r.jobs_placed_per_second},
      {"jobs_placed_per_second_windows",
       SpreadJson(
           WindowSpread(r, [](const WindowFigures& w) { return w.jobs_placed_per_second; }))},
      {"coordinator_cores", r.coordinator_cores},
      {"coordinator_cores_windows",
       SpreadJson(WindowSpread(r, [](const WindowFigures& w) { return w.coordinator_cores; }))},
      {"coordinator_rss_mib", r.coordinator_rss_bytes / kMiB},
      {"coordinator_peak_rss_mib", r.coordinator_peak_rss_bytes / kMiB},
      {"coordinator_threads", r.coordinator_threads},
      {"load_generator_cores", r.bench_cores},
      {"other_processes_cores", r.other_cores},
      {"coordinator_internals", internals},
      {"cluster_occupancy",
       r.occupancy.samples == 0
           ? json(nullptr)
           : json{{"samples", r.occupancy.samples},
                  {"gpus_allocated_share_mean", r.occupancy.mean_gpus_allocated_share},
                  {"gpus_allocated_share", SpreadJson(r.occupancy.gpus_allocated_share)},
                  {"pending_jobs_mean", r.occupancy.mean_pending_jobs},
                  {"bounded_by_free_gpus", GpuBound(r.occupancy)},
                  {"pending_jobs", SpreadJson(r.occupancy.pending_jobs)}}},
      {"windows", windows},
      {"fleet",
       {{"registered", f.registered},
        {"register_failures", f.register_failures},
        {"heartbeats_ok", f.heartbeats_ok},
        {"heartbeat_failures", f.heartbeat_failures},
        {"heartbeats_skipped_in_flight", f.heartbeats_skipped},
        {"reregister_requests", f.reregister_requests},
        {"tasks_started", f.tasks_started},
        {"tasks_succeeded", f.tasks_succeeded},
        {"stop_orders", f.stop_orders},
        {"reports_ok", f.reports_ok},
        {"report_failures", f.report_failures},
        {"health_check_failures", f.health_failures},
        {"pacer_resets", f.pacer_resets},
        {"watches_opened", f.watches_opened},
        {"assignment_notices", f.notices},
        {"notified_heartbeats", f.notified_heartbeats},
        {"slots_covered", f.slots_covered},
        {"timer_heartbeats", f.timer_heartbeats},
        {"end_announcements", f.end_announcements},
        {"watch_failures", f.watch_failures},
        {"first_error", f.first_error}}},
      {"jobs",
       {{"submitted", j.submitted},
        {"submit_failures", j.submit_failures},
        {"skipped_submits_in_flight", j.skipped_in_flight},
        {"skipped_backlog_full", j.skipped_backlog},
        {"delivered", j.delivered},
        {"backlog_at_end", j.backlog},
        {"first_error", j.first_error}}},
      {"notes", r.notes},
  };
}

}  // namespace

std::string FormatSummary(const RunInfo& info, const ScaleOptions& p,
                          const std::vector<ScaleResult>& results) {
  std::string out;
  absl::StrAppend(&out, "control-plane benchmark: ", info.machine, "\n  commit ", info.commit, ", ",
                  info.date, "; coordinator state on ", info.state_filesystem, "\n");
  absl::StrAppendFormat(
      &out,
      "  %d GPUs/node, heartbeat every %s per node over %d connections; measured %s after a "
      "%s warm-up, in %d windows\n  jobs of %s GPUs (weights %s), each running %s-%s; "
      "health checks %.0f/s as the no-op baseline; nodes %s WatchAssignments and %s\n\n",
      p.fleet.gpus_per_node, absl::FormatDuration(p.fleet.heartbeat_interval), p.fleet.channels,
      absl::FormatDuration(p.duration), absl::FormatDuration(p.warmup), p.windows,
      absl::StrJoin(p.jobs.gpu_sizes, "/"), absl::StrJoin(p.jobs.weights, "/"),
      absl::FormatDuration(p.fleet.min_run_time), absl::FormatDuration(p.fleet.max_run_time),
      p.fleet.health_checks_per_second, p.fleet.watch_assignments ? "open" : "do not open",
      p.fleet.announce_ends ? "heartbeat at once when a task ends"
                            : "report a task's end at their next heartbeat slot");
  absl::StrAppendFormat(&out, "%13s | %17s %8s %8s | %8s %7s | %9s %9s | %14s | %5s %8s %8s\n", "",
                        "heartbeats/s", "hb p50", "hb p99", "hc p50", "hb/hc", "sched p50",
                        "sched p99", "jobs placed/s", "cores", "RSS", "HWM");
  absl::StrAppendFormat(&out, "%13s | %17s %8s %8s | %8s %7s | %9s %9s | %14s | %5s %8s %8s\n",
                        "nodes", "achieved/expected", "ms", "ms", "ms", "ratio", "ms", "ms",
                        "(offered)", "coord", "MiB", "MiB");
  for (const ScaleResult& r : results) {
    absl::StrAppendFormat(
        &out,
        "%13s | %8.0f/%-8.0f %8.2f %8.2f | %8.2f %6.1fx | %9.0f %9.0f | %6.1f (%5.1f) | %5.2f "
        "%8.0f %8.0f\n",
        ScaleLabel(r), r.heartbeats_per_second, r.heartbeats_expected_per_second,
        Ms(r.heartbeat.p50), Ms(r.heartbeat.p99), Ms(r.health.p50), HeartbeatToHealthRatio(r),
        Ms(r.scheduling.p50), Ms(r.scheduling.p99), r.jobs_placed_per_second,
        r.offered_jobs_per_second, r.coordinator_cores, r.coordinator_rss_bytes / kMiB,
        r.coordinator_peak_rss_bytes / kMiB);
  }
  absl::StrAppend(&out,
                  "\n  hb = NodeService/Heartbeat, hc = grpc.health.v1.Health/Check (no-op), both "
                  "client-side round trips on the same connections;\n  sched = SubmitJob's return "
                  "until the last rank's assignment arrived in a heartbeat response (with "
                  "WatchAssignments, the heartbeat a notice prompts; without, up to one heartbeat "
                  "period later).\n");

  for (const ScaleResult& r : results) {
    absl::StrAppendFormat(&out, "\n%d nodes%s:\n", r.nodes,
                          ScaleLabel(r) == absl::StrCat(r.nodes)
                              ? ""
                              : absl::StrCat(", ", r.scenario, ", ", r.backend));
    absl::StrAppendFormat(
        &out, "  per-heartbeat logic costs %.1fx a no-op RPC (p50 %.2f ms vs %.2f ms)\n",
        HeartbeatToHealthRatio(r), Ms(r.heartbeat.p50), Ms(r.health.p50));
    absl::StrAppendFormat(
        &out, "  join: %d nodes registered in %.1f s (RegisterNode p50 %.1f ms, p99 %.1f ms)\n",
        r.registered, r.register_seconds, Ms(r.register_latency.p50), Ms(r.register_latency.p99));
    absl::StrAppend(
        &out, "  windows, median [min..max]: hb p50 ms ",
        FormatSpread(WindowSpread(r, [](const WindowFigures& w) { return Ms(w.heartbeat.p50); }),
                     2),
        "; hb p99 ms ",
        FormatSpread(WindowSpread(r, [](const WindowFigures& w) { return Ms(w.heartbeat.p99); }),
                     1),
        "; placed/s ",
        FormatSpread(
            WindowSpread(r, [](const WindowFigures& w) { return w.jobs_placed_per_second; }), 1),
        "; coordinator cores ",
        FormatSpread(WindowSpread(r, [](const WindowFigures& w) { return w.coordinator_cores; }),
                     2),
        "\n");
    absl::StrAppendFormat(&out,
                          "  submit: %.1f jobs/s accepted, SubmitJob p50 %.1f ms, p99 %.1f ms; "
                          "sched p50 by GPUs:",
                          r.jobs_submitted_per_second, Ms(r.submit.p50), Ms(r.submit.p99));
    for (const auto& [gpus, summary] : r.scheduling_by_gpus) {
      absl::StrAppendFormat(&out, " %d: %.0f ms (n=%d)", gpus, Ms(summary.p50), summary.count);
    }
    absl::StrAppend(&out, "\n");
    if (r.internals_available) {
      const CoordinatorInternals& in = r.internals;
      absl::StrAppendFormat(
          &out,
          "  coordinator: scheduler pass %.1f/s, mean %.2f ms, holding the cluster lock %.2f ms "
          "(longest hold %.2f ms), %.0f%% of wall under the cluster lock; store writes %.1f/s, "
          "mean %.2f ms, the writer's CPU %.2f cores (%.0f us a write);\n  server-side mean: "
          "Heartbeat %.3f ms, "
          "Health/Check %.3f ms, SubmitJob %.2f ms; its own submit->SCHEDULED mean %.0f ms (from "
          "Job.create_time)\n",
          in.passes_per_second, Ms(in.mean_pass_seconds), Ms(in.mean_lock_held_seconds),
          Ms(in.mean_longest_lock_hold_seconds), 100 * in.lock_duty, in.store_writes_per_second,
          Ms(in.mean_store_write_seconds), in.store_writer_cores,
          1e6 * in.store_cpu_per_write_seconds, Ms(in.mean_heartbeat_seconds),
          Ms(in.mean_health_seconds), Ms(in.mean_submit_seconds),
          Ms(in.mean_submit_to_scheduled_seconds));
      if (!in.pass_phase_seconds.empty()) {
        absl::StrAppend(&out, "  scheduler pass by phase, ms per pass:");
        for (const auto& [phase, seconds] : in.pass_phase_seconds) {
          absl::StrAppendFormat(&out, " %s %.2f", phase, Ms(seconds));
        }
        absl::StrAppend(&out, "\n");
      }
    }
    if (const ClusterOccupancy& o = r.occupancy; o.samples > 0) {
      // Placements wait for free GPUs when the GPUs are nearly all held and jobs queue: then a
      // faster coordinator would not place more.
      absl::StrAppendFormat(
          &out,
          "  cluster (%d scrapes, 1/s): GPUs allocated %.0f%% mean [%.0f%%..%.0f%%]; "
          "jobs pending %.0f mean [%.0f..%.0f]%s\n",
          o.samples, 100 * o.mean_gpus_allocated_share, 100 * o.gpus_allocated_share.min,
          100 * o.gpus_allocated_share.max, o.mean_pending_jobs, o.pending_jobs.min,
          o.pending_jobs.max,
          GpuBound(o) ? ": placements were bounded by free GPUs, not by the coordinator" : "");
    }
    absl::StrAppendFormat(&out,
                          "  load generator used %.2f cores, other processes %.2f cores; "
                          "coordinator RSS %.0f MiB after join, %d threads\n",
                          r.bench_cores, r.other_cores,
                          r.coordinator_rss_after_register_bytes / kMiB, r.coordinator_threads);
    const FleetCounters& f = r.fleet;
    if (f.watches_opened > 0 || f.end_announcements > 0) {
      absl::StrAppendFormat(&out,
                            "  out of slot: %d assignment watches opened, %d notices, %d task "
                            "ends announced, %d heartbeats sent for them; a worker's interval "
                            "restarts at each, so %d slots were skipped and %d heartbeats sent a "
                            "period after one out of slot instead; %d streams failed\n",
                            f.watches_opened, f.notices, f.end_announcements, f.notified_heartbeats,
                            f.slots_covered, f.timer_heartbeats, f.watch_failures);
    }
    if (f.heartbeat_failures + f.heartbeats_skipped + f.reregister_requests + f.register_failures +
            f.report_failures + f.health_failures + f.pacer_resets + r.jobs.submit_failures +
            r.jobs.skipped_in_flight + r.jobs.skipped_backlog >
        0) {
      absl::StrAppendFormat(
          &out,
          "  trouble: %d heartbeat failures, %d heartbeats skipped (previous still in flight), "
          "%d re-registrations asked, %d register failures, %d report failures, %d health-check "
          "failures, %d pacer resets; %d submit failures, %d submits skipped (in flight), %d "
          "skipped (backlog)\n",
          f.heartbeat_failures, f.heartbeats_skipped, f.reregister_requests, f.register_failures,
          f.report_failures, f.health_failures, f.pacer_resets, r.jobs.submit_failures,
          r.jobs.skipped_in_flight, r.jobs.skipped_backlog);
    }
    if (!f.first_error.empty()) absl::StrAppend(&out, "  first fleet error: ", f.first_error, "\n");
    if (!r.jobs.first_error.empty()) {
      absl::StrAppend(&out, "  first submit error: ", r.jobs.first_error, "\n");
    }
    for (const std::string& note : r.notes) absl::StrAppend(&out, "  note: ", note, "\n");
  }
  return out;
}

absl::Status WriteJson(const std::string& path, const RunInfo& info, const ScaleOptions& p,
                       const std::vector<ScaleResult>& results) {
  json scales = json::array();
  for (const ScaleResult& result : results) {
    json scale = ScaleJson(result);
    scale["gpus"] = result.nodes * p.fleet.gpus_per_node;
    scales.push_back(std::move(scale));
  }
  // PostgreSQL against SQLite, where both ran (control_plane_backends.h).
  json backend_comparisons = json::array();
  for (const BackendComparison& c : CompareBackends(results)) {
    auto side = [](const BackendComparison::Side& s) {
      return json{{"runs", s.runs},
                  {"median_heartbeat_p50_ms", Ms(s.heartbeat_p50_seconds)},
                  {"median_heartbeat_p99_ms", Ms(s.heartbeat_p99_seconds)},
                  {"median_jobs_placed_per_second", s.placed_per_second},
                  {"median_scheduling_p50_ms", Ms(s.scheduling_p50_seconds)},
                  {"median_scheduling_p99_ms", Ms(s.scheduling_p99_seconds)},
                  {"median_submit_p99_ms", Ms(s.submit_p99_seconds)},
                  {"median_register_seconds", s.register_seconds},
                  {"median_store_writes_per_second", s.store_writes_per_second},
                  {"median_store_write_mean_ms", Ms(s.store_write_mean_seconds)},
                  {"median_store_writer_cores", s.store_writer_cores},
                  {"median_coordinator_cores", s.coordinator_cores}};
    };
    auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
    backend_comparisons.push_back(
        {{"nodes", c.nodes},
         {"scenario", c.scenario},
         {"sqlite", side(c.sqlite)},
         {"postgresql", side(c.postgresql)},
         {"heartbeat_p99_ratio_postgresql_over_sqlite",
          ratio(c.postgresql.heartbeat_p99_seconds, c.sqlite.heartbeat_p99_seconds)},
         {"placed_ratio_postgresql_over_sqlite",
          ratio(c.postgresql.placed_per_second, c.sqlite.placed_per_second)}});
  }
  // The queues scenario against the single pool, where both ran (control_plane_queues.h).
  json comparisons = json::array();
  for (const ScenarioComparison& c : CompareScenarios(results)) {
    auto side = [](const ScenarioComparison::Side& s) {
      return json{{"runs", s.runs},
                  {"median_mean_pass_ms", Ms(s.pass_seconds)},
                  {"median_jobs_placed_per_second", s.placed_per_second},
                  {"median_mean_pending_jobs", s.pending_jobs},
                  {"median_coordinator_cores", s.coordinator_cores}};
    };
    auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
    comparisons.push_back({{"nodes", c.nodes},
                           {"backend", c.backend},
                           {"single_pool", side(c.single_pool)},
                           {"queues", side(c.queues)},
                           {"pass_ratio_queues_over_single_pool",
                            ratio(c.queues.pass_seconds, c.single_pool.pass_seconds)},
                           {"placed_ratio_queues_over_single_pool",
                            ratio(c.queues.placed_per_second, c.single_pool.placed_per_second)}});
  }
  json document = {
      {"benchmark", "control-plane"},
      {"commit", info.commit},
      {"date", info.date},
      {"machine", info.machine},
      {"baseline",
       "grpc.health.v1.Health/Check on the same coordinator and connections under the same load; "
       "ratio = heartbeat p50 / health-check p50"},
      {"scheduling_latency_definition",
       "from SubmitJob's return to the heartbeat response that delivered the job's last rank "
       "to a simulated worker (includes the wait for that node's next heartbeat)"},
      {"parameters",
       {{"gpus_per_node", p.fleet.gpus_per_node},
        {"gpu_name", p.fleet.gpu_name},
        {"heartbeat_interval_seconds", absl::ToDoubleSeconds(p.fleet.heartbeat_interval)},
        {"connections", p.fleet.channels},
        {"health_checks_per_second", p.fleet.health_checks_per_second},
        {"job_gpu_sizes", p.jobs.gpu_sizes},
        {"job_size_weights", p.jobs.weights},
        {"job_run_seconds_min", absl::ToDoubleSeconds(p.fleet.min_run_time)},
        {"job_run_seconds_max", absl::ToDoubleSeconds(p.fleet.max_run_time)},
        {"metric_steps_per_job", p.fleet.metric_steps_per_job},
        {"watch_assignments", p.fleet.watch_assignments},
        {"announce_ends", p.fleet.announce_ends},
        {"max_submits_in_flight", p.jobs.max_submits_in_flight},
        {"max_backlog", p.jobs.max_backlog},
        {"warmup_seconds", absl::ToDoubleSeconds(p.warmup)},
        {"duration_seconds", absl::ToDoubleSeconds(p.duration)},
        {"windows", p.windows},
        {"coordinator_heartbeat_timeout_seconds",
         absl::ToDoubleSeconds(p.coordinator_heartbeat_timeout)},
        {"coordinator_state_filesystem", info.state_filesystem}}},
      {"scales", scales},
      {"comparisons", comparisons},
      {"backend_comparisons", backend_comparisons},
  };
  std::ofstream out(path);
  if (!out) return ErrnoToStatus(errno, path);
  out << document.dump(2) << "\n";
  out.close();
  if (!out) return ErrnoToStatus(errno, absl::StrCat(path, ": write"));
  return absl::OkStatus();
}

}  // namespace tessera::bench
