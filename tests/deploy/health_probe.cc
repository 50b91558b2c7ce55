// health_probe ADDRESS [SERVICE]: asks a gRPC server's standard health
// service (grpc.health.v1.Health/Check) about SERVICE (default "", the
// server as a whole) over plaintext, with a 5 s deadline, as Kubernetes'
// native gRPC probe does. Prints the answer; exits 0 when it is SERVING, 1
// for any other status or a failed call, 2 on bad usage. Debian packages no
// grpc_health_probe or grpcurl: tests/deploy/image_test.sh probes the shard
// running from the image with this.

#include <chrono>
#include <cstdio>
#include <string>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: %s HOST:PORT [SERVICE]\n", argv[0]);
    return 2;
  }
  const std::string address = argv[1];
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(argc == 3 ? argv[2] : "");

  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) {
    std::printf("%s service '%s': call failed: %d %s\n", address.c_str(), request.service().c_str(),
                static_cast<int>(status.error_code()), status.error_message().c_str());
    return 1;
  }
  std::printf("%s service '%s': %s\n", address.c_str(), request.service().c_str(),
              grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status()).c_str());
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}
