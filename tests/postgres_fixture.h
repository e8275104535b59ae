// A private PostgreSQL cluster for the tests of the store's PostgreSQL backend: initdb (once,
// copied for every cluster) into a temporary directory, pg_ctl start on a free loopback port (its
// unix socket in the same directory, so nothing under /var/run is touched), one fresh database per
// test, and pg_ctl stop when the test binary ends. initdb refuses to run as root (as CI does), so
// as root the server runs as `nobody`; as anyone else, as that user. Authentication is `trust` on
// loopback only.
//
// When the binaries are missing or the server does not start, Url() is empty and Reason() says
// why: tests then GTEST_SKIP() with it, so a skip is reported, never a silent pass.
//
// Thread safety: Shared() starts the one cluster of the process on first use (a function-local
// static); NewDatabase may be called from any test thread.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "tests/util/free_port.h"

namespace tessera::testing {

class PostgresCluster {
 public:
  // Where Debian's postgresql package puts the server's binaries; TESSERA_PG_BIN overrides it.
  static constexpr char kBinDirEnv[] = "TESSERA_PG_BIN";
  static constexpr char kDefaultBinDir[] = "/usr/lib/postgresql/15/bin";

  // The cluster of this test binary, started on first use.
  static PostgresCluster& Shared() {
    static PostgresCluster* cluster = new PostgresCluster();  // stopped by its atexit hook
    return *cluster;
  }

  bool ok() const { return !port_.empty(); }
  const std::string& Reason() const { return reason_; }

  // Restarts the server (pg_ctl restart -m fast, same port and settings): every connection is
  // dropped and refused until it is back. For tests of reconnecting; false when it did not
  // come back.
  bool Restart() {
    if (!ok()) return false;
    return Run(absl::StrCat(as_user_, Quoted(bin_ + "/pg_ctl"), " -D ", Quoted(dir_ + "/data"),
                            " -l ", Quoted(dir_ + "/server.log"),
                            " -w -t 60 -m fast restart > /dev/null"));
  }

  // A database of its own for one test: "postgresql://tessera@127.0.0.1:<port>/<name>", or ""
  // (see Reason()) when the cluster is not running or createdb fails.
  std::string NewDatabase() {
    if (!ok()) return "";
    const std::string name = absl::StrCat("test_", getpid(), "_", next_database_.fetch_add(1));
    if (!Run(absl::StrCat(Quoted(bin_ + "/createdb"), " -h 127.0.0.1 -p ", port_, " -U tessera ",
                          name))) {
      reason_ = absl::StrCat("createdb ", name, " failed; see ", dir_, "/server.log");
      return "";
    }
    return absl::StrCat("postgresql://tessera@127.0.0.1:", port_, "/", name);
  }

 private:
  PostgresCluster() {
    const char* bin = std::getenv(kBinDirEnv);
    bin_ = bin != nullptr && *bin != '\0' ? bin : kDefaultBinDir;
    if (access((bin_ + "/initdb").c_str(), X_OK) != 0) {
      reason_ = absl::StrCat("PostgreSQL server binaries not found in ", bin_,
                             " (install Debian's postgresql, or set ", kBinDirEnv, ")");
      return;
    }
    char pattern[] = "/tmp/tessera-pg.XXXXXX";
    if (mkdtemp(pattern) == nullptr) {
      reason_ = "mkdtemp failed";
      return;
    }
    dir_ = pattern;
    // As root, the server runs as nobody: it must own the directory (mkdtemp made it 0700).
    as_user_ = geteuid() == 0 ? "runuser -u nobody -- " : "";
    if (geteuid() == 0 && !Run(absl::StrCat("chown nobody ", Quoted(dir_)))) {
      reason_ = absl::StrCat("chown nobody ", dir_, " failed");
      return;
    }
    if (!CopyTemplate()) return;
    absl::StatusOr<int> port = PickFreePort();
    if (!port.ok()) {
      reason_ = std::string(port.status().message());
      return;
    }
    const std::string port_text = absl::StrCat(*port);
    // fsync off: the tests check what the store sends and when it returns, and
    // synchronous_commit (which the store checks) stays on; flushing every createdb and commit
    // to a disk that other tests share made each test case seconds slower.
    if (!Run(absl::StrCat(as_user_, Quoted(bin_ + "/pg_ctl"), " -D ", Quoted(dir_ + "/data"),
                          " -l ", Quoted(dir_ + "/server.log"), " -w -t 60 -o \"-p ", port_text,
                          " -k ", dir_,
                          " -c listen_addresses=127.0.0.1 -c fsync=off\" start > /dev/null"))) {
      reason_ = absl::StrCat("pg_ctl start failed; see ", dir_, "/server.log");
      return;
    }
    port_ = port_text;
    std::atexit(+[] { Shared().Stop(); });
    // A test process killed by its timeout runs no atexit hook: a watchdog in the background
    // stops the server and removes the directory once this process is gone.
    Run(absl::StrCat("(while kill -0 ", getpid(), " 2>/dev/null; do sleep 1; done; ", as_user_,
                     Quoted(bin_ + "/pg_ctl"), " -D ", Quoted(dir_ + "/data"),
                     " -m immediate -w stop; rm -rf ", Quoted(dir_),
                     ") > /dev/null 2>&1 < /dev/null &"));
  }

  // initdb takes seconds and every test case is a process of its own (gtest_discover_tests):
  // a data directory made once per user and binary directory is copied for each cluster. It is
  // made aside and renamed into place, so a concurrent test never copies a half-made one.
  bool CopyTemplate() {
    const std::string template_dir = absl::StrCat("/tmp/tessera-pg-template-v2-", geteuid(), "-",
                                                  std::hash<std::string>()(bin_));
    if (access((template_dir + "/PG_VERSION").c_str(), R_OK) != 0) {
      const std::string making = absl::StrCat(dir_, "/template");
      if (!Run(absl::StrCat(
              as_user_, Quoted(bin_ + "/initdb"), " -D ", Quoted(making),
              " -U tessera --auth=trust --no-locale -E UTF8 --no-sync --wal-segsize=1 > ",
              Quoted(dir_ + "/initdb.log"), " 2>&1"))) {
        reason_ = absl::StrCat("initdb failed; see ", dir_, "/initdb.log");
        return false;
      }
      // Loses the race harmlessly when another test made it first.
      std::rename(making.c_str(), template_dir.c_str());
    }
    if (!Run(absl::StrCat("cp -a ", Quoted(template_dir), " ", Quoted(dir_ + "/data")))) {
      reason_ = absl::StrCat("copying ", template_dir, " failed");
      return false;
    }
    return true;
  }

  void Stop() {
    if (port_.empty()) return;
    Run(absl::StrCat(as_user_, Quoted(bin_ + "/pg_ctl"), " -D ", Quoted(dir_ + "/data"),
                     " -m immediate -w stop > /dev/null 2>&1"));
    port_.clear();
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  static std::string Quoted(const std::string& text) { return absl::StrCat("'", text, "'"); }
  static bool Run(const std::string& command) { return std::system(command.c_str()) == 0; }

  std::string bin_;
  std::string dir_;
  std::string as_user_;
  std::string port_;  // empty unless running
  std::string reason_;
  std::atomic<int> next_database_{0};
};

}  // namespace tessera::testing
