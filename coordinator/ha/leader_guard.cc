// LeadershipInterceptorFactory (leader_guard.h): replaces the status of a call answered while
// the leadership is not valid. Thread safety as the header says.
#include "coordinator/ha/leader_guard.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/support/interceptor.h"
#include "grpcpp/support/status.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"
#include "tessera/v1/node_service.grpc.pb.h"

namespace tessera::coordinator {
namespace {

using ::grpc::experimental::InterceptionHookPoints;

class LeadershipInterceptor final : public grpc::experimental::Interceptor {
 public:
  LeadershipInterceptor(const std::function<bool()>* leading, const std::string* advertise)
      : leading_(leading), advertise_(advertise) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    // Checked when the answer leaves, not when the call arrives: a pause may fall in between.
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS) &&
        !(*leading_)()) {
      methods->ModifySendStatus(grpc::Status(
          grpc::StatusCode::UNAVAILABLE,
          absl::StrCat("coordinator ", *advertise_,
                       " lost leadership (its lease was not renewed in time); retry")));
    }
    methods->Proceed();
  }

 private:
  const std::function<bool()>* const leading_;
  const std::string* const advertise_;
};

class LeadershipInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  LeadershipInterceptorFactory(std::function<bool()> leading, std::string advertise)
      : leading_(std::move(leading)), advertise_(std::move(advertise)) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    const char* method = info->method();
    if (method == nullptr) return nullptr;
    const bool ours =
        absl::StartsWith(method, absl::StrCat("/", v1::Coordinator::service_full_name(), "/")) ||
        absl::StartsWith(method, absl::StrCat("/", v1::NodeService::service_full_name(), "/"));
    return ours ? new LeadershipInterceptor(&leading_, &advertise_) : nullptr;
  }

 private:
  const std::function<bool()> leading_;
  const std::string advertise_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeLeadershipInterceptorFactory(std::function<bool()> leading, std::string advertise_address) {
  return std::make_unique<LeadershipInterceptorFactory>(std::move(leading),
                                                        std::move(advertise_address));
}

}  // namespace tessera::coordinator
