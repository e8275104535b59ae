#include "tests/util/postgres_cluster.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/errno_status.h"
#include "common/status_macros.h"

namespace tessera {
namespace {

std::string Quoted(const std::string& text) { return absl::StrCat("'", text, "'"); }

bool Run(const std::string& command) { return std::system(command.c_str()) == 0; }

// A loopback port nothing listens on now: bound with port 0 and closed again (the kernel hands
// ephemeral ports out in turn, so it is not given to another socket soon after).
absl::StatusOr<int> FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoToStatus(errno, "socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(addr);
  absl::Status status;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    status = ErrnoToStatus(errno, "bind 127.0.0.1:0");
  } else if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    status = ErrnoToStatus(errno, "getsockname");
  }
  close(fd);
  if (!status.ok()) return status;
  return ntohs(addr.sin_port);
}

}  // namespace

absl::StatusOr<std::unique_ptr<PostgresCluster>> PostgresCluster::Start(
    const PostgresClusterOptions& options) {
  if (access((options.bin_dir + "/initdb").c_str(), X_OK) != 0) {
    return absl::NotFoundError(
        absl::StrCat("PostgreSQL server binaries not found in ", options.bin_dir,
                     " (install Debian's postgresql, or set ", kPostgresBinDirEnv, ")"));
  }
  std::string pattern = absl::StrCat(options.parent_dir, "/tessera-pg.XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) {
    return ErrnoToStatus(errno, absl::StrCat("mkdtemp ", pattern));
  }
  // As root, the server runs as nobody: it must own the directory (mkdtemp made it 0700).
  const bool root = geteuid() == 0;
  std::unique_ptr<PostgresCluster> cluster(
      new PostgresCluster(options.bin_dir, pattern, root ? "runuser -u nobody -- " : ""));
  if (root && !Run(absl::StrCat("chown nobody ", Quoted(cluster->dir_)))) {
    return absl::UnavailableError(absl::StrCat("chown nobody ", cluster->dir_, " failed"));
  }
  RETURN_IF_ERROR(cluster->CopyTemplate());
  ASSIGN_OR_RETURN(cluster->port_, FreeLoopbackPort());
  cluster->settings_ = {"listen_addresses=127.0.0.1"};
  if (!options.fsync) cluster->settings_.push_back("fsync=off");
  for (const std::string& setting : options.settings) cluster->settings_.push_back(setting);
  if (!options.password.empty()) {
    // Before the first start: no TCP connection is ever trusted.
    const std::string hba = cluster->dir_ + "/data/pg_hba.conf";
    std::ofstream out(hba, std::ios::trunc);
    out << "local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n";
    out.close();
    if (!out) return ErrnoToStatus(errno, hba);
  }
  if (!Run(absl::StrCat(cluster->as_user_, cluster->Tool("pg_ctl"), " -D ",
                        Quoted(cluster->dir_ + "/data"), " -l ",
                        Quoted(cluster->dir_ + "/server.log"), " -w -t 60 -o \"",
                        cluster->ServerOptions(), "\" start > /dev/null"))) {
    return absl::UnavailableError(
        absl::StrCat("pg_ctl start failed; see ", cluster->dir_, "/server.log"));
  }
  cluster->running_ = true;
  // A process killed by its timeout runs no destructor: a watchdog in the background stops the
  // server and removes the directory once this process is gone.
  Run(absl::StrCat("(while kill -0 ", getpid(), " 2>/dev/null; do sleep 1; done; ",
                   cluster->as_user_, cluster->Tool("pg_ctl"), " -D ",
                   Quoted(cluster->dir_ + "/data"), " -m immediate -w stop; rm -rf ",
                   Quoted(cluster->dir_), ") > /dev/null 2>&1 < /dev/null &"));
  if (!options.password.empty()) RETURN_IF_ERROR(cluster->RequirePassword(options.password));
  return cluster;
}

PostgresCluster::~PostgresCluster() {
  if (running_) {
    Run(absl::StrCat(as_user_, Tool("pg_ctl"), " -D ", Quoted(dir_ + "/data"),
                     " -m immediate -w stop > /dev/null 2>&1"));
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
}

std::string PostgresCluster::Tool(const std::string& name) const {
  return Quoted(bin_ + "/" + name);
}

std::string PostgresCluster::ServerOptions() const {
  std::string out = absl::StrCat("-p ", port_, " -k ", dir_);
  for (const std::string& setting : settings_) absl::StrAppend(&out, " -c ", setting);
  return out;
}

// initdb takes seconds and every test case is a process of its own (gtest_discover_tests): a
// data directory made once per user and binary directory is copied for each cluster. It is made
// aside and renamed into place, so a concurrent caller never copies a half-made one.
absl::Status PostgresCluster::CopyTemplate() {
  const std::string template_dir =
      absl::StrCat("/tmp/tessera-pg-template-v2-", geteuid(), "-", std::hash<std::string>()(bin_));
  if (access((template_dir + "/PG_VERSION").c_str(), R_OK) != 0) {
    const std::string making = absl::StrCat(dir_, "/template");
    if (!Run(absl::StrCat(as_user_, Tool("initdb"), " -D ", Quoted(making), " -U ",
                          kPostgresClusterUser,
                          " --auth=trust --no-locale -E UTF8 --no-sync --wal-segsize=1 > ",
                          Quoted(dir_ + "/initdb.log"), " 2>&1"))) {
      return absl::UnavailableError(absl::StrCat("initdb failed; see ", dir_, "/initdb.log"));
    }
    // Loses the race harmlessly when another caller made it first.
    std::rename(making.c_str(), template_dir.c_str());
  }
  if (!Run(absl::StrCat("cp -a ", Quoted(template_dir), " ", Quoted(dir_ + "/data")))) {
    return absl::UnavailableError(absl::StrCat("copying ", template_dir, " failed"));
  }
  return absl::OkStatus();
}

// Sets the role's password over the socket (trusted); pg_hba.conf already asks TCP clients for
// it. The password is given to psql on its standard input, never on a command line.
absl::Status PostgresCluster::RequirePassword(const std::string& password) {
  if (password.find('\'') != std::string::npos) {
    return absl::InvalidArgumentError("PostgresClusterOptions.password: no quotes, please");
  }
  const std::string command =
      absl::StrCat(Tool("psql"), " -q -v ON_ERROR_STOP=1 -h ", Quoted(dir_), " -p ", port_, " -U ",
                   kPostgresClusterUser, " -d postgres > /dev/null");
  FILE* psql = popen(command.c_str(), "w");
  if (psql == nullptr) return ErrnoToStatus(errno, "popen psql");
  const std::string sql =
      absl::StrCat("ALTER ROLE ", kPostgresClusterUser, " PASSWORD '", password, "';\n");
  std::fwrite(sql.data(), 1, sql.size(), psql);
  if (pclose(psql) != 0) {
    return absl::UnavailableError(
        absl::StrCat("setting the password of role ", kPostgresClusterUser, " failed"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> PostgresCluster::NewDatabase(const std::string& prefix) {
  const std::string name = absl::StrCat(prefix, "_", getpid(), "_", next_database_.fetch_add(1));
  if (!Run(absl::StrCat(Tool("createdb"), " -h ", Quoted(dir_), " -p ", port_, " -U ",
                        kPostgresClusterUser, " ", name))) {
    return absl::UnavailableError(
        absl::StrCat("createdb ", name, " failed; see ", dir_, "/server.log"));
  }
  return absl::StrCat("postgresql://", kPostgresClusterUser, "@127.0.0.1:", port_, "/", name);
}

absl::Status PostgresCluster::Restart() {
  if (!Run(absl::StrCat(as_user_, Tool("pg_ctl"), " -D ", Quoted(dir_ + "/data"), " -l ",
                        Quoted(dir_ + "/server.log"), " -w -t 60 -o \"", ServerOptions(),
                        "\" -m fast restart > /dev/null"))) {
    return absl::UnavailableError(absl::StrCat("pg_ctl restart failed; see ", dir_, "/server.log"));
  }
  return absl::OkStatus();
}

}  // namespace tessera
