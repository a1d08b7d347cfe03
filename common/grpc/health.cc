#include "common/grpc/health.h"

#include <grpcpp/health_check_service_interface.h>

namespace infinigen {

void SetHealth(grpc::Server& server, std::initializer_list<const char*> services, bool serving) {
  grpc::HealthCheckServiceInterface* health = server.GetHealthCheckService();
  if (health == nullptr) return;  // the default health service was not enabled
  health->SetServingStatus("", serving);
  for (const char* name : services) health->SetServingStatus(name, serving);
}

}  // namespace infinigen
